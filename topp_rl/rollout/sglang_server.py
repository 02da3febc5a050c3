"""Launch and stop a real SGLang server (`python -m sglang.launch_server`) on this machine.

SGLang runs from its own venv (`scripts/setup_sglang.sh` builds it outside the clone; its pins conflict with
ours). `sglang_python()` finds that venv's interpreter: `$TOPP_RL_SGLANG_PYTHON` if set, else the path
`setup_sglang.sh --print-path` reports for the current pins. `SGLangServer` starts the server in its own
process group on 127.0.0.1 and a free port, waits for `/health_generate`, and on `stop()` kills the whole
group (the HTTP server, its scheduler and detokenizer children), so no process outlives it.
Departure from SGLang's defaults: on CPU we always pass `--device cpu --attention-backend torch_native
--skip-tokenizer-init` (token ids in, token ids out) and float32 unless asked otherwise, for exact checks.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

SGLANG_PYTHON_ENV = "TOPP_RL_SGLANG_PYTHON"
_REPO_ROOT = Path(__file__).resolve().parents[2]
_SETUP_SCRIPT = _REPO_ROOT / "scripts" / "setup_sglang.sh"


def sglang_python() -> Path | None:
    """The SGLang venv's python, or None when it is not built (run `scripts/setup_sglang.sh`)."""
    explicit = os.environ.get(SGLANG_PYTHON_ENV)
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    if not _SETUP_SCRIPT.is_file() or shutil.which("bash") is None:
        return None
    done = subprocess.run(
        ["bash", str(_SETUP_SCRIPT), "--print-path"], capture_output=True, text=True, check=False
    )
    path = Path(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else None
    return path if path is not None and path.is_file() else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangServer:
    """One SGLang server process group serving `model_path` at `self.url`; a context manager."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        python: str | os.PathLike | None = None,
        port: int | None = None,
        dtype: str = "float32",
        max_total_tokens: int = 8192,
        sampling_mask_max_tokens: int | None = None,
        random_seed: int = 0,
        extra_args: tuple[str, ...] = (),
        startup_timeout_s: float = 240.0,
        log_path: str | os.PathLike | None = None,
    ) -> None:
        python = Path(python) if python is not None else sglang_python()
        if python is None:
            raise ValueError(
                f"no SGLang venv found; run scripts/setup_sglang.sh (or set {SGLANG_PYTHON_ENV} to its python)"
            )
        self.model_path = Path(model_path)
        if not (self.model_path / "config.json").is_file():
            raise ValueError(f"model_path ({self.model_path}) has no config.json; pass an HF checkpoint dir")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            str(python), "-m", "sglang.launch_server",
            "--model-path", str(self.model_path),
            "--device", "cpu",
            "--attention-backend", "torch_native",
            "--sampling-backend", "pytorch",
            "--skip-tokenizer-init",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", dtype,
            "--max-total-tokens", str(max_total_tokens),
            "--random-seed", str(random_seed),
            *(("--sampling-mask-max-tokens", str(sampling_mask_max_tokens)) if sampling_mask_max_tokens else ()),
            *extra_args,
        ]  # fmt: skip
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)  # our venv's packages must not shadow SGLang's pins
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        # A new session makes the server the leader of its own process group: stop() kills the group.
        self._proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang server exited with code {self._proc.returncode} while starting; "
                    f"last log lines:\n{self.log_tail()}"
                )
            try:
                if requests.get(f"{self.url}/health_generate", timeout=30).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(
            f"SGLang server at {self.url} not healthy after {timeout_s:.0f} s; last log lines:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, *, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after `timeout_s`."""
        if self._proc.poll() is None or _group_alive(self._proc.pid):
            _signal_group(self._proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and _group_alive(self._proc.pid):
                self._proc.poll()  # reap the leader so the group check sees it gone
                time.sleep(0.2)
            _signal_group(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=timeout_s)
            while _group_alive(self._proc.pid) and time.monotonic() < deadline + timeout_s:
                time.sleep(0.1)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> "SGLangServer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort; stop() is idempotent
        try:
            if self._proc.poll() is None:
                _signal_group(self._proc.pid, signal.SIGKILL)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """True while any process of group `pgid` exists (zombies of other parents included)."""
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
