"""Weight sync into vLLM servers from disk, between rollouts: pause, push, refresh, resume.

`WeightSync.update` writes one temp HF checkpoint (`serving.weights.write_checkpoint`), then per worker, each call
bounded by the weight timeouts (`Timeouts.weights`):
1. `POST /pause?mode=abort` (between rollouts) or `mode=keep` (partial rollouts: the requests in flight stay): nothing
   runs during the push. vLLM's worker crashed (segfault) when a request ran while an update was open; paused, a
   request that arrives waits in the queue and is first scheduled after `/resume`, under the new weights. With
   `keep`, vLLM's pause also clears its caches (its `clear_cache` default): every running request is preempted, its
   KV dropped, and after `/resume` it recomputes prompt + tokens so far under the new weights (its later tokens are
   exact under them), the tokens it sampled before staying those of the old weights.
2. `POST /collective_rpc` `topp_rl_reload_weights` (the worker extension, `worker/topp_rl_vllm_worker.py`): vLLM's
   in-place `reload_weights` from the checkpoint, then a tied output head re-tied to the new embedding (vLLM's reload
   left it serving the old weights). With `method="distributed"` the tensors travel instead over a broadcast group
   whose rank 0 is the trainer (`serving.weights.BroadcastGroup`: gloo on CPU, NCCL on GPU; formed at the first
   update through `topp_rl_join_weight_group`, kept while the workers stay the same): per bucket of at most
   `bucket_bytes`, every worker's `topp_rl_receive_bucket` runs while the trainer broadcasts, then
   `topp_rl_load_received` loads them through the same in-place reload and head refresh. No file is written, so
   the servers need not share the trainer's file system, only reach its `host`.
3. `POST /reset_prefix_cache`: a reload does not clear it, and its blocks hold KV of the old weights, which later
   requests sharing a prefix would reuse (outputs then match neither model).
4. `POST /update_weight_version`: the version stamped on every token sampled from now on (the answers'
   `weight_versions` spans).
5. `POST /resume`.
A failed step raises and leaves the workers paused: resuming them on half-loaded weights would sample from a model
that is neither version.
"""

import contextlib
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from topp_rl.engines.serving.client import HTTPClient, parse_answer
from topp_rl.engines.serving.weights import BroadcastGroup, WeightSyncStats, iter_buckets, write_checkpoint

RELOAD_METHOD = "topp_rl_reload_weights"  # the worker extension's method
PauseMode = Literal["abort", "keep"]  # vLLM's /pause modes used: between rollouts, and with requests in flight
SyncMethod = Literal["disk", "distributed"]
SYNC_METHODS = ("disk", "distributed")
GROUP_NAME = "topp_rl_vllm_weights"


class WeightSync:
    """The updates of one engine's workers (`method`: from a disk checkpoint, or broadcast in buckets of at most
    `bucket_bytes` from `host`): after the k-th, they serve weight version str(k) unless told."""

    def __init__(
        self, client: HTTPClient, *, workdir: Path, method: SyncMethod = "disk", bucket_bytes: int = 512 << 20,
        host: str = "127.0.0.1",
    ) -> None:  # fmt: skip
        if method not in SYNC_METHODS:
            raise ValueError(f"rollout.engine.weight_sync={method!r} with rollout=vllm: choose disk or distributed")
        self.client, self.workdir, self.method = client, workdir, method
        self.bucket_bytes, self.host = bucket_bytes, host
        self.syncs = 0
        self.broadcast: BroadcastSender | None = None

    def post(self, url: str, path: str, body: dict[str, Any] | None = None, weight_bytes: int = 0) -> dict[str, Any]:
        bound = self.client.timeouts.weights(weight_bytes)
        status, text = self.client.call("POST", url, path, body, bound)
        return parse_answer("POST", url, path, status, text, label="vLLM")

    def update(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], workers: list[str], *, config_dir: Path | None,
        version: str | None = None, pause: PauseMode = "abort",
    ) -> WeightSyncStats:  # fmt: skip
        """Push `named_tensors` (HF names) into every worker, tagged `version` (default: the sync count), the
        requests in flight aborted (`pause="abort"`) or kept to continue under the new weights (`"keep"`)."""
        named = [(name, t.detach()) for name, t in named_tensors]
        if not named:
            raise ValueError("update_weights got no tensors; pass model.named_parameters() or a state_dict's items")
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        version = str(self.syncs + 1) if version is None else version
        with self._checkpoint(named, config_dir) as path:
            start = time.monotonic()
            for url in workers:
                self.pause(url, mode=pause)
            if path is None:
                buckets = self._sender(workers).send(named, bucket_bytes=self.bucket_bytes)
                for url in workers:
                    self.refresh(url, version=version)
            else:
                buckets = 1
                for url in workers:
                    self.push(url, path, nbytes=nbytes, version=version)
            for url in workers:
                self.post(url, "/resume")
        self.syncs += 1
        return WeightSyncStats(seconds=time.monotonic() - start, bytes=nbytes, buckets=buckets,
                               workers=tuple(workers), method=self.method, version=version)  # fmt: skip

    def _checkpoint(self, named: list[tuple[str, torch.Tensor]], config_dir: Path | None):
        """The temp checkpoint of a disk update (written before the workers pause); nothing to write otherwise."""
        if self.method == "disk":
            return write_checkpoint(named, config_dir=config_dir, parent=self.workdir)
        return contextlib.nullcontext(None)

    def _sender(self, workers: list[str]) -> "BroadcastSender":
        if self.broadcast is not None and self.broadcast.urls != workers:  # the workers changed: regroup
            self.close()
        if self.broadcast is None:
            self.broadcast = BroadcastSender(workers, post=self.post, host=self.host,
                                             timeout_s=self.client.timeouts.weights(self.bucket_bytes).total_s)  # fmt: skip
        return self.broadcast

    def close(self) -> None:
        if self.broadcast is not None:
            self.broadcast.close()
            self.broadcast = None

    def pause(self, url: str, *, mode: PauseMode = "abort") -> None:
        self.post(url, f"/pause?mode={mode}")

    def push(self, url: str, checkpoint: Path, *, nbytes: int, version: str) -> None:
        """Steps 2-4 on a paused worker from a disk checkpoint: reload with the tied-head refresh, then `refresh`."""
        self.post(url, "/collective_rpc", {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(checkpoint)}},
                  nbytes)  # fmt: skip
        self.refresh(url, version=version)

    def refresh(self, url: str, *, version: str) -> None:
        """Steps 3-4 on a paused worker whose weights were just loaded: prefix cache reset, version tag."""
        if not self.post(url, "/reset_prefix_cache").get("success"):  # blocks still held: old KV would be reused
            raise RuntimeError(f"vLLM server {url} did not reset its prefix cache after the weight reload (blocks "
                               "still held by requests); it stays paused rather than serve KV of the old weights")  # fmt: skip
        self.post(url, "/update_weight_version", {"new_version": version})


class BroadcastSender:
    """Rank 0 of a weight-broadcast group with every vLLM worker of `urls` (one worker per server: server k's is
    rank k + 1), driven through the worker extension's `/collective_rpc` methods."""

    def __init__(self, urls: list[str], *, post: Callable[..., dict[str, Any]], host: str, timeout_s: float) -> None:
        self.urls, self._post = list(urls), post

        def join(group: BroadcastGroup) -> list[Callable[[], Any]]:
            return [partial(self._rpc, url, "topp_rl_join_weight_group", host=host, port=group.port,
                            world_size=group.world_size, rank_offset=k + 1, backend=group.backend,
                            group_name=GROUP_NAME, timeout_s=timeout_s) for k, url in enumerate(self.urls)]  # fmt: skip

        self.group = BroadcastGroup(len(self.urls), join=join, peers=f"vLLM servers {self.urls}", host=host,
                                    group_name=GROUP_NAME, timeout_s=timeout_s)  # fmt: skip

    def _rpc(self, url: str, method: str, nbytes: int = 0, **kwargs: Any) -> dict[str, Any]:
        return self._post(url, "/collective_rpc", {"method": method, "kwargs": kwargs}, nbytes)

    def send(self, named: list[tuple[str, torch.Tensor]], *, bucket_bytes: int) -> int:
        """Broadcast `named` bucket by bucket, each received by every worker, then load them; returns the buckets."""
        count = 0
        for bucket in iter_buckets(named, bucket_bytes):
            tensors = [t.to(self.group.device).contiguous() for _, t in bucket]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors]}  # fmt: skip
            receives = [partial(self._rpc, url, "topp_rl_receive_bucket", nbytes, **body) for url in self.urls]
            self.group.broadcast(tensors, alongside=receives)
            count += 1
        for url in self.urls:
            self._rpc(url, "topp_rl_load_received", sum(t.numel() * t.element_size() for _, t in named))
        return count

    def close(self) -> None:
        for url in self.urls:
            with contextlib.suppress(Exception):  # the server may already be gone
                self._rpc(url, "topp_rl_leave_weight_group")
        self.group.close()
