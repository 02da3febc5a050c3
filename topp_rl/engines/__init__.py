"""Engines: prompts in, samples with their recorded kept sets out (the `RolloutEngine` protocol).

The embedded engine (in-process HF generation), the SGLang engine (servers, optionally behind a router) and the
vLLM engine (servers) load lazily on first attribute access, so importing the protocol stays cheap.
"""

from importlib import import_module
from typing import Any

from topp_rl.engines.base import RolloutEngine, check_prompts
from topp_rl.engines.versioned import VersionedEngine

_LAZY = {"EmbeddedEngine": "topp_rl.engines.embedded", "SGLangEngine": "topp_rl.engines.sglang",
         "VLLMEngine": "topp_rl.engines.vllm"}

__all__ = ["RolloutEngine", "VersionedEngine", "check_prompts", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'topp_rl.engines' has no attribute {name!r}")
