"""Rollout side: samples, wire format, engines, tasks and the datamodule.

Heavy pieces (transformers, lightning, the SGLang client) load lazily on first attribute access, so
`import topp_rl.rollout` stays cheap for the numerics code.
"""

from importlib import import_module
from typing import Any

from topp_rl.rollout.engine import RolloutEngine
from topp_rl.rollout.params import SamplingParams
from topp_rl.rollout.sample import Sample, SampleStatus

_LAZY = {
    "EmbeddedEngine": "topp_rl.rollout.embedded",
    "SGLangEngine": "topp_rl.rollout.sglang",
    "PackedBatch": "topp_rl.rollout.packing",
    "RolloutBatch": "topp_rl.rollout.packing",
    "pack_samples": "topp_rl.rollout.packing",
    "RolloutDataModule": "topp_rl.rollout.datamodule",
    "RolloutTicket": "topp_rl.rollout.datamodule",
    "Task": "topp_rl.rollout.tasks",
    "ArithmeticTask": "topp_rl.rollout.tasks",
    "CopyDigitTask": "topp_rl.rollout.tasks",
    "CountdownTask": "topp_rl.rollout.tasks",
    "DatasetTask": "topp_rl.rollout.datasets",
    "JsonlTask": "topp_rl.rollout.datasets",
}

__all__ = ["RolloutEngine", "Sample", "SampleStatus", "SamplingParams", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'topp_rl.rollout' has no attribute {name!r}")
