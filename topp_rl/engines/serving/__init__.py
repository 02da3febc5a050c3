"""The engine-neutral serving layer: what a rollout engine that talks to inference servers needs, whatever the
server (SGLang, `topp_rl.engines.sglang`; vLLM, `topp_rl.engines.vllm`; it must not import any engine).

- `client.py`: bounded, retried, streamed JSON calls over HTTP (`HTTPClient`, `Timeouts`, `Retries`, the wait lines,
  `RequestError` / `RequestTimeoutError`);
- `process.py`: a launched process group behind a watchdog that dies with the trainer, with its log and watcher;
- `launched.py`: what a launched server adds (the bounded health wait, stop, context manager);
- `wire.py`: the compact candidate-set wire format (base64 int32 ids + offsets);
- `weights.py`: a temp checkpoint for a load-from-disk push, and the trainer's side of a weight-broadcast group;
- `net.py`: loopback and port helpers.
"""

from topp_rl.engines.serving.client import (
    HTTPClient,
    RequestError,
    RequestTimeoutError,
    Retries,
    Timeouts,
)
from topp_rl.engines.serving.weights import WeightSyncStats

__all__ = ["HTTPClient", "RequestError", "RequestTimeoutError", "Retries", "Timeouts", "WeightSyncStats"]
