"""The SGLang engine: real SGLang servers (launched here or given by URL), optionally behind a router."""

from topp_rl.engines.sglang.engine import (
    SGLangEngine,
    SGLangRequestError,
    SGLangTimeoutError,
    WeightSyncStats,
)

__all__ = ["SGLangEngine", "SGLangRequestError", "SGLangTimeoutError", "WeightSyncStats"]
