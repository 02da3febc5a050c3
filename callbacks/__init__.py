"""Lightning callbacks: train/rollout mismatch, candidate-set sizes, rollout figures, completions, weight sync,
health alarms, held-out evaluation."""

from topp_rl.callbacks.completions import CompletionsLog
from topp_rl.callbacks.evaluation import Evaluation
from topp_rl.callbacks.health import TrainingHealth
from topp_rl.callbacks.mismatch import LogProbMismatch
from topp_rl.callbacks.rollout_stats import RolloutStats
from topp_rl.callbacks.support import SupportStats
from topp_rl.callbacks.weight_sync import WeightSync

__all__ = [
    "CompletionsLog",
    "Evaluation",
    "LogProbMismatch",
    "RolloutStats",
    "SupportStats",
    "TrainingHealth",
    "WeightSync",
]
