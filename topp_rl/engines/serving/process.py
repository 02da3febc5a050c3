"""A launched process group (an inference server or router) behind a watchdog, with its log and a watcher.

`spawn_group` starts a command behind `WATCHDOG`, the group leader, in a new session; `stop_group` takes the
whole group down (SIGTERM, then SIGKILL). `LoggedProcessGroup` is what a server and a router share: the start
announcement and timing, the watcher that reports an exit while in use, and an idempotent stop.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from topp_rl.engines.serving.net import free_port, http_url

# The group leader: runs the server as its child and kills the whole group once its parent (the trainer) is
# gone. It polls getppid() rather than relying on PR_SET_PDEATHSIG, which fires when the *thread* that
# spawned it exits (an engine built in a worker thread would lose its server).
WATCHDOG = r"""
import ctypes, os, signal, subprocess, sys, time
trainer = int(sys.argv[1])
def die_with_watchdog():
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
server = subprocess.Popen(sys.argv[2:], preexec_fn=die_with_watchdog)
while server.poll() is None:
    if os.getppid() != trainer:
        os.killpg(0, signal.SIGKILL)
    time.sleep(0.5)
sys.exit(server.returncode)
"""


PORT_TAKEN = "address already in use"  # the bind error of uvicorn (SGLang, vLLM) and smg, case aside
PORT_TRIES = 3  # starts on freshly picked ports before a taken port is an error


class PortTaken(RuntimeError):
    """Another process bound the port before the server did."""


class LoggedProcessGroup:
    """What a launched server and router share: a process group (`_proc`) writing to `log_path` (`_log`),
    named in messages as `label` (e.g. "SGLang server")."""

    url: str
    host: str
    port: int
    log_path: Path
    failed: bool
    label: str = "process"
    _stopping: threading.Event | None = None  # set by the watcher once ready (`_watch`), by `stop` to silence it
    # Made with the watcher (once ready), set once it has reported an exit while in use: what a caller (or a
    # test) waits on, since the watcher polls every WATCH_INTERVAL_S and a rollout retried elsewhere can finish
    # before it looks.
    exit_reported: threading.Event

    @property
    def pid(self) -> int:
        """The process group id (the watchdog's pid)."""
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The group leader's exit code once it exited (negative: killed by that signal); None while it runs."""
        return self._proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _start_on_port(self, host: str, port: int | None, spawn: Callable[[], subprocess.Popen],
                       wait_ready: Callable[[], None]) -> None:  # fmt: skip
        """Set `host`, `port` (`port`, or a free one picked when None) and `url`, open the log, `spawn()` the group
        (its command reads `self.port`) and wait for it (`_await_start`). A picked port that another process bound
        first, in the seconds before the server's bind, is picked again: `PORT_TRIES` starts at most. A given port
        is the caller's, so its bind failing is an error at once."""
        for tries_left in reversed(range(PORT_TRIES)):
            self.host, self.port = host, port or free_port(host)
            self.url = http_url(host, self.port)
            self.failed = False
            self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
            self._proc = spawn()
            try:
                self._await_start(wait_ready)
                return
            except PortTaken as err:
                if port is not None:
                    raise PortTaken(f"{err}; port={port} was given: pass a free one, or none (one is picked)") from None
                if not tries_left:
                    raise PortTaken(f"{err}; {PORT_TRIES} picked ports were each taken first") from None
                print(f"[topp_rl] {self.label} {self.url}: another process bound port {self.port} first; starting "
                      f"again on another port", file=sys.stderr, flush=True)  # fmt: skip

    def _raise_if_port_taken(self) -> None:
        """`PortTaken` when the log's last lines show the server's bind failing (the process may live on: SGLang
        then waits for a shutdown, never ready)."""
        if PORT_TAKEN in self.log_tail(5).lower():
            raise PortTaken(f"{self.label} {self.url}: another process took port {self.port} between its choice and "
                            f"the server's bind (address already in use); log: {self.log_path}")  # fmt: skip

    def _await_start(self, wait_ready: Callable[[], None]) -> None:
        """Run `wait_ready`, saying on the console that the start began and how long it took (a server start on
        CPU can take ~20 s, mostly imports); on any failure, stop the group (the subclass's `stop`) and re-raise."""
        start = time.monotonic()
        # stderr, like the waiting lines below: stdout may be a protocol (a parent reading JSON from it)
        print(f"[topp_rl] {self.label} {self.url}: starting (log: {self.log_path})", file=sys.stderr,
              flush=True)
        try:
            wait_ready()
        except BaseException:
            self.failed = True
            self.stop()
            raise
        print(f"[topp_rl] {self.label} {self.url}: ready in {time.monotonic() - start:.1f} s",
              file=sys.stderr, flush=True)
        self._watch()

    WATCH_INTERVAL_S = 0.5

    def _watch(self) -> None:
        """Report the process group's leader exiting while in use, when it happens (not at `stop`): a dead worker
        behind a router only shows as retried requests otherwise. `stop` silences it first."""
        self._stopping = threading.Event()
        self.exit_reported = threading.Event()

        def watch() -> None:
            while not self._stopping.wait(self.WATCH_INTERVAL_S):
                code = self._proc.poll()
                if code is None:
                    continue
                if not self._stopping.is_set():
                    self.failed = True
                    status = f"{code} (signal {signal.Signals(-code).name})" if code < 0 else str(code)
                    print(f"[topp_rl] {self.label} {self.url} (pid {self._proc.pid}) exited with status "
                          f"{status} while in use; calls to it fail from now on (a router retries them on the "
                          f"other workers); log: {self.log_path}", file=sys.stderr, flush=True)  # fmt: skip
                    self.exit_reported.set()
                return

        threading.Thread(target=watch, name=f"topp_rl-{self.label.lower().replace(' ', '-')}-watch", daemon=True).start()

    def _stop_group(self, timeout_s: float) -> bool:
        """SIGTERM the group, SIGKILL what is left after `timeout_s`; True on the first call (idempotent)."""
        if self._stopping is not None:
            self._stopping.set()  # an exit from here on is asked for: the watcher says nothing
        if not self._log.closed and self._proc.poll() is not None:
            self.failed = True  # it exited before anyone asked it to
        stop_group(self._proc, timeout_s=timeout_s)
        if self._log.closed:
            return False
        self._log.close()
        if self.failed:
            print(f"[topp_rl] {self.label} {self.url} failed; its log is kept at {self.log_path}",
                  file=sys.stderr, flush=True)  # fmt: skip
        return True


def spawn_group(python: Path, cmd: list[str], *, log, env: dict[str, str]) -> subprocess.Popen:
    """Start `cmd` behind `WATCHDOG` (run by `python`) in a new session: the watchdog leads the process group
    that `stop_group` kills, and takes the group down when this process dies."""
    return subprocess.Popen(
        [str(python), "-c", WATCHDOG, str(os.getpid()), *cmd],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip


def stop_group(proc: subprocess.Popen, *, timeout_s: float) -> None:
    """SIGTERM the process group led by `proc`, SIGKILL what is left after `timeout_s`, wait until it is gone."""
    if proc.poll() is None or group_alive(proc.pid):
        signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and group_alive(proc.pid):
            proc.poll()  # reap the leader so the group check sees it gone
            time.sleep(0.2)
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout_s)
        while group_alive(proc.pid) and time.monotonic() < deadline + timeout_s:
            time.sleep(0.1)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    """True while any process of group `pgid` exists (zombies of other parents excluded)."""
    if sys.platform != "linux":
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False
