"""Weight sync into SGLang servers: a temp checkpoint for `/update_weights_from_disk`, or a broadcast group for
`/update_weights_from_distributed` (the engine-neutral pieces, checkpoint and group, are `topp_rl.engines.serving.
weights`).

`WeightSync.update` is one update of the given workers, each addressed directly (a router routes no control
calls): pause its generation, push, resume; every call bounded by the weight timeouts (`Timeouts.weights`: a base
+ per GB). The pause mode (SGLang's `/pause_generation`):
- "abort" (`SGLangEngine.update_weights`, synchronous runs): a sample never mixes two weight versions; none is in
  flight between steps;
- "retract" / "in_place" (`SGLangEngine.update_weights_in_flight`, partial rollouts): the requests in flight
  continue under the new weights, SGLang recording where each switched (its per-token `weight_versions` spans).
  "retract" sends them back to the waiting queue, so nothing runs at the push and it flushes the prefix cache:
  they resume by recomputing their KV under the new weights (every later token exact under them). "in_place"
  keeps their KV (computed by the old weights) and the push cannot flush the cache: SGLang answers HTTP 400
  "Weights were updated, but the cache was not flushed ...", which is the weights' load succeeding
  (`update_answer`); the servers then run without a prefix cache (`without_prefix_cache`), else its old KV would
  serve later requests sharing a prefix.

The tensor path (`rollout.engine.placement=colocated`): per bucket one `/update_weights_from_tensor` whose body
carries handles, not bytes: CUDA IPC handles to the trainer's own GPU memory, or on CPU shared-memory files
(`shared_payload`); the server copies from them into its weights.

The distributed path: the trainer is rank 0 of a `BroadcastGroup` whose other ranks are the servers (server k
joins as rank k + 1 through `/init_weights_update_group`). Per update: `/begin_weight_update`, then per bucket
(`iter_buckets`, default 512 MiB) one `/update_weights_from_distributed` (names, dtypes, shapes) while rank 0
broadcasts each tensor of the bucket in the same order, then `/end_weight_update`. The named tensors are consumed
lazily (a TP-gathering source materialises one bucket at a time) and each bucket's HTTP wait is bounded by its
own size.
"""

import base64
import contextlib
import io
import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Literal

import torch
import torch.multiprocessing as torch_mp  # registers torch's reductions with ForkingPickler
from torch.multiprocessing import reductions as torch_reductions

from topp_rl.engines.serving.client import HTTPClient, parse_answer
from topp_rl.engines.serving.weights import (
    BroadcastGroup,
    WeightSyncStats,
    in_threads,
    iter_buckets,
    write_checkpoint,
)

PostFn = Callable[[str, str, dict[str, Any], int], dict[str, Any]]  # (url, path, body, weight bytes) -> JSON
SyncMethod = Literal["disk", "distributed", "tensor"]
InFlightPause = Literal["retract", "in_place"]  # the modes that keep the requests in flight
PauseMode = Literal["abort", "retract", "in_place"]
# SGLang 0.5.23's answer (HTTP 400, success false) to a weight update that loaded the weights but could not flush the
# prefix cache because requests are still running (`flush_cache_after_weight_update` in its weight_updater.py).
LOADED_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"
NO_PREFIX_CACHE = "--disable-radix-cache"


def without_prefix_cache(server_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`server_kwargs` with SGLang's prefix (radix) cache turned off, as `pause_mode="in_place"` needs: its update
    cannot flush the cache (requests are running), which would keep KV of the old weights for later requests."""
    extra = tuple(server_kwargs.get("extra_args", ()))
    return {**server_kwargs, "extra_args": extra if NO_PREFIX_CACHE in extra else (*extra, NO_PREFIX_CACHE)}


def update_answer(url: str, path: str, status: int, text: str) -> dict[str, Any]:
    """The JSON answer of a control call (`parse_answer`), where SGLang's "loaded, cache not flushed" answer is the
    weights' load succeeding: it comes only while requests run, i.e. after an in-place pause, whose requests keep
    their KV anyway (and the servers then run without a prefix cache: `SGLangEngine`)."""
    if status == 400:
        with contextlib.suppress(ValueError, AttributeError):
            answer = json.loads(text)
            if str(answer.get("message", "")).startswith(LOADED_NOT_FLUSHED):
                return answer
    return parse_answer("POST", url, path, status, text, label="SGLang")


class WeightSync:
    """The updates of one engine's workers: after the k-th, they serve weight version str(k). The broadcast group
    (`distributed`) is kept between updates and rebuilt when the workers change."""

    def __init__(self, client: HTTPClient, *, bucket_bytes: int, host: str, workdir: Path) -> None:
        self.client, self.bucket_bytes, self.host, self.workdir = client, bucket_bytes, host, workdir
        self.distributed: DistributedWeightSender | None = None
        self.syncs = 0

    def control(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A call that moves no weights (pause, memory), bounded by the weights' base timeout."""
        return self._post(url, path, body, 0)

    def _post(self, url: str, path: str, body: dict[str, Any], weight_bytes: int) -> dict[str, Any]:
        bound = self.client.timeouts.weights(weight_bytes)
        return update_answer(url, path, *self.client.call("POST", url, path, body, bound))

    def update(
        self, named: Iterable[tuple[str, torch.Tensor]], workers: list[str], *, method: SyncMethod,
        config_dir: Path | None, pause: PauseMode = "abort", version: str | None = None,
        tp_sizes: dict[str, int] | None = None,
    ) -> WeightSyncStats:  # fmt: skip
        """Pause `workers` (`pause` mode), push `named` by `method` (`config_dir`: the model's config files for a
        disk checkpoint; `tp_sizes`: each worker's TP ranks, which take one copy each of a `tensor` push) tagged
        `version` (default: the sync count), resume them."""
        start = time.monotonic()
        version = str(self.syncs + 1) if version is None else version
        for url in workers:
            self._post(url, "/pause_generation", {"mode": pause}, 0)
        if method == "distributed":
            nbytes, buckets = self._distributed(workers).send(
                named, bucket_bytes=self.bucket_bytes, version=version
            )
        elif method == "tensor":
            nbytes, buckets = self._tensor(named, workers, version, tp_sizes or {})
        else:
            nbytes, buckets = self._disk(named, workers, version, config_dir), 1
        for url in workers:
            self._post(url, "/continue_generation", {}, 0)
        self.syncs += 1
        return WeightSyncStats(seconds=time.monotonic() - start, bytes=nbytes, buckets=buckets,
                               workers=tuple(workers), method=method, version=version)  # fmt: skip

    def _distributed(self, workers: list[str]) -> "DistributedWeightSender":
        if self.distributed is not None and self.distributed.urls != workers:  # the fleet changed: regroup
            self.distributed.close()
            self.distributed = None
        if self.distributed is None:
            self.distributed = DistributedWeightSender(
                workers, post=self._post, host=self.host, group_name=f"topp_rl_weights_{self.syncs}",
                timeout_s=self.client.timeouts.weights(self.bucket_bytes).total_s,
            )  # fmt: skip
        return self.distributed

    def _disk(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], workers: list[str], version: str,
        config_dir: Path | None,
    ) -> int:  # fmt: skip
        named = [(name, t.detach()) for name, t in named_tensors]
        if not named:
            raise ValueError(
                "update_weights got no tensors; pass model.named_parameters() or a state_dict's items"
            )
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        body = {"flush_cache": True, "weight_version": version}
        with write_checkpoint(named, config_dir=config_dir, parent=self.workdir) as path:
            # Threads of their own, not the client's pool: with requests in flight (partial rollouts) every pool
            # thread may be waiting on a paused /generate.
            with in_threads([partial(self._post, url, "/update_weights_from_disk", {**body, "model_path": str(path)},
                                     nbytes) for url in workers]):  # fmt: skip
                pass
        return nbytes

    def _tensor(
        self, named: Iterable[tuple[str, torch.Tensor]], workers: list[str], version: str, tp_sizes: dict[str, int]
    ) -> tuple[int, int]:  # fmt: skip
        """`/update_weights_from_tensor` per bucket: the tensors travel as handles to memory the servers map
        (`shared_payload`), never through the HTTP body; returns (bytes, buckets)."""
        buckets = iter_buckets(named, self.bucket_bytes)
        first = next(buckets, None)
        if first is None:
            raise ValueError("update_weights got no tensors; pass model.named_parameters() or a state_dict's items")
        for url in workers:
            self._post(url, "/begin_weight_update", {}, 0)
        total = count = 0
        for bucket in itertools.chain([first], buckets):
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            with shared_payload(bucket) as payload:
                body = {"flush_cache": True, "weight_version": version}
                with in_threads([partial(self._post, url, "/update_weights_from_tensor",
                                         {**body, "serialized_named_tensors": [payload] * tp_sizes.get(url, 1)}, nbytes)
                                 for url in workers]):  # fmt: skip
                    pass
            total, count = total + nbytes, count + 1
        for url in workers:
            self._post(url, "/end_weight_update", {}, 0)
        return total, count

    def close(self) -> None:
        if self.distributed is not None:
            self.distributed.close()
            self.distributed = None


# Where torch's `rebuild_cuda_tensor` takes the tensor's device index (its parameter `storage_device`).
CUDA_DEVICE_ARG = 6


def _reduce_naming_device_by_uuid(tensor: torch.Tensor) -> tuple:
    """torch's multiprocessing reduction of a tensor, a CUDA one naming its device by UUID instead of by index: a
    server numbers GPUs by its own `CUDA_VISIBLE_DEVICES` (trainer rank 3's GPU is its GPU 0), and SGLang's receiving
    side looks a UUID up among the GPUs it sees."""
    rebuild, args = torch_reductions.reduce_tensor(tensor)
    if rebuild is torch_reductions.rebuild_cuda_tensor:
        args = with_device_uuid(args, str(torch.cuda.get_device_properties(args[CUDA_DEVICE_ARG]).uuid))
    return rebuild, args


def with_device_uuid(args: tuple, uuid: str) -> tuple:
    return (*args[:CUDA_DEVICE_ARG], uuid, *args[CUDA_DEVICE_ARG + 1:])


@contextlib.contextmanager
def shared_payload(bucket: Sequence[tuple[str, torch.Tensor]]) -> Iterator[str]:
    """One bucket as SGLang's `/update_weights_from_tensor` reads it (its `MultiprocessingSerializer`: torch's
    multiprocessing pickle of the (name, tensor) list, base64), valid while the block runs. A CUDA tensor travels as
    a CUDA IPC handle to the trainer's own memory, its device named by UUID (`_reduce_naming_device_by_uuid`); a
    CPU tensor is first copied (the trainer's parameters stay where they are) into a shared-memory file the server
    opens by name: torch's `file_system` strategy, as the default file-descriptor passing reaches only the sender's
    children and a server is not one."""
    tensors = [(name, t.detach() if t.is_cuda else t.detach().clone()) for name, t in bucket]
    before = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        pickler = ForkingPickler(buf)
        pickler.dispatch_table[torch.Tensor] = _reduce_naming_device_by_uuid
        pickler.dump(tensors)
    finally:
        torch_mp.set_sharing_strategy(before)
    try:
        yield base64.b64encode(buf.getvalue()).decode("ascii")
    finally:
        del tensors  # the copies (and their shared-memory files) go once the servers have loaded them


class DistributedWeightSender:
    """Rank 0 of a weight-broadcast group with every SGLang server in `urls` (`BroadcastGroup`), driven through
    SGLang's endpoints."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        post: PostFn,
        host: str = "127.0.0.1",
        backend: str | None = None,
        group_name: str = "topp_rl_weights",
        timeout_s: float = 300.0,
    ) -> None:
        self.urls, self._post, self.group_name = list(urls), post, group_name

        def join(group: BroadcastGroup) -> list[Callable[[], Any]]:
            return [partial(self._post, url, "/init_weights_update_group", {
                "master_address": host, "master_port": group.port, "rank_offset": k + 1,
                "world_size": group.world_size, "group_name": group_name, "backend": group.backend,
            }, 0) for k, url in enumerate(self.urls)]  # fmt: skip

        self.group = BroadcastGroup(len(self.urls), join=join, peers=f"SGLang servers {self.urls}", host=host,
                                    backend=backend, group_name=group_name, timeout_s=timeout_s)  # fmt: skip

    def send(
        self, named: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int, version: str
    ) -> tuple[int, int]:
        """Broadcast `named` in buckets of at most `bucket_bytes` (a bigger tensor alone); returns (bytes, buckets).
        The servers tag their weights `version` (SGLang's weight_version, echoed in every /generate answer)."""
        buckets = iter_buckets(named, bucket_bytes)
        first = next(buckets, None)
        if first is None:
            raise ValueError(
                "update_weights got no tensors; pass model.named_parameters() or a state_dict's items"
            )
        for url in self.urls:
            self._post(url, "/begin_weight_update", {}, 0)
        total = count = 0
        for bucket in itertools.chain([first], buckets):
            total += self._send_bucket(bucket, version)
            count += 1
        for url in self.urls:
            self._post(url, "/end_weight_update", {}, 0)
        return total, count

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: str) -> int:
        tensors = [t.detach().to(self.group.device).contiguous() for _, t in bucket]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        body = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": self.group_name,
            "flush_cache": True,
            "weight_version": version,
        }
        receives = [partial(self._post, url, "/update_weights_from_distributed", body, nbytes) for url in self.urls]
        self.group.broadcast(tensors, alongside=receives)
        return nbytes

    def close(self) -> None:
        for url in self.urls:
            with contextlib.suppress(Exception):  # the server may already be gone
                self._post(url, "/destroy_weights_update_group", {"group_name": self.group_name}, 0)
        self.group.close()
