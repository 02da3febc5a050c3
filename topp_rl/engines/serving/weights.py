"""Engine-neutral pieces of a weight push into inference servers: a temp HF checkpoint for a load-from-disk call,
and the trainer's side of a weight-broadcast group built outside the default process group.

`BroadcastGroup`: the trainer is rank 0 of a group whose other ranks are the servers. Servers build their side
with their own helper (SGLang: `sglang.srt.utils.init_custom_process_group`: a TCP rendezvous, a PrefixStore named
after the group, then torch's `_new_process_group_helper`); server code is not importable from the trainer's venv,
so `trainer_group` builds the same group with the same torch calls (a plain `init_process_group` would create the
default group instead and never meet the servers' rendezvous). The engine says how its servers join (`join`: the
blocking calls, e.g. HTTP requests, run in threads while rank 0 joins) and what they receive alongside each
broadcast. Buckets (`iter_buckets`: consecutive tensors up to `bucket_bytes`; a bigger tensor goes alone) bound
what the trainer holds at once.
Listeners: the trainer's TCPStore listens on a socket we bind to `host` ourselves (`master_listen_fd`; given only
a host name, torch binds every interface), and on a loopback `host` gloo / NCCL bind the loopback interface.
"""

import contextlib
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from topp_rl.engines.serving.net import LOOPBACK_IFNAME, is_loopback

_CONFIG_FILES = ("config.json", "generation_config.json")


@dataclass(frozen=True)
class WeightSyncStats:
    """One `update_weights` call, as the trainer logs it (`perf/weight_sync_s`, `perf/weight_sync_bytes`)."""

    seconds: float  # wall time from pausing the workers to resuming them
    bytes: int  # tensor bytes pushed (every worker receives all of them)
    buckets: int  # broadcast buckets (distributed); 1 for a disk checkpoint
    workers: tuple[str, ...]  # the worker URLs updated
    method: str  # "distributed" or "disk"
    version: str  # the weight version the workers serve from now on


@contextlib.contextmanager
def write_checkpoint(
    named: Sequence[tuple[str, torch.Tensor]], *, config_dir: Path | None, parent: Path
) -> Iterator[Path]:
    """A temp HF checkpoint dir under `parent` (model.safetensors + the config files of `config_dir`), removed
    on exit; a killed process leaves it in `parent`, the engine's work dir, which the next start cleans."""
    if config_dir is None or not (Path(config_dir) / "config.json").is_file():
        raise ValueError(
            f"disk weight sync needs the model's config.json, not found in {config_dir}; "
            "pass model_path= (a local HF checkpoint dir) to the engine"
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


class BroadcastGroup:
    """Rank 0 of a weight-broadcast group with `receivers` servers (ranks 1..receivers); gloo for CPU tensors,
    nccl for CUDA. `join(group)`: the blocking calls that make the servers join (run in threads while rank 0
    joins, given the group's `host`, `port`, `world_size`, `backend`, `group_name`); `peers` names the servers
    in errors."""

    def __init__(
        self,
        receivers: int,
        *,
        join: Callable[["BroadcastGroup"], list[Callable[[], Any]]],
        peers: str,
        host: str = "127.0.0.1",
        backend: str | None = None,
        group_name: str = "topp_rl_weights",
        timeout_s: float = 300.0,
    ) -> None:
        self.host, self.group_name, self.peers, self.timeout_s = host, group_name, peers, timeout_s
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.world_size = receivers + 1
        timeout = timedelta(seconds=timeout_s)
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = listener.getsockname()[1]
        store = dist.TCPStore(host, self.port, self.world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.detach())  # fmt: skip
        with in_threads(join(self)), pinned_to_loopback(is_loopback(host)):
            try:
                self.group = trainer_group(store, self.world_size, self.backend, group_name, timeout)
            except RuntimeError as err:
                raise RuntimeError(
                    f"weight-sync group with {peers} not formed within {timeout_s:.0f} s: {err}; check that the "
                    f"servers can reach {host}:{self.port} (weight_sync_host)"
                ) from None

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def broadcast(self, tensors: Sequence[torch.Tensor], *, alongside: list[Callable[[], Any]]) -> None:
        """Broadcast `tensors` in order while the `alongside` calls (the servers' receive requests) run in threads."""
        with in_threads(alongside):
            try:
                for t in tensors:  # the servers post one receive per tensor, in this order
                    dist.broadcast(t, src=0, group=self.group)
            except RuntimeError as err:  # gloo / NCCL timeout: a server stopped receiving
                raise RuntimeError(
                    f"weight broadcast to {self.peers} failed or took over {self.timeout_s:.0f} s "
                    f"(weight-update bound of one bucket): {err}"
                ) from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.group)


def trainer_group(
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
def pinned_to_loopback(active: bool) -> Iterator[None]:
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
def in_threads(calls: list[Callable[[], Any]]) -> Iterator[None]:
    """Run blocking calls (HTTP requests that return once the collective ends) in background threads around the
    body; re-raise the first error."""
    errors: list[BaseException] = []

    def run(call: Callable[[], Any]) -> None:
        try:
            call()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(call,), daemon=True) for call in calls]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
