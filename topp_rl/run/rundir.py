"""The run dir's lifecycle: one run per dir, its config history, and the checks made before anything is built.

A run dir (`paths.output_dir`) holds one run:
- `.lock`: `fcntl.flock`ed for the life of the process (the kernel drops it when the process dies, even on
  SIGKILL), so a second run in the same dir fails at start naming the holder's pid;
- `config.yaml` (the first start's config, never rewritten) and `config.resume-<n>.yaml` (one per resume);
- `checkpoints/` (probed for writing at start; temp files of dead writers, and sharded checkpoint dirs no link
  names, are removed, each one reported);
- `wandb_id`: the W&B run id, so every resume appends to the same W&B run;
- `.hydra/` (config, hydra, overrides of the latest start): Hydra writes it before the job runs, which let a
  refused start overwrite the first run's; conf/config.yaml sets `hydra.output_subdir: null` and `RunDir`
  writes the same files once the start is accepted.

A dir that holds a run is only resumed (`ckpt_path=last`), never restarted over (one whose run saved no checkpoint
is neither: the refusal offers deleting it or another dir). A resume must find its checkpoint, at a parallel layout
the checkpoint restores at (the strategy class says which: `StrategyCapabilities.resume_refusal`), and the
checkpoint's recorded config must agree with this one on `resume.guarded_keys` unless
`resume.allow_config_change=true`. Only the launching rank (global rank 0) owns the dir; the ranks Lightning
starts later only resolve the checkpoint path.

On the command line `RunDirCheck` (a Hydra callback) refuses a `run_name` that is not one directory name and a run
dir that cannot be written, before Hydra creates the dir and opens `train.log` in it.
"""

import fcntl
import glob
import os
import secrets
import shlex
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from topp_rl.parallel.capabilities import WEIGHTS_ONLY_WAY_OUT, Layout, capabilities_of
from topp_rl.parallel.options import parallel_options
from topp_rl.run.checkpoint import RECORD_KEY, read_checkpoint, temp_writer
from topp_rl.run.sharded_checkpoint import is_sharded, read_meta, remove_unreferenced, single_file_refusal

LOCK = ".lock"
WANDB_ID = "wandb_id"
HYDRA_SUBDIR = ".hydra"
_MISSING = "<absent>"
_UNREAD = object()  # an added key whose value the recorded run never read: any value agrees with it


def _say(message: str) -> None:
    print(f"[topp_rl] {message}", file=sys.stderr, flush=True)


def is_launching_rank() -> bool:
    """Global rank 0: every rank variable a launcher may set (torchrun, SLURM, Lightning) is absent or 0."""
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))


# ----- lock -----
class RunDirLock:
    """An exclusive `flock` on `<dir>/.lock`, which also records the holder's pid for the refusal message."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None

    def acquire(self) -> "RunDirLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(
                f"run dir {self.path.parent} is in use by another run (pid {holder}, holding {self.path}); "
                f"wait for that run to end, or start this one in its own dir (another hydra.run.dir)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays (removing it would race a new holder)
            self.fd = None


# ----- run dir and checkpoint dir -----
def probe_writable(directory: Path, *, what: str = "checkpoint dir",
                   holds: str = "checkpoints and the SIGTERM save go there") -> None:
    """Create `directory` and write + remove a probe file in it, so a bad dir fails now, not at the first save."""
    probe = directory / f".probe.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"{what} {directory} is not writable ({type(err).__name__}: {err}); {holds}: fix the path or its "
            f"permissions, or point hydra.run.dir at a writable dir"
        ) from err


def check_run_dir_writable(run_dir: Path) -> None:
    """The run dir can be created and written, checked before the log file is opened in it (Hydra's logging setup
    failed with a bare "Unable to configure handler 'file'" on a read-only dir)."""
    probe_writable(run_dir, what="run dir", holds="the run's log (train.log), config and checkpoints go there")


# What a run name may not be: it names a directory under outputs/<date>/ (conf/config.yaml's hydra.run.dir).
_NOT_IN_NAMES = ("/", "\\", "\0")


def check_run_name(name: Any) -> None:
    """`run_name` is one directory name: a separator or `..` would put the run dir outside outputs/<date>/."""
    if str(name) not in (".", "..") and not any(c in str(name) for c in _NOT_IN_NAMES):
        return
    raise ValueError(
        f"config run_name={name!r}: must be one directory name, without '/', '\\' or NUL, and not '.' or '..' "
        "(the run dir is outputs/<date>/<time>-<task>-<model>-<run_name>); set run_name to a name of letters, digits "
        "and ._-=+@%, or hydra.run.dir to the dir the run should use"
    )


class RunDirCheck(Callback):
    """Hydra callback (conf/config.yaml `hydra.callbacks`): the run name and the run dir are checked before Hydra
    creates the dir and opens the log file in it. Hydra turns a callback's exception into a warning and goes on,
    so a refusal prints its message and exits with status 2 here, as every refusal does (`topp_rl.run.errors`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        with _exit_on_refusal():
            check_run_name(config.get("run_name", ""))
            check_run_dir_writable(Path(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        with _exit_on_refusal():  # each job's dir name is made safe (`topp_rl.run.sweep.job_subdir`)
            check_run_dir_writable(Path(config.hydra.sweep.dir))


@contextmanager
def _exit_on_refusal() -> Iterator[None]:
    try:
        yield
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _size(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir())
    return path.lstat().st_size


def remove_stale_temps(directory: Path, *, target: str | None = None) -> list[Path]:
    """Remove temp files and staged dirs whose writer is gone (SIGKILL mid-write), each one reported.

    Without `target`: every `.*.tmp` in `directory` (a checkpoint dir, with the run dir locked). With `target`:
    only the temps of `directory/target` named by `temp_path` (the dir may be anyone's, e.g. an export's parent).
    """

    removed = []
    for tmp in sorted(directory.glob(f".{glob.escape(target)}.*.tmp" if target else ".*.tmp")):
        parsed = temp_writer(tmp.name)
        if target is not None and (parsed is None or parsed[0] != target):
            continue
        pid = parsed[1] if parsed else None
        if pid is not None and pid != os.getpid() and _pid_alive(pid):
            continue
        size, kind = _size(tmp), "dir" if tmp.is_dir() and not tmp.is_symlink() else "file"
        if kind == "dir":
            shutil.rmtree(tmp)
        else:
            tmp.unlink()
        _say(f"removed stale temp {kind} {tmp} ({size} bytes) left by a writer that is gone (pid {pid or 'unknown'})")
        removed.append(tmp)
    return removed


# ----- resume -----
def resolve_ckpt_path(ckpt_path: str | None, checkpoint_dir: Path) -> Path | None:
    """`ckpt_path=last` -> `<checkpoint_dir>/last.ckpt`; either way the file must exist (Lightning would warn and
    start from scratch)."""
    if not ckpt_path:
        return None

    path = checkpoint_dir / "last.ckpt" if str(ckpt_path) == "last" else Path(ckpt_path)
    if not (path.is_file() or is_sharded(path)) and (checkpoint_dir.parent / "config.yaml").exists():
        raise ValueError(f"ckpt_path={ckpt_path}: no checkpoint at {path}: {no_checkpoint_run(checkpoint_dir.parent)}")
    if not (path.is_file() or is_sharded(path)):
        raise ValueError(
            f"ckpt_path={ckpt_path}: no checkpoint at {path}, so there is nothing to resume; drop ckpt_path to "
            f"start a new run, or point hydra.run.dir at the dir of the run to resume (it holds "
            f"checkpoints/last.ckpt)"
        )
    return path


def read_record(path: Path) -> tuple[dict | None, int | None]:
    """(the config `RunRecord` stored in a checkpoint, or None for checkpoints written before it existed;
    the checkpoint's global step)."""

    # mmap: the weights are not read, only the small pickled record (a sharded checkpoint's is meta.pt).
    checkpoint = (read_meta(path) if is_sharded(path)
                  else read_checkpoint(path, map_location="cpu", mmap=True, weights_only=True))
    return (checkpoint.get(RECORD_KEY) or {}).get("config"), checkpoint.get("global_step")


def writes_sharded_checkpoints(cfg: DictConfig) -> bool:
    """The configured strategy saves sharded checkpoints (`parallel=fsdp`)."""
    strategy = cfg.parallel.get("strategy")
    return bool(strategy) and capabilities_of(get_class(strategy._target_)).writes_sharded_checkpoints


def check_checkpoint_format(cfg: DictConfig, path: Path) -> None:
    """A sharded checkpoint resumes under `parallel=fsdp` only, and `parallel=fsdp` resumes sharded ones only."""
    sharded, sharded_run = is_sharded(path), writes_sharded_checkpoints(cfg)
    if sharded_run and not sharded:
        raise ValueError(single_file_refusal(path))
    if sharded and not sharded_run:
        raise ValueError(
            f"checkpoint {path} is a sharded checkpoint (parallel=fsdp wrote it); resume it with parallel=fsdp (at "
            f"any trainer.devices), or export its weights (python -m topp_rl.export {path} <hf dir>) and start a "
            f"new run from model=hf_path model.path=<hf dir>"
        )


# The parallel.* keys a layout override sets, with the Layout field each one fills.
_LAYOUT_KEYS = {"tp_size": "tp", "cp_size": "cp", "ep_size": "ep", "pp_size": "pp", "vpp_size": "vpp",
                "distributed_optimizer": "distributed_optimizer"}


def layout_override(layout: Layout) -> str:
    """The overrides that select `layout`: the parallel/ option of its strategy nearest to it (fewest keys apart,
    `parallel=tp2`), plus `parallel.<key>=<value>` for each key it differs on, plus trainer.devices / num_nodes."""
    def apart(node: dict) -> list[str]:
        return [f"parallel.{key}={str(getattr(layout, field)).lower()}" for key, field in _LAYOUT_KEYS.items()
                if node.get(key, False if key == "distributed_optimizer" else 1) != getattr(layout, field)]

    options = [(name, node) for name, node in parallel_options().items()
               if current_path((node.get("strategy") or {}).get("_target_")) == current_path(layout.strategy)]
    if not options:  # a strategy no shipped option names: the user's own config
        return f"parallel.strategy._target_={layout.strategy}"
    name, node = min(options, key=lambda option: (len(apart(option[1])), option[0]))
    words = [f"parallel={name}", *apart(node), f"trainer.devices={layout.devices}"]
    return " ".join(words + ([f"trainer.num_nodes={layout.num_nodes}"] if layout.num_nodes != 1 else []))


def check_resume_layout(cfg: DictConfig, checkpoint: Path, recorded: dict | None) -> None:
    """Refuse, before anything is built, a resume at a parallel layout the checkpoint cannot restore at (Lightning's
    load failed late, some layouts with a raw `Missing key(s) in state_dict`); the strategy class says which
    changes it restores across (`StrategyCapabilities.resume_refusal`: Megatron's pp / vpp / cp do)."""
    if recorded is None:
        return  # nothing to compare with: check_resume_config refuses or says so
    saved = Layout.of(recorded)
    wanted = Layout.of({k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("parallel", "trainer")})
    if current_path(saved.strategy) != current_path(wanted.strategy):
        reason = ("a checkpoint resumes under the parallel strategy that wrote it (each lays out the weights and the "
                  "optimizer state its own way)")
    else:
        reason = capabilities_of(get_class(wanted.strategy) if wanted.strategy else None).resume_refusal(saved, wanted)
    if reason is None:
        return
    raise ValueError(
        f"checkpoint {checkpoint} was saved at {layout_override(saved)} ({saved.sizes()}), this run asks for "
        f"{layout_override(wanted)} ({wanted.sizes()}): {reason}; resume with the saved layout (add "
        f"{layout_override(saved)} to the resume command), or {WEIGHTS_ONLY_WAY_OUT}"
    )


def report_versioned_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Say so for every `last-v<N>.ckpt`: Lightning's version counter wrote those beside an existing `last.ckpt`
    (topp_rl before `LastCheckpoint`); `ckpt_path=last` reads `last.ckpt` only, which may be the older state."""
    found = sorted(checkpoint_dir.glob("last-v*.ckpt"))
    if not found:
        return found
    last = checkpoint_dir / "last.ckpt"
    last_step = read_record(last)[1] if last.is_file() else None
    for path in found:
        step = read_record(path)[1]
        newer = step is not None and (last_step is None or step > last_step)
        _say(f"found {path} (step {step}), a versioned copy an older topp_rl wrote beside last.ckpt (step "
             f"{last_step}); ckpt_path=last reads last.ckpt only"
             + (f"; this copy is NEWER: resume it with ckpt_path={path}" if newer else "; it is not newer")
             + ", and delete the copies you no longer need")
    return found


def _leaves(tree: Any, prefix: str) -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_leaves(v, f"{prefix}.{k}"))
        return out or {prefix: {}}
    return {prefix: tree}


def _select(tree: dict, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


# Modules that moved (topp_rl.rollout split into data / engines / tasks; issue 36's rooms): a checkpoint recorded with the old
# import path names the same class, so a resume is not refused for it.
MOVED_MODULES = {
    "topp_rl.rollout.tasks.": "topp_rl.tasks.generated.",
    "topp_rl.rollout.datasets.": "topp_rl.tasks.datasets.",
    "topp_rl.rollout.rewards.": "topp_rl.tasks.rewards.",
    "topp_rl.rollout.embedded.": "topp_rl.engines.embedded.",
    "topp_rl.rollout.sglang.": "topp_rl.engines.sglang.",
    "callbacks.": "topp_rl.callbacks.",
    # issue 36: the loose modules moved into rooms
    **{f"topp_rl.{m}.": f"topp_rl.trainer.{m}." for m in ("module", "hook", "backbone", "lora", "metrics",
                                                          "step_metrics", "records", "precision", "schedule", "timer")},
    **{f"topp_rl.{m}.": f"topp_rl.run.{m}." for m in ("rundir", "checkpoint", "sharded_checkpoint", "summary",
                                                      "console", "loggers", "sweep", "stop", "host_memory")},
    "topp_rl.moe.": "topp_rl.models.moe.",
}


# Guarded keys added after checkpoints were written, with the behaviour a run had before them: a checkpoint that
# records none of them resumes under that behaviour unrefused (and a change away from it is still refused).
ADDED_KEYS = {
    "rollout.step._target_": "topp_rl.rollout.step.SingleTurnStep",  # issue 36: one answer per prompt
    "rollout.max_turns": 1,  # issue 37: the single-turn step's one turn
    "rollout.max_trajectory_tokens": _UNREAD,  # read only by the agent loop, which rollout.step still guards
    "algo.teacher_kl_coeff": 0.0,  # on-policy distillation: no teacher term
    "algo.loss.teacher_kl_coef": 0.0,
    "teacher": {},  # teacher=none: an empty node
}


def current_path(value: Any) -> Any:
    """A `_target_` (or reward `fn`) string under its current module path; anything else as it is."""
    if isinstance(value, str):
        for old, new in MOVED_MODULES.items():
            if value.startswith(old):
                return new + value[len(old):]
    return value


def config_changes(old: dict, new: dict, keys: list[str]) -> list[str]:
    """`key: old -> new` for every leaf under `keys` that differs, sorted (absent on one side: `<absent>`)."""
    changes = []
    for key in keys:
        before, after = _leaves(_select(old, key), key), _leaves(_select(new, key), key)
        for leaf in sorted(set(before) | set(after)):
            a, b = before.get(leaf, _MISSING), after.get(leaf, _MISSING)
            if a == _MISSING:
                a = ADDED_KEYS.get(leaf, _MISSING)
            if a is not _UNREAD and current_path(a) != current_path(b):
                changes.append(f"{leaf}: {a!r} -> {b!r}")
    return sorted(set(changes))


def check_resume_config(cfg: DictConfig, checkpoint: Path, old: dict | None) -> None:
    """Refuse a resume that changes a guarded key from `old` (the config `checkpoint` records), unless
    `resume.allow_config_change=true` (then say so)."""
    allow = bool(cfg.resume.allow_config_change)
    if old is None:
        if not allow:
            raise ValueError(
                f"checkpoint {checkpoint} records no config (written before topp_rl stored one), so this resume "
                f"cannot be checked against it; set resume.allow_config_change=true to resume it unchecked"
            )
        _say(f"resuming {checkpoint} unchecked: it records no config (resume.allow_config_change=true)")
        return
    new = OmegaConf.to_container(cfg, resolve=True)
    changes = config_changes(old, new, list(cfg.resume.guarded_keys))
    if not changes:
        return
    listed = "; ".join(changes)
    if not allow:
        raise ValueError(
            f"resuming {checkpoint} would change {len(changes)} setting(s) the run was trained with: {listed}; "
            f"resume with the run's values (its config.yaml and config.resume-*.yaml record them), or set "
            f"resume.allow_config_change=true to continue with the new ones"
        )
    _say(f"resuming {checkpoint} with changed settings (resume.allow_config_change=true): {listed}")


def no_checkpoint_run(run_dir: Path) -> str:
    """What to do with a run dir whose run left `config.yaml` but no checkpoint: a fresh start there is refused
    (it holds a run) and so is `ckpt_path=last` (nothing to resume), so the way on is a dir without a run."""
    how = ("it finished with checkpoint.every_n_steps=0" if (run_dir / "summary.json").exists()
           else "its start ended before its first save")
    return (f"run dir {run_dir} holds a run that saved no checkpoint (config.yaml, no checkpoints/last.ckpt: {how}), "
            f"so there is nothing to resume; start it over by deleting the dir (rm -r {shlex.quote(str(run_dir))}) "
            f"and running the same command without ckpt_path, or start this run in a new dir (another "
            f"hydra.run.dir)")


def _existing_run(run_dir: Path) -> str | None:
    for name in ("config.yaml", "checkpoints/last.ckpt"):
        if (run_dir / name).exists():
            return name
    return None


def record_config(cfg: DictConfig, run_dir: Path) -> Path:
    """Write `config.yaml` on the first start, `config.resume-<n>.yaml` on the n-th resume; never overwrite."""
    path = run_dir / "config.yaml"
    if path.exists():
        n = 1 + max((int(p.stem.rsplit("-", 1)[1]) for p in run_dir.glob("config.resume-*.yaml")
                     if p.stem.rsplit("-", 1)[1].isdigit()), default=0)
        path = run_dir / f"config.resume-{n}.yaml"
    with path.open("x") as f:  # "x": a name collision is a bug, never a silent overwrite
        f.write(OmegaConf.to_yaml(cfg, resolve=False))
    return path


def write_hydra_files(cfg: DictConfig) -> Path | None:
    """Hydra's `<output dir>/.hydra/{config,hydra,overrides}.yaml`, as its `run_job` writes them (`cfg`, the task
    config, unresolved), in a Hydra app only (a test composing its config has none). Called once the run dir
    accepted this start: Hydra itself writes them before any check, unless `hydra.output_subdir` is null."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.instance().cfg  # {"hydra": ...}
    out = Path(hydra_cfg.hydra.runtime.output_dir) / HYDRA_SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", hydra_cfg),
                       ("overrides.yaml", hydra_cfg.hydra.overrides.task)):
        (out / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")
    return out


# ----- W&B -----
def wandb_run_id(run_dir: Path) -> str | None:
    """The run dir's W&B run id, created on first use: a resume logs into the same W&B run (no split history)."""
    path = Path(run_dir) / WANDB_ID
    if not path.exists() and is_launching_rank():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(4) + "\n")
    return path.read_text().strip() if path.exists() else None


# ----- the whole start -----
class RunDir:
    """Opened by `train` before anything is built; holds the lock until `close`."""

    def __init__(self, cfg: DictConfig) -> None:
        self.path = Path(cfg.paths.output_dir)
        self.checkpoint_dir = self.path / "checkpoints"
        self.owner = is_launching_rank()
        self.lock: RunDirLock | None = None
        self.resume_from: Path | None = None
        self.resume_step: int | None = None
        self._open(cfg)

    def _open(self, cfg: DictConfig) -> None:

        if not self.owner:
            self.resume_from = resolve_ckpt_path(cfg.get("ckpt_path"), self.checkpoint_dir)
            return
        check_run_dir_writable(self.path)
        self.lock = RunDirLock(self.path).acquire()
        try:
            probe_writable(self.checkpoint_dir)
            remove_stale_temps(self.checkpoint_dir)
            report_versioned_checkpoints(self.checkpoint_dir)
            self.resume_from = resolve_ckpt_path(cfg.get("ckpt_path"), self.checkpoint_dir)
            for path in remove_unreferenced(self.checkpoint_dir, keep=(self.resume_from,) if self.resume_from else ()):
                _say(f"removed {path}, a sharded checkpoint no link names (a save cut short, or superseded)")
            if self.resume_from is None and (found := _existing_run(self.path)):
                if not (self.checkpoint_dir / "last.ckpt").exists():
                    raise ValueError(no_checkpoint_run(self.path))
                raise ValueError(
                    f"run dir {self.path} already holds a run ({found}); resume it with ckpt_path=last, or start "
                    f"this run in a new dir (another hydra.run.dir), or delete {self.path} to start over"
                )
            if self.resume_from is not None:
                check_checkpoint_format(cfg, self.resume_from)
                recorded, self.resume_step = read_record(self.resume_from)
                check_resume_layout(cfg, self.resume_from, recorded)
                check_resume_config(cfg, self.resume_from, recorded)
                _say(f"resuming from {self.resume_from} (step {self.resume_step})")
            write_hydra_files(cfg)  # accepted: a new run, or a resume (.hydra/ holds the latest start, as in Hydra)
        except BaseException:
            self.close()
            raise

    def record_config(self, cfg: DictConfig) -> Path | None:
        return record_config(cfg, self.path) if self.owner else None

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
