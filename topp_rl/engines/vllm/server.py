"""Launch and stop a real vLLM server (`python -m vllm.entrypoints.openai.api_server`) on this machine.

vLLM runs from its own venv (`scripts/setup_vllm.sh` builds it outside the clone; it pins torch and transformers
versions of its own). Its python comes from an explicit setting: the `python=` argument, else
`$TOPP_RL_VLLM_PYTHON` (`scripts/test.sh` exports what `setup_vllm.sh` prints); nothing is guessed.

Lifecycle as `SGLangServer`'s: a process group behind the serving layer's watchdog (`serving.process`), dies with
the trainer, a watcher reports an exit while in use, `stop()` kills the group; the log lives in the engine's work
dir (`serving.workdir`). The start is bounded (`startup_timeout_s`, waiting for `/health`).

Departures from vLLM's defaults, each needed by the engine: `--skip-tokenizer-init` (token ids in and out),
`--logprobs-mode processed_logprobs` (the log-probs after temperature, min-p, top-k and top-p: the kept set's
entries finite, the others -inf, `topp_rl.engines.vllm.protocol`), `--max-logprobs` = max_candidates + 1,
`--enable-scale-out` (the token-id route `/inference/v1/generate`), `VLLM_SERVER_DEV_MODE=1` (the control routes:
`/collective_rpc`, `/reset_prefix_cache`), `--worker-extension-cls` (the weight reload with a tied-head refresh,
`worker/topp_rl_vllm_worker.py`), float32 unless asked otherwise, and `--seed`. On CPU (`device="cpu"`, what the
engine launches; `device="cuda"` is for `scripts/gpu_vllm_check.py`, the GPU's memory then set by vLLM's own flags in
`extra_args`): `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache; vLLM's default of 4 GiB per server fails to start on
a small box), eager mode (`--enforce-eager`, `VLLM_CPU_CI_ENV=1`: no compile at start). On a loopback host vLLM's
own sockets are pinned there too (`VLLM_HOST_IP`, gloo's interface).
"""

import os
from pathlib import Path

from topp_rl.engines.serving.launched import LaunchedServer
from topp_rl.engines.serving.net import LOOPBACK_IFNAME, is_loopback
from topp_rl.engines.serving.process import spawn_group
from topp_rl.engines.serving.workdir import make_workdir

VLLM_PYTHON_ENV = "TOPP_RL_VLLM_PYTHON"
WORKDIR_PREFIX = "topp_rl-vllm-"
WORKER_EXTENSION = "topp_rl_vllm_worker.WeightReload"
WORKER_EXTENSION_DIR = Path(__file__).parent / "worker"  # the only topp_rl code the server imports


def vllm_python() -> Path | None:
    """`$TOPP_RL_VLLM_PYTHON` when it names a file, else None (tests skip on None)."""
    explicit = os.environ.get(VLLM_PYTHON_ENV)
    return Path(explicit) if explicit and Path(explicit).is_file() else None


def require_vllm_python(python: str | os.PathLike | None = None) -> Path:
    """The vLLM venv's python from `python` or `$TOPP_RL_VLLM_PYTHON`; ValueError naming both when unset."""
    source = "python=" if python is not None else f"${VLLM_PYTHON_ENV}"
    value = python if python is not None else os.environ.get(VLLM_PYTHON_ENV)
    if not value:
        raise ValueError(
            f"no vLLM python configured: pass python= (server_kwargs) or set {VLLM_PYTHON_ENV} to the path that "
            "scripts/setup_vllm.sh prints (it builds vLLM's own venv)"
        )
    if not Path(value).is_file():
        raise ValueError(f"{source} ({value}) is not a file; set it to the python that scripts/setup_vllm.sh prints")
    return Path(value)


def make_vllm_workdir(root: str | os.PathLike | None = None) -> Path:
    return make_workdir(root, prefix=WORKDIR_PREFIX)


class VLLMServer(LaunchedServer):
    """One vLLM server process group serving `model_path` at `self.url`; a context manager. `max_logprobs`: the
    most log-probs a request may ask per token (the engine's max_candidates + 1). `failed` is True once the
    server exited on its own or did not come up; its log is then kept and its path printed."""

    label = "vLLM server"

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        max_logprobs: int,
        python: str | os.PathLike | None = None,
        workdir: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        max_model_len: int | None = None,
        kv_cache_gib: float = 1.0,
        random_seed: int = 0,
        extra_args: tuple[str, ...] = (),
        startup_timeout_s: float = 300.0,
        progress_interval_s: float = 30.0,
    ) -> None:
        self.python = python = require_vllm_python(python)
        self.model_path = Path(model_path)
        if not (self.model_path / "config.json").is_file():
            raise ValueError(f"model_path ({self.model_path}) has no config.json; pass an HF checkpoint dir")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"vLLM server device={device!r}: choose cpu (vllm-cpu's venv) or cuda (the --gpu venv)")
        self.device = device
        if max_logprobs < 1 or not kv_cache_gib > 0:
            raise ValueError(f"max_logprobs ({max_logprobs}) must be >= 1 and kv_cache_gib ({kv_cache_gib}) > 0")
        self._owns_workdir = workdir is None
        self.workdir = make_vllm_workdir() if workdir is None else Path(workdir)
        self.log_path = self.workdir / "server.log"
        self.kv_cache_gib = kv_cache_gib

        def command() -> list[str]:  # on the port `_start_on_port` sets
            return [
                str(python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_path),
                "--host", host,
                "--port", str(self.port),
                "--dtype", dtype,
                "--skip-tokenizer-init",
                "--logprobs-mode", "processed_logprobs",
                "--max-logprobs", str(max_logprobs),
                "--enable-scale-out",
                "--enforce-eager",
                "--worker-extension-cls", WORKER_EXTENSION,
                "--seed", str(random_seed),
                *(("--max-model-len", str(max_model_len)) if max_model_len else ()),
                *extra_args,
            ]  # fmt: skip

        self._start_on_port(host, port, lambda: spawn_group(python, command(), log=self._log, env=self._env()),
                            lambda: self._wait_ready(startup_timeout_s, progress_interval_s))  # fmt: skip

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_SERVER_DEV_MODE": "1"}
        if self.device == "cpu":
            env.update(VLLM_CPU_CI_ENV="1", VLLM_CPU_KVCACHE_SPACE=f"{self.kv_cache_gib:g}")
        # Our venv's packages must not shadow vLLM's pins: only the worker extension's folder is added.
        env["PYTHONPATH"] = str(WORKER_EXTENSION_DIR)
        if is_loopback(self.host):
            env.setdefault("VLLM_HOST_IP", "127.0.0.1")
            env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
        return env
