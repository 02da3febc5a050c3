"""Run a function on N CPU processes joined in a gloo process group, and collect each rank's result.

    results = run_distributed(fn, 4, arg1, arg2)   # fn(rank, arg1, arg2) on every rank; list in rank order

`fn` must be importable by name (a module-level function of a test module). Start-up is the slow part on a
small CPU machine (each rank would import torch, and megatron-core takes ~7 s more), so one launcher process is
spawned, imports `fn`'s module and the `preload` modules once, and forks the ranks from there. Forking is safe
because the launcher only imported modules (no torch thread pool exists yet); the parent, which may have used
torch threads, never forks. The group rendezvous through a file store in a fresh temporary directory, so
concurrent test runs never race for a TCP port. Results travel back as `torch.save` bytes (no shared memory).
A rank that raises or dies makes the call raise `RuntimeError` with every failing rank's traceback; on any
failure or timeout the launcher and all ranks are killed. Each rank uses one intra-op thread.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str = "gloo",
    preload: Sequence[str] = (),
) -> list[Any]:
    """Call `fn(rank, *args)` on `world_size` ranks of one process group; return the results in rank order.

    `preload`: modules `fn` imports lazily (e.g. "megatron.core"), imported once before the ranks fork.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="topp_rl_dist_") as tmp:
        job = (fn, world_size, args, os.path.join(tmp, "store"), backend, timeout)
        launcher = ctx.Process(target=_launch, args=(job, tuple(preload), results), name="dist-launcher")
        launcher.start()
        try:
            return _collect(launcher, results, world_size=world_size, timeout=timeout)
        finally:
            _kill_group(launcher)


def _collect(launcher, results: queue.Queue, *, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    failed: dict[int, str] = {}
    while len(out) + len(failed) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            if launcher.exitcode is not None:  # ranks flush their reports before exiting: none is coming
                failed[-1] = f"the launcher exited (code {launcher.exitcode}) before every rank reported"
                break
            if time.monotonic() > deadline:
                if failed:
                    break
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"rank(s) {missing} gave no result within {timeout:.0f} s") from None
            continue
        if ok:
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            continue
        failed[rank] = payload
        # The first report is often a peer's broken collective: wait briefly for the root cause too.
        deadline = min(deadline, time.monotonic() + 2.0)
    if failed:
        raise RuntimeError("\n".join(f"rank {r} of {world_size} failed:\n{tb}" if r >= 0 else tb
                                     for r, tb in sorted(failed.items())))
    return [out[i] for i in range(world_size)]


def _kill_group(launcher) -> None:
    """The launcher leads its own process group, which holds every rank: kill them all at once."""
    if launcher.pid is not None:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    launcher.join(10)


def _launch(job, preload: tuple[str, ...], results) -> None:
    os.setpgrp()
    for name in preload:
        importlib.import_module(name)
    fork = mp.get_context("fork")
    world_size = job[1]
    ranks = [fork.Process(target=_rank, args=(job, rank, results), name=f"rank{rank}") for rank in range(world_size)]
    for p in ranks:
        p.start()
    for rank, p in enumerate(ranks):
        p.join()
        if p.exitcode != 0:  # a clean failure exits 0 after reporting; anything else died without a report
            results.put((rank, False, f"rank {rank} died with exit code {p.exitcode} without a result"))


def _rank(job, rank: int, results) -> None:
    fn, world_size, args, store, backend, timeout = job
    _die_with_parent()
    torch.set_num_threads(1)  # ranks share few cores; oversubscription makes collectives crawl
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        buf = io.BytesIO()
        torch.save(fn(rank, *args), buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when the launcher dies, so no rank outlives a killed test."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
