"""Tasks: what to ask (prompts from an example index) and how to score it (reward functions, answer checkers, reward
models and reward services).

Datasets (file-backed tasks), the reward model and the reward service load lazily on first attribute access.
"""

from importlib import import_module
from typing import Any

from topp_rl.tasks.base import Task
from topp_rl.tasks.generated import ArithmeticTask, CopyDigitTask, CountdownTask
from topp_rl.tasks.rewards import RewardError, resolve_reward_fn

_LAZY = {
    "DatasetTask": "topp_rl.tasks.datasets",
    "JsonlTask": "topp_rl.tasks.datasets",
    "RewardModel": "topp_rl.tasks.reward_model",
    "RewardService": "topp_rl.tasks.reward_service",
}

__all__ = ["ArithmeticTask", "CopyDigitTask", "CountdownTask", "RewardError", "Task", "resolve_reward_fn", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'topp_rl.tasks' has no attribute {name!r}")
