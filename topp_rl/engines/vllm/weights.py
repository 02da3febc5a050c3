"""Weight sync into vLLM servers from disk, between rollouts: pause, push, refresh, resume.

`WeightSync.update` writes one temp HF checkpoint (`serving.weights.write_checkpoint`), then per worker, each call
bounded by the weight timeouts (`Timeouts.weights`):
1. `POST /pause?mode=abort`: nothing runs during the push. vLLM's worker crashed (segfault) when a request ran while
   an update was open; paused, a request that arrives waits in the queue and is first scheduled after `/resume`,
   under the new weights.
2. `POST /collective_rpc` `topp_rl_reload_weights` (the worker extension, `worker/topp_rl_vllm_worker.py`): vLLM's
   in-place `reload_weights` from the checkpoint, then a tied output head re-tied to the new embedding (vLLM's reload
   left it serving the old weights).
3. `POST /reset_prefix_cache`: a reload does not clear it, and its blocks hold KV of the old weights, which later
   requests sharing a prefix would reuse (outputs then match neither model).
4. `POST /update_weight_version`: the version stamped on every token sampled from now on (the answers'
   `weight_versions` spans).
5. `POST /resume`.
A failed step raises and leaves the workers paused: resuming them on half-loaded weights would sample from a model
that is neither version.
"""

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from topp_rl.engines.serving.client import HTTPClient, parse_answer
from topp_rl.engines.serving.weights import WeightSyncStats, write_checkpoint

RELOAD_METHOD = "topp_rl_reload_weights"  # the worker extension's method


class WeightSync:
    """The disk updates of one engine's workers: after the k-th, they serve weight version str(k) unless told."""

    def __init__(self, client: HTTPClient, *, workdir: Path) -> None:
        self.client, self.workdir = client, workdir
        self.syncs = 0

    def post(self, url: str, path: str, body: dict[str, Any] | None = None, weight_bytes: int = 0) -> dict[str, Any]:
        bound = self.client.timeouts.weights(weight_bytes)
        status, text = self.client.call("POST", url, path, body, bound)
        return parse_answer("POST", url, path, status, text, label="vLLM")

    def update(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], workers: list[str], *, config_dir: Path | None,
        version: str | None = None,
    ) -> WeightSyncStats:  # fmt: skip
        """Push `named_tensors` (HF names) into every worker, tagged `version` (default: the sync count)."""
        named = [(name, t.detach()) for name, t in named_tensors]
        if not named:
            raise ValueError("update_weights got no tensors; pass model.named_parameters() or a state_dict's items")
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        version = str(self.syncs + 1) if version is None else version
        with write_checkpoint(named, config_dir=config_dir, parent=self.workdir) as path:
            start = time.monotonic()
            for url in workers:
                self.pause(url)
            for url in workers:
                self.push(url, path, nbytes=nbytes, version=version)
            for url in workers:
                self.post(url, "/resume")
        self.syncs += 1
        return WeightSyncStats(seconds=time.monotonic() - start, bytes=nbytes, buckets=1, workers=tuple(workers),
                               method="disk", version=version)  # fmt: skip

    def pause(self, url: str) -> None:
        self.post(url, "/pause?mode=abort")

    def push(self, url: str, checkpoint: Path, *, nbytes: int, version: str) -> None:
        """Steps 2-4 on a paused worker: reload with the tied-head refresh, prefix cache reset, version tag."""
        self.post(url, "/collective_rpc", {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(checkpoint)}},
                  nbytes)
        self.post(url, "/reset_prefix_cache")
        self.post(url, "/update_weight_version", {"new_version": version})
