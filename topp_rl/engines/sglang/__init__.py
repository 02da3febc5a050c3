"""The SGLang engine: real SGLang servers (launched here or given by URL), optionally behind a router."""

from topp_rl.engines.sglang.client import Retries, SGLangRequestError, SGLangTimeoutError, Timeouts
from topp_rl.engines.sglang.engine import SGLangEngine
from topp_rl.engines.sglang.weights import WeightSyncStats

__all__ = [
    "Retries",
    "SGLangEngine",
    "SGLangRequestError",
    "SGLangTimeoutError",
    "Timeouts",
    "WeightSyncStats",
]
