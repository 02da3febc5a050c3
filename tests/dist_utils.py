"""Run a function on N CPU processes joined in a gloo process group, and collect each rank's result.

    results = run_distributed(fn, 4, arg1, arg2)   # fn(rank, arg1, arg2) on every rank; list in rank order

`fn` must be importable by name (a module-level function of a test module): ranks start with the "spawn"
method, which is safe after the parent has used torch threads (fork is not). The group rendezvous through a
file store in a fresh temporary directory, so concurrent test runs never race for a TCP port. Results travel
back as `torch.save` bytes, so tensors need no shared memory. A rank that raises makes the call raise
`RuntimeError` with that rank's traceback; ranks still running are killed. Each rank uses one intra-op thread.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, backend: str = "gloo"
) -> list[Any]:
    """Call `fn(rank, *args)` on `world_size` ranks of one process group; return the results in rank order."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = mp.get_context("spawn")
    results: queue.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="topp_rl_dist_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(fn, rank, world_size, store, backend, timeout, results, args),
                        name=f"rank{rank}", daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout=timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)


def _collect(procs: list, results: queue.Queue, *, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    while len(out) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=1.0)
        except queue.Empty:
            if _dead_without_result(procs, out):
                _raise_failures(procs, results, out, {})
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(out))
                raise TimeoutError(f"rank(s) {missing} gave no result within {timeout:.0f} s") from None
            continue
        if not ok:
            _raise_failures(procs, results, out, {rank: payload})
        out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [out[i] for i in range(len(procs))]


def _dead_without_result(procs: list, out: dict[int, Any]) -> list[int]:
    return [i for i, p in enumerate(procs) if i not in out and p.exitcode is not None]


def _raise_failures(procs: list, results: queue.Queue, out: dict[int, Any], failed: dict[int, str]) -> None:
    """Raise with every failing rank's traceback: the first report is often a peer's broken collective, so
    wait briefly for the others (the root cause) before raising."""
    grace = time.monotonic() + 2.0
    while time.monotonic() < grace and len(failed) + len(out) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            continue
        if not ok:
            failed[rank] = payload
    parts = [f"rank {r} of {len(procs)} failed:\n{tb}" for r, tb in sorted(failed.items())]
    dead = [i for i in _dead_without_result(procs, out) if i not in failed]
    if dead:
        parts.append(f"rank(s) {dead} exited (codes {[procs[i].exitcode for i in dead]}) without a result; "
                     "see their stderr above")
    raise RuntimeError("\n".join(parts))


def _child(fn, rank, world_size, store, backend, timeout, results, args) -> None:
    torch.set_num_threads(1)  # ranks share few cores; oversubscription makes collectives crawl
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        value = fn(rank, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
