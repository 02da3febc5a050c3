"""Weight sync into SGLang servers: a temp checkpoint for `/update_weights_from_disk`, or a broadcast group for
`/update_weights_from_distributed`.

`WeightSync.update` is one update of the given workers, each addressed directly (a router routes no control
calls): pause its generation ("abort": a sample never mixes two weight versions; none is in flight between
steps), push, resume; every call bounded by the weight timeouts (`Timeouts.weights`: a base + per GB).

The distributed path: the trainer is rank 0 of a group whose other ranks are the servers (server k joins as rank
k + 1 through `/init_weights_update_group`). SGLang builds its side with `sglang.srt.utils.
init_custom_process_group` (a TCP rendezvous, a PrefixStore named after the group, then torch's
`_new_process_group_helper`, outside the default process group). sglang is not importable from the trainer's
venv (its pins conflict with ours), so `_trainer_group` builds the same group with the same torch calls; a plain
`init_process_group` would create the default group instead and does not meet the server's rendezvous.
Per update: `/begin_weight_update`, then per bucket (`iter_buckets`: consecutive tensors up to `bucket_bytes`,
default 512 MiB; a bigger tensor goes alone) one `/update_weights_from_distributed` (names, dtypes, shapes) while
rank 0 broadcasts each tensor of the bucket in the same order, then `/end_weight_update`. Buckets bound what the
trainer holds at once: the named tensors are consumed lazily (a TP-gathering source materialises one bucket at a
time) and each bucket's HTTP wait is bounded by its own size.
Listeners: the trainer's TCPStore listens on a socket we bind to `host` ourselves (`master_listen_fd`; given only
a host name, torch binds every interface), and on a loopback `host` gloo / NCCL bind the loopback interface.
"""

import contextlib
import itertools
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from topp_rl.engines.sglang.client import SGLangClient
from topp_rl.engines.sglang.server import LOOPBACK_IFNAME, is_loopback

PostFn = Callable[[str, str, dict[str, Any], int], dict[str, Any]]  # (url, path, body, weight bytes) -> JSON
_CONFIG_FILES = ("config.json", "generation_config.json")
SyncMethod = Literal["disk", "distributed"]


@dataclass(frozen=True)
class WeightSyncStats:
    """One `update_weights` call, as the trainer logs it (`perf/weight_sync_s`, `perf/weight_sync_bytes`)."""

    seconds: float  # wall time from pausing the workers to resuming them
    bytes: int  # tensor bytes pushed (every worker receives all of them)
    buckets: int  # broadcast buckets (distributed); 1 for a disk checkpoint
    workers: tuple[str, ...]  # the worker URLs updated
    method: str  # "distributed" or "disk"
    version: str  # the weight version the workers serve from now on (SGLang's weight_version)


class WeightSync:
    """The updates of one engine's workers: after the k-th, they serve weight version str(k). The broadcast group
    (`distributed`) is kept between updates and rebuilt when the workers change."""

    def __init__(self, client: SGLangClient, *, bucket_bytes: int, host: str, workdir: Path) -> None:
        self.client, self.bucket_bytes, self.host, self.workdir = client, bucket_bytes, host, workdir
        self.distributed: DistributedWeightSender | None = None
        self.syncs = 0

    def _post(self, url: str, path: str, body: dict[str, Any], weight_bytes: int) -> dict[str, Any]:
        return self.client.post(url, path, body, self.client.timeouts.weights(weight_bytes))

    def update(
        self, named: Iterable[tuple[str, torch.Tensor]], workers: list[str], *, method: SyncMethod,
        config_dir: Path | None,
    ) -> WeightSyncStats:  # fmt: skip
        """Pause `workers`, push `named` by `method` (`config_dir`: the model's config files for a disk
        checkpoint), resume them."""
        start = time.monotonic()
        version = str(self.syncs + 1)
        for url in workers:
            self._post(url, "/pause_generation", {"mode": "abort"}, 0)
        if method == "distributed":
            nbytes, buckets = self._distributed(workers).send(
                named, bucket_bytes=self.bucket_bytes, version=version
            )
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
            futures = [self.client.submit(self._post, url, "/update_weights_from_disk",
                                          {**body, "model_path": str(path)}, nbytes) for url in workers]  # fmt: skip
            for fut in futures:
                fut.result()
        return nbytes

    def close(self) -> None:
        if self.distributed is not None:
            self.distributed.close()
            self.distributed = None


@contextlib.contextmanager
def write_checkpoint(
    named: Sequence[tuple[str, torch.Tensor]], *, config_dir: Path | None, parent: Path
) -> Iterator[Path]:
    """A temp HF checkpoint dir under `parent` (model.safetensors + the config files of `config_dir`), removed
    on exit; a killed process leaves it in `parent`, the engine's work dir, which the next start cleans."""
    if config_dir is None or not (Path(config_dir) / "config.json").is_file():
        raise ValueError(
            f"disk weight sync needs the model's config.json, not found in {config_dir}; "
            "pass model_path= (a local HF checkpoint dir) to SGLangEngine"
        )
    tmp = Path(tempfile.mkdtemp(prefix="weights-", dir=parent))
    try:
        # clone: tied parameters share storage, which safetensors refuses to write twice.
        tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in named}
        save_file(tensors, tmp / "model.safetensors")
        for name in _CONFIG_FILES:
            if (Path(config_dir) / name).is_file():
                shutil.copy(Path(config_dir) / name, tmp / name)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class DistributedWeightSender:
    """Rank 0 of a weight-broadcast group with every server in `urls`; gloo for CPU tensors, nccl for CUDA."""

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
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.world_size = len(self.urls) + 1
        self.timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        port = listener.getsockname()[1]
        store = dist.TCPStore(host, port, self.world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.detach())  # fmt: skip
        calls = [
            (url, "/init_weights_update_group", {
                "master_address": host, "master_port": port, "rank_offset": k + 1,
                "world_size": self.world_size, "group_name": group_name, "backend": self.backend,
            })
            for k, url in enumerate(self.urls)
        ]  # fmt: skip
        with (
            _in_threads(lambda url, path, b: self._post(url, path, b, 0), calls),
            _pinned_to_loopback(is_loopback(host)),
        ):
            try:
                self.group = _trainer_group(store, self.world_size, self.backend, group_name, timeout)
            except RuntimeError as err:
                raise RuntimeError(
                    f"weight-sync group with SGLang servers {self.urls} not formed within {timeout_s:.0f} s: "
                    f"{err}; check that the servers can reach {host}:{port} (weight_sync_host)"
                ) from None

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
        device = "cuda" if self.backend == "nccl" else "cpu"
        tensors = [t.detach().to(device).contiguous() for _, t in bucket]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        body = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": self.group_name,
            "flush_cache": True,
            "weight_version": version,
        }
        calls = [(url, "/update_weights_from_distributed", body) for url in self.urls]
        with _in_threads(lambda url, path, b: self._post(url, path, b, nbytes), calls):
            try:
                for t in tensors:  # the servers post one receive per name, in this order
                    dist.broadcast(t, src=0, group=self.group)
            except RuntimeError as err:  # gloo / NCCL timeout: a server stopped receiving
                raise RuntimeError(
                    f"weight broadcast to SGLang servers {self.urls} failed or took over {self.timeout_s:.0f} s "
                    f"(weight-update bound of one bucket): {err}"
                ) from None
        return nbytes

    def close(self) -> None:
        for url in self.urls:
            with contextlib.suppress(Exception):  # the server may already be gone
                self._post(url, "/destroy_weights_update_group", {"group_name": self.group_name}, 0)
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.group)


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) runs of at most `bucket_bytes` each; a tensor larger than that is its own run."""
    if bucket_bytes < 1:
        raise ValueError(f"weight_bucket_bytes ({bucket_bytes}) must be >= 1; SGLang's usual size is 512 MiB")
    bucket, size = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def _trainer_group(
    store: dist.Store, world_size: int, backend: str, group_name: str, timeout: timedelta
) -> dist.ProcessGroup:
    """Rank 0's side of SGLang's `init_custom_process_group`: same PrefixStore name, same helper."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    prefixed = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, 0, [], Backend(backend), prefixed, group_name=group_name, backend_options=None,
        timeout=timeout, device_id=None,
    )  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@contextlib.contextmanager
def _pinned_to_loopback(active: bool) -> Iterator[None]:
    """Gloo and NCCL pick their socket interface from these variables when a group is built (read once, in the
    constructor); unset, gloo binds whatever the host name resolves to. A user's own setting wins."""
    names = [n for n in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if active and n not in os.environ]
    os.environ.update(dict.fromkeys(names, LOOPBACK_IFNAME))
    try:
        yield
    finally:
        for name in names:
            os.environ.pop(name, None)


@contextlib.contextmanager
def _in_threads(
    post: Callable[[str, str, dict[str, Any]], Any], calls: list[tuple[str, str, dict[str, Any]]]
) -> Iterator[None]:
    """Run blocking HTTP calls in background threads around the body (they return once the collective ends);
    re-raise the first error."""
    errors: list[BaseException] = []

    def run(url: str, path: str, body: dict[str, Any]) -> None:
        try:
            post(url, path, body)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=call, daemon=True) for call in calls]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
