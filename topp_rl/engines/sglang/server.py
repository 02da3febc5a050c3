"""Launch and stop a real SGLang server (`python -m sglang.launch_server`) on this machine.

SGLang runs from its own venv (`scripts/setup_sglang.sh` builds it outside the clone; its pins conflict with
ours). Its python comes from an explicit setting: the `python=` argument, else `$TOPP_RL_SGLANG_PYTHON`
(`scripts/test.sh` exports what `setup_sglang.sh` prints); nothing is guessed from the install location.

Lifecycle: `SGLangServer` starts the server in its own process group, behind a tiny watchdog (`process.WATCHDOG`,
the group leader) that takes the whole group down when the trainer dies, SIGKILL and OOM-kill included (the
server gets PR_SET_PDEATHSIG on the watchdog; SGLang's scheduler and detokenizer set theirs on the server).
`stop()` kills the group. Once ready, a watcher thread reports at once (stderr) when the group's leader exits
unasked (`[topp_rl] SGLang server <url> (pid N) exited with status S while in use; ...`), so a dead worker behind a
router is seen when it dies, not only at close. Everything lives in a per-engine work dir (`make_workdir`: the server log, weight
checkpoints of disk sync, the rendezvous file); a dir left by a dead process is cleaned at the next start.

Listeners: the HTTP server binds `host` (127.0.0.1 by default). On loopback, SGLang's own rendezvous goes
through a file (`SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE=file://...`) instead of a TCPStore, which would
listen on every interface whatever address it is given, and gloo / NCCL sockets are pinned to the loopback
interface. A non-loopback `host` (multi-node) leaves SGLang's defaults alone.
Departure from SGLang's defaults: we always pass `--skip-tokenizer-init` (token ids in, token ids out),
`--sampling-backend pytorch` and float32 unless asked otherwise, for exact checks; `device="cpu"` (the default
without `gpus`) adds `--device cpu --attention-backend torch_native` and SGLang's CPU engine, `device="cuda"` leaves
SGLang's GPU defaults (the venv of `scripts/setup_sglang.sh --gpu`). `gpus` (the placement plan's slot) launches
the server on those GPUs of this node (`gpu_launch_args`, `visible_devices`), with `mem_fraction` and, for a
colocated server, the memory saver.
"""

import os
from collections.abc import Sequence
from pathlib import Path

from topp_rl.engines.serving.launched import LaunchedServer
from topp_rl.engines.serving.net import LOOPBACK_IFNAME, is_loopback
from topp_rl.engines.serving.process import spawn_group
from topp_rl.engines.serving.workdir import make_workdir as make_owned_workdir
from topp_rl.engines.serving.workdir import remove_workdir  # noqa: F401 - the fleet imports it from here

SGLANG_PYTHON_ENV = "TOPP_RL_SGLANG_PYTHON"
WORKDIR_PREFIX = "topp_rl-sglang-"

def sglang_python() -> Path | None:
    """`$TOPP_RL_SGLANG_PYTHON` when it names a file, else None (tests skip on None)."""
    explicit = os.environ.get(SGLANG_PYTHON_ENV)
    return Path(explicit) if explicit and Path(explicit).is_file() else None


def require_sglang_python(python: str | os.PathLike | None = None) -> Path:
    """The SGLang venv's python from `python` or `$TOPP_RL_SGLANG_PYTHON`; ValueError naming both when unset."""
    source = "python=" if python is not None else f"${SGLANG_PYTHON_ENV}"
    value = python if python is not None else os.environ.get(SGLANG_PYTHON_ENV)
    if not value:
        raise ValueError(
            f"no SGLang python configured: pass python= (server_kwargs) or set {SGLANG_PYTHON_ENV} to the path "
            "that scripts/setup_sglang.sh prints (it builds SGLang's own venv)"
        )
    if not Path(value).is_file():
        raise ValueError(
            f"{source} ({value}) is not a file; set it to the python that scripts/setup_sglang.sh prints"
        )
    return Path(value)


# ---- work dirs ----------------------------------------------------------------------------------------------
def make_workdir(root: str | os.PathLike | None = None) -> Path:
    """A fresh work dir `root/topp_rl-sglang-<pid>-<random>` (`serving.workdir.make_workdir`)."""
    return make_owned_workdir(root, prefix=WORKDIR_PREFIX)


# ---- GPU launch settings (the placement plan's, `topp_rl.parallel.placement`) ---------------------------------
def gpu_launch_args(device: str, gpus: tuple[int, ...], *, mem_fraction: float | None,
                    memory_saver: bool) -> tuple[str, ...]:
    """SGLang's flags for a server on `gpus` (ids of this node): it sees only them (`CUDA_VISIBLE_DEVICES`, set by
    `visible_devices`), so its TP ranks start at `--base-gpu-id 0` and `--tp-size` is their count;
    `mem_fraction_static` of each; `--enable-memory-saver` for a colocated server (release / resume its memory)."""
    if device == "cpu" and (gpus or memory_saver or mem_fraction is not None):
        raise ValueError(
            f"SGLang server device='cpu' with gpus={list(gpus)}, mem_fraction={mem_fraction}, memory_saver="
            f"{memory_saver}: these place a server on GPUs (the memory saver, torch_memory_saver, is CUDA-only); "
            "drop them, or launch on device='cuda'"
        )
    args: tuple[str, ...] = ()
    if gpus:
        args += ("--base-gpu-id", "0", "--tp-size", str(len(gpus)))
    if mem_fraction is not None:
        args += ("--mem-fraction-static", f"{mem_fraction:g}")
    if memory_saver:
        args += ("--enable-memory-saver",)
    return args


def visible_devices(gpus: tuple[int, ...], inherited: str | None) -> str:
    """`CUDA_VISIBLE_DEVICES` for a server on `gpus`, ids among the GPUs this process sees: through `inherited` (a
    scheduler's `CUDA_VISIBLE_DEVICES=2,3,6,7` makes id 1 the physical GPU 3), else the node's own numbering."""
    if not inherited:
        return ",".join(map(str, gpus))
    seen = [d.strip() for d in inherited.split(",") if d.strip()]
    if max(gpus) >= len(seen):
        raise ValueError(
            f"SGLang server gpus={list(gpus)}: this process sees {len(seen)} GPU(s) (CUDA_VISIBLE_DEVICES={inherited}), "
            f"so ids 0-{len(seen) - 1}; name GPUs it sees (rollout.engine.gpus) or widen CUDA_VISIBLE_DEVICES"
        )
    return ",".join(seen[g] for g in gpus)


RENDEZVOUS_FILE = "dist-init"  # in the work dir: the file rendezvous of a loopback server's process group


# ---- the server ---------------------------------------------------------------------------------------------
class SGLangServer(LaunchedServer):
    """One SGLang server process group serving `model_path` at `self.url`; a context manager.

    `workdir` holds its log (`server.log`) and rendezvous file; without one the server makes (and on a clean
    stop removes) its own. `failed` is True once the server exited on its own or did not come up; its log is
    then kept and its path printed."""

    label = "SGLang server"
    health_path = "/health_generate"

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        python: str | os.PathLike | None = None,
        workdir: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "float32",
        device: str | None = None,
        gpus: Sequence[int] | None = None,
        mem_fraction: float | None = None,
        memory_saver: bool = False,
        max_total_tokens: int = 8192,
        sampling_mask_max_tokens: int | None = None,
        random_seed: int = 0,
        extra_args: tuple[str, ...] = (),
        startup_timeout_s: float = 240.0,
        progress_interval_s: float = 30.0,
    ) -> None:
        self.python = python = require_sglang_python(python)
        self.model_path = Path(model_path)
        if not (self.model_path / "config.json").is_file():
            raise ValueError(f"model_path ({self.model_path}) has no config.json; pass an HF checkpoint dir")
        self._owns_workdir = workdir is None
        self.workdir = make_workdir() if workdir is None else Path(workdir)
        self.log_path = self.workdir / "server.log"
        self.device = device = device or ("cuda" if gpus else "cpu")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"SGLang server device={device!r} must be 'cpu' or 'cuda'")
        self.gpus = tuple(gpus or ())
        gpu_args = gpu_launch_args(device, self.gpus, mem_fraction=mem_fraction, memory_saver=memory_saver)
        cpu = ("--device", "cpu", "--attention-backend", "torch_native") if device == "cpu" else ()

        def command() -> list[str]:  # on the port `_start_on_port` sets
            return [
                str(python), "-m", "sglang.launch_server",
                "--model-path", str(self.model_path),
                *cpu,
                "--sampling-backend", "pytorch",
                "--skip-tokenizer-init",
                "--host", host,
                "--port", str(self.port),
                "--dtype", dtype,
                "--max-total-tokens", str(max_total_tokens),
                "--random-seed", str(random_seed),
                *(("--sampling-mask-max-tokens", str(sampling_mask_max_tokens)) if sampling_mask_max_tokens else ()),
                *gpu_args,
                *extra_args,
            ]  # fmt: skip

        self._start_on_port(host, port, lambda: self._spawn(command()),
                            lambda: self._wait_ready(startup_timeout_s, progress_interval_s))  # fmt: skip

    def _spawn(self, command: list[str]):
        # A start again on another port (`_start_on_port`) must not meet the failed start's rendezvous file.
        (self.workdir / RENDEZVOUS_FILE).unlink(missing_ok=True)
        return spawn_group(self.python, command, log=self._log, env=self._env())

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(self.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
        env.pop("PYTHONPATH", None)  # our venv's packages must not shadow SGLang's pins
        if is_loopback(self.host):
            # A file rendezvous opens no port (torch's TCPStore master binds all interfaces, whatever host);
            # gloo / NCCL (the weight-sync group included) then bind the loopback interface only.
            env.setdefault("SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE", f"file://{self.workdir / RENDEZVOUS_FILE}")
            env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
            env.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
        return env
