"""The SGLang engine: real SGLang servers (launched here or given by URL), optionally behind a router.

What is SGLang's own lives here (server launch flags, the /generate codec, the router, SGLang's weight-update
endpoints, routed experts); the engine-neutral parts (HTTP client, process groups, candidate wire format, the
weight broadcast) are `topp_rl.engines.serving`.
"""

from topp_rl.engines.sglang.engine import ColocatedSGLangEngine, SGLangEngine

__all__ = ["ColocatedSGLangEngine", "SGLangEngine"]
