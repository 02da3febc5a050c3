"""Run a piece of Python code in a process of its own, limited (the `python` tool of `task=python_tool`).

`run_python(code, limits)` starts `sandbox_child.py` in a new session (its own process group) under the
interpreter running this process, hands it the code on stdin, and returns a `SandboxResult`:
- CPU seconds (RLIMIT_CPU) and address space (RLIMIT_AS) limits, a file-size limit, set in the child and
  inherited by anything it forks;
- a wall timeout: on expiry the whole process group is killed (SIGKILL), and it is killed in any case once the
  child exits, so processes it left behind do not outlive the call;
- no network: a network namespace of its own (`unshare(CLONE_NEWUSER | CLONE_NEWNET)`, unprivileged where
  user namespaces are allowed) when this machine allows it, else an audit hook refusing socket calls
  (`network_isolation()` says which this machine gives);
- writes confined to a scratch dir made for the call (its cwd; removed afterwards) by an audit hook;
- stdout cut at `output_bytes` (the group is killed when it passes it), stderr cut to its last `output_bytes` (the
  end of a traceback), each cut marked.

It is not a security boundary for hostile code (docs/agents.md: what it does not protect against, and where a
container or a remote sandbox plugs in).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from topp_rl.tasks import sandbox_child

CHILD = Path(sandbox_child.__file__)
_CHUNK = 65536


class Outcome(StrEnum):
    OK = "ok"  # exited 0 within every limit
    ERROR = "error"  # an exception in the code, a non-zero exit, or killed by a signal other than the CPU limit's
    TIMEOUT = "timeout"  # ran past the wall timeout: the group was killed
    CPU_LIMIT = "cpu_limit"  # used up its CPU seconds (SIGXCPU / SIGKILL from RLIMIT_CPU)
    OUTPUT_LIMIT = "output_limit"  # printed more than output_bytes: the group was killed, the output cut


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    cpu_s: int = 2  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 512  # address space (RLIMIT_AS); the interpreter itself takes about 30 MB of it
    wall_s: float = 5.0  # wall-clock seconds, from the start of the process
    output_bytes: int = 2048  # per stream
    file_mb: int = 16  # the largest file the code may write (RLIMIT_FSIZE)

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_mb", "output_bytes", "file_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox {name}={value!r} must be an integer >= 1")
        if not self.wall_s > 0:
            raise ValueError(f"sandbox wall_s={self.wall_s!r} must be > 0 (seconds)")


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    outcome: Outcome
    stdout: str  # cut at output_bytes (then ends with a marker)
    stderr: str  # its last output_bytes (then starts with a marker): the end of a traceback
    exit_code: int | None  # None when the sandbox killed it (timeout, output limit)
    wall_s: float
    network: str  # "netns" or "audit_hook"


@functools.cache
def network_isolation() -> str:
    """"netns" when a child can enter a user + network namespace of its own on this machine, else "audit_hook"."""
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) != 0)"
    done = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, timeout=30)
    return "netns" if done.returncode == 0 else "audit_hook"


async def run_python(code: str, limits: SandboxLimits, *, network: str | None = None) -> SandboxResult:
    """Run `code` under `limits`. `network`: "netns" or "audit_hook" (default: what `network_isolation()` finds;
    "netns" where the machine cannot give one fails the call rather than run without it)."""
    network = network or network_isolation()
    if network not in ("netns", "audit_hook"):
        raise ValueError(f"network={network!r} must be 'netns' or 'audit_hook'")
    scratch = tempfile.mkdtemp(prefix="topp_rl_sandbox_")
    try:
        return await _run(code, limits, network=network, scratch=scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def _run(code: str, limits: SandboxLimits, *, network: str, scratch: str) -> SandboxResult:
    settings = {"scratch": scratch, "network": network, "cpu_s": limits.cpu_s,
                "memory_bytes": limits.memory_mb * 2**20, "file_bytes": limits.file_mb * 2**20}
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-B", str(CHILD), json.dumps(settings), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=scratch, env=env,
        start_new_session=True)
    group = _Group(proc.pid)
    try:
        proc.stdin.write(code.encode("utf-8", errors="replace"))
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):  # it exited before reading all of the code
        pass
    stdout, stderr = _Stream(), _Stream()
    readers = {asyncio.ensure_future(_read_capped(proc.stdout, limits.output_bytes, stdout, on_overflow=group.kill)),
               asyncio.ensure_future(_read_tail(proc.stderr, limits.output_bytes, stderr))}
    timed_out = False
    try:
        await asyncio.wait_for(_exited(proc), limits.wall_s)
    except TimeoutError:
        timed_out = True
    finally:
        group.kill()  # also once it exited: whatever it forked goes with it
    # The group is dead, so the pipes reach EOF, unless a process escaped it (setsid) and holds them: bounded.
    grace = max(limits.wall_s - (time.monotonic() - start), 1.0)
    _, pending = await asyncio.wait(readers, timeout=grace)
    for task in pending:
        task.cancel()
    if pending:  # asyncio's wait() returns only once the pipes closed too: close them
        proc._transport.close()
    await proc.wait()
    outcome = _outcome(proc.returncode, timed_out=timed_out, overflow=stdout.overflow)
    return SandboxResult(outcome=outcome, stdout=_text(bytes(stdout.data), limits.output_bytes),
                         stderr=(f"[output cut: its first {stderr.dropped} bytes dropped]\n" if stderr.dropped else "")
                         + stderr.data.decode("utf-8", errors="replace"),
                         exit_code=None if outcome in (Outcome.TIMEOUT, Outcome.OUTPUT_LIMIT) else proc.returncode,
                         wall_s=time.monotonic() - start, network=network)


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Returns when the child process exits. Not `proc.wait()`: asyncio's also waits for its pipes to close, which
    processes it left behind may hold open. A pidfd becomes readable at the exit (Linux >= 5.3)."""
    if proc.returncode is not None:
        return
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:  # exited and reaped already
        return
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


class _Group:
    """The child's process group (its pid: it leads a new session)."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid

    def kill(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass


@dataclass
class _Stream:
    """What was read of one pipe so far (kept when the reading is cancelled)."""

    data: bytearray = field(default_factory=bytearray)
    overflow: bool = False  # more than the cap came (stdout)
    dropped: int = 0  # bytes dropped from the front (stderr)


async def _read_capped(stream: asyncio.StreamReader, cap: int, into: _Stream, *, on_overflow) -> None:
    """The first `cap` + 1 bytes of `stream`; `on_overflow` is called as soon as more than `cap` came."""
    while chunk := await stream.read(_CHUNK):
        into.data += chunk[: cap + 1 - len(into.data)]
        if len(into.data) > cap:
            into.overflow = True
            on_overflow()
            return


async def _read_tail(stream: asyncio.StreamReader, cap: int, into: _Stream) -> None:
    """The last `cap` bytes of `stream` (a traceback's end matters), counting those dropped before them."""
    while chunk := await stream.read(_CHUNK):
        into.data += chunk
        if len(into.data) > cap:
            into.dropped += len(into.data) - cap
            del into.data[: len(into.data) - cap]


def _outcome(code: int | None, *, timed_out: bool, overflow: bool) -> Outcome:
    """The sandbox's own kills come first (it kills only on overflow and on timeout, and after the exit)."""
    if overflow:
        return Outcome.OUTPUT_LIMIT
    if timed_out:
        return Outcome.TIMEOUT
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return Outcome.CPU_LIMIT  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
    return Outcome.OK if code == 0 else Outcome.ERROR


def _text(data: bytes, cap: int) -> str:
    text = data[:cap].decode("utf-8", errors="replace")
    return text + f"\n[output cut at {cap} bytes]" if len(data) > cap else text
