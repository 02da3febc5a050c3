"""The vLLM engine: real vLLM servers (launched here on CPU or given by URL), kept sets read from their processed
log-probs. What is vLLM's own lives here (server flags, the codec, the weight-reload calls and the worker
extension); the engine-neutral parts are `topp_rl.engines.serving`.
"""

from topp_rl.engines.vllm.engine import VLLMEngine
from topp_rl.engines.vllm.server import VLLMServer

__all__ = ["VLLMEngine", "VLLMServer"]
