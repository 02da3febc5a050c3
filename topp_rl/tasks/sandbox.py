"""Run a piece of Python code in a sandbox (the `python` tool of `task=python_tool`).

`run_python(code, limits)` runs `sandbox_child.py` (handed in as `-c` source: nothing of the repository is mounted)
under the base interpreter (the one the venv was made from; the standard library only) and returns a
`SandboxResult`. Confined (the default), the call runs in bubblewrap (`bwrap`):
- its own user, mount, PID, network, IPC, UTS and cgroup namespaces, no capabilities, a new terminal session;
  `--die-with-parent`, and the PID namespace ends with the call, so no process of it outlives it;
- a read-only root made of /usr (and /bin, /lib*), the interpreter's install prefix and two files of /etc;
  nothing else of the machine (no home, repository, run dir, /dev/shm or /run) is there; the cwd, HOME and TMPDIR
  are /tmp, a tmpfs of `scratch_mb`, the only writable place, gone with the call; /dev is read-only;
- a cgroup made for the call (`sandbox_cgroup.CallCgroup`: v2, or v1 memory + pids + cpuacct) bounding, for all of its processes
  together, the memory (`memory_mb`, the scratch's files included), the processes and threads (`processes`), and the
  CPU time (`cpu_s`, read every `_CPU_POLL_S` and the call killed past it); removed after the call.
Unconfined (`unconfined=True`, an explicit opt-in): a plain child process in a session of its own, per-process
rlimits (CPU seconds, address space, file size), a scratch dir as its cwd: no boundary at all.

Both: a wall timeout (past it every process of the call is killed), stdout cut at `output_bytes` (the call is
killed when it passes it), stderr cut to its last `output_bytes` (the end of a traceback), each cut marked.
docs/agents.md states what the boundary is and is not.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from topp_rl.tasks.sandbox_cgroup import CallCgroup

CHILD_SOURCE = Path(sandbox_child.__file__).read_text()
INSTALL = "apt-get install bubblewrap (bash scripts/setup.sh runs it where it runs as root with apt-get)"
_CHUNK = 65536
_CPU_POLL_S = 0.05  # how often the call's CPU time is read: it may pass cpu_s by this times the cores, no more
_SCRATCH = "/tmp"  # inside the sandbox
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1"}


class Outcome(StrEnum):
    OK = "ok"  # exited 0 within every limit
    ERROR = "error"  # an exception in the code, a non-zero exit, or killed by a signal other than the limits'
    TIMEOUT = "timeout"  # ran past the wall timeout: every process of the call was killed
    CPU_LIMIT = "cpu_limit"  # used up its CPU seconds: killed
    MEMORY_LIMIT = "memory_limit"  # its processes together passed memory_mb: the kernel killed one (OOM)
    OUTPUT_LIMIT = "output_limit"  # printed more than output_bytes: killed, the output cut


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Confined, each bound holds for the whole call (all of its processes together); unconfined, per process."""

    cpu_s: int = 2  # CPU seconds
    memory_mb: int = 512  # memory, the scratch's files included; also each process's address space (RLIMIT_AS)
    wall_s: float = 5.0  # wall-clock seconds, from the start
    output_bytes: int = 2048  # per stream
    processes: int = 16  # processes and threads at once, the interpreter included (confined only)
    scratch_mb: int = 16  # the writable /tmp (unconfined: the largest file, RLIMIT_FSIZE)

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_mb", "output_bytes", "processes", "scratch_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox {name}={value!r} must be an integer >= 1")
        if not 0 < self.wall_s < float("inf"):
            raise ValueError(f"sandbox wall_s={self.wall_s!r} must be a finite number > 0 (seconds)")


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    outcome: Outcome
    stdout: str  # cut at output_bytes (then ends with a marker)
    stderr: str  # its last output_bytes (then starts with a marker): the end of a traceback
    exit_code: int | None  # None when killed for a limit (wall, CPU, memory, output)
    wall_s: float
    confinement: str  # "bwrap" or "unconfined"


def bwrap_binary() -> str | None:
    return shutil.which("bwrap")


def check_confinement(*, unconfined: bool, opt_out: str = "unconfined=True") -> str:
    """"bwrap" when this machine can run confined calls, "unconfined" when asked to; otherwise a ValueError naming
    what is missing, the fix, and `opt_out` (the key that runs the code unconfined)."""
    if unconfined:
        return "unconfined"
    problem = _confinement_problem(bwrap_binary())
    if problem:
        raise ValueError(f"{problem}; or set {opt_out} to run tool code without any boundary (it can then read, "
                         "write and kill whatever the training process can)")
    return "bwrap"


@functools.cache
def _confinement_problem(bwrap: str | None) -> str | None:
    """Why a confined call cannot run here (None: it can): probed once per bwrap binary."""
    if bwrap is None:
        return f"the sandbox for tool code needs bubblewrap (bwrap), which is not on PATH: {INSTALL}"
    try:
        cgroup = CallCgroup.create(memory_bytes=SandboxLimits().memory_mb * 2**20, processes=SandboxLimits().processes)
    except OSError as e:
        return (f"the sandbox bounds each call's total memory, processes and CPU time with a cgroup of its own, and "
                f"none can be made here ({e}): run as root, or in a cgroup v2 subtree delegated to this user with "
                "the memory and pids controllers")
    try:
        probe = subprocess.run(cgroup.enter([*_bwrap_argv(bwrap, SandboxLimits()), _interpreter(), "-I", "-c", "pass"]),
                               capture_output=True, timeout=60)
    finally:
        cgroup.kill()
        cgroup.remove_when_empty(deadline_s=10)
    if probe.returncode != 0:
        return (f"bubblewrap ({bwrap}) cannot make the sandbox's namespaces here (exit {probe.returncode}: "
                f"{probe.stderr.decode(errors='replace').strip()}); unprivileged user namespaces may be disabled "
                "(sysctl kernel.unprivileged_userns_clone=1), or run as root")
    return None


async def run_python(code: str, limits: SandboxLimits, *, unconfined: bool = False) -> SandboxResult:
    """Run `code` under `limits`, confined in bwrap unless `unconfined` (ValueError where bwrap cannot run)."""
    if check_confinement(unconfined=unconfined) == "unconfined":
        scratch = tempfile.mkdtemp(prefix="topp_rl_sandbox_")
        try:
            return await _run(code, limits, cgroup=None, scratch=scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    cgroup = await asyncio.to_thread(CallCgroup.create, memory_bytes=limits.memory_mb * 2**20,
                                   processes=limits.processes)  # a v1 memory cgroup's mkdir can take 0.1 s
    try:
        return await _run(code, limits, cgroup=cgroup, scratch=_SCRATCH)
    finally:
        cgroup.kill()
        await asyncio.to_thread(cgroup.remove_when_empty, deadline_s=limits.wall_s + 10)


def _bwrap_argv(bwrap: str, limits: SandboxLimits) -> list[str]:
    """bwrap's command line up to the command it runs (the caller appends that)."""
    binds = [arg for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", *_interpreter_paths(),
                              "/etc/ld.so.cache", "/etc/localtime") for arg in _same_path(path)]
    env = [arg for name, value in {**_ENV, "HOME": _SCRATCH, "TMPDIR": _SCRATCH}.items()
           for arg in ("--setenv", name, value)]
    return [bwrap, "--unshare-all", "--unshare-user", "--uid", "1000", "--gid", "1000", "--hostname", "sandbox",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", *binds, "--proc", "/proc", "--dev", "/dev",
            "--remount-ro", "/dev", "--size", str(limits.scratch_mb * 2**20), "--tmpfs", _SCRATCH,
            "--remount-ro", "/", "--chdir", _SCRATCH, "--clearenv", *env, "--"]


def _same_path(path: str) -> list[str]:
    """bwrap's arguments showing `path` of the machine at the same place, read-only: a link as a link (merged /usr:
    /bin -> usr/bin), nothing when it does not exist."""
    if os.path.islink(path):
        return ["--symlink", os.readlink(path), path]
    return ["--ro-bind", path, path] if os.path.exists(path) else []


def _interpreter() -> str:
    """The base interpreter: a venv's python is a link into the venv, whose directory must stay hidden."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _interpreter_paths() -> list[str]:
    """What the base interpreter needs mounted (its install prefix), less what /usr already gives."""
    paths = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    if not any(_interpreter().startswith(p + os.sep) for p in paths):
        paths.add(_interpreter())
    return sorted(p for p in paths if not (p == "/usr" or p.startswith("/usr/")))


async def _run(code: str, limits: SandboxLimits, *, cgroup: CallCgroup | None, scratch: str) -> SandboxResult:
    settings = {"cwd": scratch, "memory_bytes": limits.memory_mb * 2**20}
    if cgroup is None:  # per-process bounds: nothing totals them
        settings |= {"cpu_s": limits.cpu_s, "file_bytes": limits.scratch_mb * 2**20}
    argv = [_interpreter(), "-I", "-B", "-c", CHILD_SOURCE, json.dumps(settings)]
    if cgroup is None:
        env = {**_ENV, "HOME": scratch, "TMPDIR": scratch}
    else:  # bwrap sets the environment inside
        argv, env = cgroup.enter([*_bwrap_argv(bwrap_binary() or "bwrap", limits), *argv]), {}
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=scratch if cgroup is None else "/", env=env, start_new_session=True)
    call = _Call(proc.pid, cgroup)
    try:
        proc.stdin.write(code.encode("utf-8", errors="replace"))
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):  # it exited before reading all of the code
        pass
    stdout, stderr = _Stream(), _Stream()
    readers = {asyncio.ensure_future(_read_capped(proc.stdout, limits.output_bytes, stdout, on_overflow=call.kill)),
               asyncio.ensure_future(_read_tail(proc.stderr, limits.output_bytes, stderr))}
    watcher = asyncio.ensure_future(_watch_cpu(call, limits.cpu_s))
    timed_out = False
    try:
        await asyncio.wait_for(_exited(proc), limits.wall_s)
    except TimeoutError:
        timed_out = True
    finally:
        watcher.cancel()
        call.kill()  # also once it exited: whatever it started goes with it
    # Every process of the call is dead, so the pipes reach EOF, unless (unconfined) one left the session: bounded.
    grace = max(limits.wall_s - (time.monotonic() - start), 1.0)
    _, pending = await asyncio.wait(readers, timeout=grace)
    for task in pending:
        task.cancel()
    if pending:  # asyncio's wait() returns only once the pipes closed too: close them
        proc._transport.close()
    await proc.wait()
    oom = cgroup is not None and await asyncio.to_thread(cgroup.oom_killed)
    outcome = _outcome(proc.returncode, timed_out=timed_out, overflow=stdout.overflow, cpu=call.cpu_exceeded,
                       oom=oom, confined=cgroup is not None)
    killed = outcome in (Outcome.TIMEOUT, Outcome.OUTPUT_LIMIT, Outcome.CPU_LIMIT, Outcome.MEMORY_LIMIT)
    return SandboxResult(outcome=outcome, stdout=_text(bytes(stdout.data), limits.output_bytes),
                         stderr=(f"[output cut: its first {stderr.dropped} bytes dropped]\n" if stderr.dropped else "")
                         + stderr.data.decode("utf-8", errors="replace"),
                         exit_code=None if killed else proc.returncode, wall_s=time.monotonic() - start,
                         confinement="unconfined" if cgroup is None else "bwrap")


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


async def _watch_cpu(call: _Call, cpu_s: int) -> None:
    """Kills the call once its processes together used `cpu_s` CPU seconds (confined; unconfined has RLIMIT_CPU)."""
    if call.cgroup is None:
        return
    while call.cgroup.cpu_seconds() < cpu_s:
        await asyncio.sleep(_CPU_POLL_S)
    call.cpu_exceeded = True
    call.kill()


@dataclass
class _Call:
    """The processes of one call: the child's process group (it leads a new session) and, confined, its cgroup."""

    pgid: int
    cgroup: CallCgroup | None
    cpu_exceeded: bool = False

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(self.pgid, signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()


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


def _outcome(code: int | None, *, timed_out: bool, overflow: bool, cpu: bool, oom: bool, confined: bool) -> Outcome:
    """The sandbox's own kills come first (output, wall, CPU: it kills only for those and after the exit), then the
    kernel's memory kill, then (unconfined) RLIMIT_CPU's signals: SIGXCPU at the soft limit, SIGKILL at the hard."""
    if overflow:
        return Outcome.OUTPUT_LIMIT
    if timed_out:
        return Outcome.TIMEOUT
    if cpu:
        return Outcome.CPU_LIMIT
    if oom:
        return Outcome.MEMORY_LIMIT
    if not confined and code in (-signal.SIGXCPU, -signal.SIGKILL):
        return Outcome.CPU_LIMIT
    return Outcome.OK if code == 0 else Outcome.ERROR


def _text(data: bytes, cap: int) -> str:
    text = data[:cap].decode("utf-8", errors="replace")
    return text + f"\n[output cut at {cap} bytes]" if len(data) > cap else text
