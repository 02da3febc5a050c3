"""Lightning callbacks: train/rollout mismatch, candidate-set sizes, rollout figures, weight sync, health alarms,
held-out evaluation."""

from callbacks.evaluation import Evaluation
from callbacks.health import TrainingHealth
from callbacks.mismatch import LogProbMismatch
from callbacks.rollout_stats import RolloutStats
from callbacks.support import SupportStats
from callbacks.weight_sync import WeightSync

__all__ = ["Evaluation", "LogProbMismatch", "RolloutStats", "SupportStats", "TrainingHealth", "WeightSync"]
