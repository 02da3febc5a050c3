"""Lightning callbacks: train/rollout mismatch, candidate-set sizes, rollout figures, completions, weight sync,
health alarms, held-out evaluation."""

from callbacks.completions import CompletionsLog
from callbacks.evaluation import Evaluation
from callbacks.health import TrainingHealth
from callbacks.mismatch import LogProbMismatch
from callbacks.rollout_stats import RolloutStats
from callbacks.support import SupportStats
from callbacks.weight_sync import WeightSync

__all__ = [
    "CompletionsLog",
    "Evaluation",
    "LogProbMismatch",
    "RolloutStats",
    "SupportStats",
    "TrainingHealth",
    "WeightSync",
]
