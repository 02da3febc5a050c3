"""The engine-neutral serving layer: what a rollout engine that talks to inference servers needs, whatever the
server (SGLang today, `topp_rl.engines.sglang`; it must not import any engine).

- `client.py`: bounded, retried, streamed JSON calls over HTTP (`HTTPClient`, `Timeouts`, `Retries`, the wait lines,
  `RequestError` / `RequestTimeoutError`);
- `process.py`: a launched process group behind a watchdog that dies with the trainer, with its log and watcher;
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
