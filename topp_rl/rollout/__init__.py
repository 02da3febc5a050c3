"""The rollout pipeline (datamodule: the rollout step (generate -> number -> score) -> filter -> pack,
advantages, broadcast, prefetch), and the names users import from here: the contracts (`topp_rl.data`), the engines
(`topp_rl.engines`) and the tasks (`topp_rl.tasks`) re-exported.

Heavy pieces (transformers, lightning, the SGLang client) load lazily on first attribute access, so
`import topp_rl.rollout` stays cheap for the numerics code.
"""

from importlib import import_module
from typing import Any

from topp_rl.data import PackedBatch, PromptRecord, RolloutBatch, Sample, SampleStatus, SamplingParams
from topp_rl.engines.base import RolloutEngine

_LAZY = {
    "EmbeddedEngine": "topp_rl.engines.embedded",
    "SGLangEngine": "topp_rl.engines.sglang",
    "encode_candidates": "topp_rl.engines.serving.wire",
    "decode_candidates": "topp_rl.engines.serving.wire",
    "pack_samples": "topp_rl.rollout.packing",
    "RolloutDataModule": "topp_rl.rollout.datamodule",
    "RolloutTicket": "topp_rl.rollout.datamodule",
    "RolloutStep": "topp_rl.rollout.step",
    "SingleTurnStep": "topp_rl.rollout.step",
    "AgentLoopStep": "topp_rl.rollout.agent_step",
    "Task": "topp_rl.tasks",
    "ArithmeticTask": "topp_rl.tasks",
    "CopyDigitTask": "topp_rl.tasks",
    "CountdownTask": "topp_rl.tasks",
    "DatasetTask": "topp_rl.tasks",
    "JsonlTask": "topp_rl.tasks",
}

__all__ = ["PackedBatch", "PromptRecord", "RolloutBatch", "RolloutEngine", "Sample", "SampleStatus", "SamplingParams",
           *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'topp_rl.rollout' has no attribute {name!r}")
