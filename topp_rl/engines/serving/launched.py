"""`LaunchedServer`: what every inference server launched here shares beyond its process group: the bounded wait
for its health route, an idempotent stop that removes a work dir it owns, the context manager, and a last-resort
kill when it is garbage-collected."""

import signal
import sys
import time
from pathlib import Path
from typing import Self

import requests

from topp_rl.engines.serving.process import LoggedProcessGroup, signal_group
from topp_rl.engines.serving.workdir import remove_workdir


class LaunchedServer(LoggedProcessGroup):
    """A server process group (`_proc`) whose readiness is `health_path` answering 200; a subclass sets `label`,
    `health_path`, `workdir` and `_owns_workdir` (whether `stop` removes the work dir, keeping a failed one's log)."""

    health_path: str = "/health"
    workdir: Path
    _owns_workdir: bool

    def _wait_ready(self, timeout_s: float, interval_s: float) -> None:
        """Poll `health_path` once a second for up to `timeout_s`, a line on stderr every `interval_s`; raise with
        the log's tail when the process exits first or the time runs out."""
        start = time.monotonic()
        said = start
        while (waited := time.monotonic() - start) < timeout_s:
            self._raise_if_port_taken()  # before the exit: a server that fails its bind may exit or live on
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.label} {self.url} exited with code {self._proc.returncode} while starting; "
                    f"log: {self.log_path}; last lines:\n{self.log_tail()}"
                )
            try:
                if requests.get(f"{self.url}{self.health_path}", timeout=(5, 30)).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if interval_s > 0 and time.monotonic() - said >= interval_s:
                said = time.monotonic()
                print(f"[topp_rl] {self.label} {self.url}: starting, {waited:.0f} s of {timeout_s:.0f} s "
                      f"(log: {self.log_path})", file=sys.stderr, flush=True)  # fmt: skip
            time.sleep(1.0)
        raise TimeoutError(
            f"{self.label} {self.url} not healthy after {timeout_s:.0f} s (startup_timeout_s); "
            f"log: {self.log_path}; last lines:\n{self.log_tail()}"
        )

    def stop(self, *, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after `timeout_s`; idempotent."""
        if self._stop_group(timeout_s) and self._owns_workdir:
            remove_workdir(self.workdir, keep_log=self.failed)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort; stop() is idempotent
        try:
            if self._proc.poll() is None:
                signal_group(self._proc.pid, signal.SIGKILL)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
