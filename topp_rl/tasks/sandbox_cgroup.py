"""The cgroup that bounds one sandbox call (`topp_rl.tasks.sandbox`): the memory, the processes and the CPU time of
all of the call's processes together. cgroup v2 where this process's cgroup can have children with the memory and
pids controllers, else v1 (the memory, pids and cpuacct hierarchies); made below this process's own cgroup and
removed after the call."""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import signal
import time
from pathlib import Path

_BWRAP_PROCESSES = 2  # bwrap's own processes in the call's cgroup (the outer one and the namespace's init)
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_names = itertools.count()


class CallCgroup:
    """A cgroup made for one call, below the one this process runs in: cgroup v2 (memory.max, pids.max, cpu.stat)
    when this process's cgroup can have children with the memory and pids controllers, else v1 (the memory, pids and
    cpuacct hierarchies). `enter(argv)` wraps a command so that it moves itself in before it starts; every process
    it starts stays in it (a process cannot leave a cgroup without write access to another)."""

    def __init__(self, dirs: dict[str, Path], version: int) -> None:
        self.dirs, self.version = dirs, version  # v1: one dir per controller; v2: {"": the dir}

    @classmethod
    def create(cls, *, memory_bytes: int, processes: int) -> CallCgroup:
        """OSError when this process cannot make one (not root, no delegated cgroup)."""
        name = f"topp_rl_sandbox_{os.getpid()}_{next(_names)}"
        own = _own_cgroups()
        if (_CGROUP_ROOT / "cgroup.controllers").exists():  # cgroup v2 mounted at the standard place
            parent = _CGROUP_ROOT / own[""].lstrip("/")
            with contextlib.suppress(OSError):  # refused while the parent holds processes (unless it is the root)
                (parent / "cgroup.subtree_control").write_text("+memory +pids")
            cgroup = cls({"": _mkdir(parent / name)}, 2)
        else:
            cgroup = cls({c: _mkdir(_CGROUP_ROOT / c / own[c].lstrip("/") / name)
                          for c in ("memory", "pids", "cpuacct")}, 1)
        try:
            cgroup._limit(memory_bytes, processes + _BWRAP_PROCESSES)
        except OSError:
            cgroup.remove_when_empty(deadline_s=0)
            raise
        return cgroup

    def _limit(self, memory: int, processes: int) -> None:
        if self.version == 2:
            controllers = self._read("", "cgroup.controllers").split()
            if not {"memory", "pids"} <= set(controllers):
                raise OSError(f"the cgroup {self.dirs['']} lacks the memory or pids controller (it has "
                              f"{controllers or 'none'})")
            self._write("", "memory.max", memory)
            self._write("", "memory.swap.max", 0, missing_ok=True)
            self._write("", "pids.max", processes)
        else:
            self._write("memory", "memory.limit_in_bytes", memory)
            self._write("memory", "memory.memsw.limit_in_bytes", memory, missing_ok=True)  # no swapping past it
            self._write("pids", "pids.max", processes)

    def enter(self, argv: list[str]) -> list[str]:
        """`argv` run by a shell that first writes its own pid into the cgroup (then execs, keeping the pid)."""
        moves = "".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}; " for d in self.dirs.values())
        return ["/bin/sh", "-c", f"set -e; {moves}exec \"$@\"", "sh", *argv]

    def cpu_seconds(self) -> float:
        if self.version == 2:
            stat = dict(line.split() for line in self._read("", "cpu.stat").splitlines())
            return int(stat["usage_usec"]) / 1e6
        return int(self._read("cpuacct", "cpuacct.usage")) / 1e9

    def oom_killed(self) -> bool:
        events = self._read("", "memory.events") if self.version == 2 else self._read("memory", "memory.oom_control")
        return int(dict(line.split() for line in events.splitlines()).get("oom_kill", 0)) > 0

    def pids(self) -> list[int]:
        with contextlib.suppress(FileNotFoundError):
            return [int(p) for p in self._read(next(iter(self.dirs)), "cgroup.procs").split()]
        return []

    def kill(self) -> None:
        if self.version == 2 and (self.dirs[""] / "cgroup.kill").exists():
            with contextlib.suppress(FileNotFoundError):
                self._write("", "cgroup.kill", 1)
            return
        for pid in self.pids():  # v1: a process forked meanwhile is caught by the next kill (the namespace's end)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove_when_empty(self, *, deadline_s: float) -> None:
        """Waits (killing) until no process is left, then removes the cgroup; a cgroup that stays busy past the
        deadline is left behind (its processes are killed, so the kernel frees it once they are gone)."""
        end = time.monotonic() + deadline_s
        while self.pids() and time.monotonic() < end:
            self.kill()
            time.sleep(0.01)
        for d in self.dirs.values():
            with contextlib.suppress(FileNotFoundError, OSError):
                d.rmdir()

    def _read(self, controller: str, name: str) -> str:
        return (self.dirs[controller] / name).read_text()

    def _write(self, controller: str, name: str, value: int, *, missing_ok: bool = False) -> None:
        path = self.dirs[controller] / name
        if missing_ok and not path.exists():
            return
        path.write_text(str(value))


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per v1 controller, and its v2 cgroup under "" (/proc/self/cgroup)."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path
