"""Checkpointing: atomic writes, named read/write errors, the run's config in every checkpoint, and a save on
SIGTERM / Ctrl-C.

Lightning's `TorchCheckpointIO` writes through an fsspec transaction, which for local paths stages the file in
the system temp dir and then `shutil.move`s it: across file systems that is a copy, so a SIGKILL mid-write can
leave a truncated `last.ckpt`. `AtomicCheckpointIO` writes a temp file next to the target, fsyncs it and
`os.replace`s it (atomic on POSIX), so a checkpoint path always holds a complete file. The temp file is named
`.<target>.<pid>.<random>.tmp` (unique per writer; `topp_rl.run.rundir` removes those of dead writers at start) and
created with the umask's normal mode (0644 under umask 022; `mkstemp` would give 0600).

`LastCheckpoint` is the only writer of `last.ckpt` (periodic, train end, SIGTERM / Ctrl-C). Lightning alone stops
the loop on SIGTERM and exits 0 without saving; `topp_rl.run.stop.StopOnSignal` has all ranks stop after the same
step, `LastCheckpoint` saves there and `fit` turns the stop into exit status 128 + signal number.

The rollout state (step, RNG, data position) travels in the checkpoint through the datamodule's `state_dict`,
which Lightning saves and restores itself; resume with `ckpt_path=last`.
"""

import errno
import os
import re
import secrets
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from topp_rl.run.sweep import run_dir_override

RECORD_KEY = "topp_rl"  # checkpoint[RECORD_KEY] = {"config": the run's resolved config}
_TEMP = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp$")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (the previous file at the path is kept)."""


class CheckpointReadError(ValueError):
    """A checkpoint file could not be read (truncated, empty, not a checkpoint)."""


def temp_path(path: Path) -> Path:
    return path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def temp_writer(name: str) -> tuple[str, int] | None:
    """(target name, writer pid) of a temp name as written by `temp_path`, else None."""
    m = _TEMP.match(name)
    return (m["target"], int(m["pid"])) if m else None


def temp_writer_pid(name: str) -> int | None:
    """The pid in a temp file's name as written by `temp_path`, else None."""
    parsed = temp_writer(name)
    return parsed[1] if parsed else None


def mib(n: int) -> str:
    """`n` bytes in MiB, for messages about disk space."""
    return f"{n / 2**20:.1f} MiB"


@contextmanager
def named_read_errors(path: str | Path) -> Iterator[None]:
    """Re-raise a failed checkpoint read naming the file, its size and the fix (a bare EOFError names nothing)."""
    try:
        yield
    except FileNotFoundError:
        raise
    except Exception as err:
        path = Path(path)
        size = path.stat().st_size if path.exists() else 0
        raise CheckpointReadError(
            f"could not read checkpoint {path} ({size} bytes): {type(err).__name__}: {err}; the file is empty, "
            f"truncated or not a checkpoint torch can load: delete it and resume from another one "
            f"(ckpt_path=<file>), or drop ckpt_path to start over in a new run dir"
        ) from err


def read_checkpoint(path: str | Path, **load_kwargs) -> dict[str, Any]:
    with named_read_errors(path):
        return torch.load(path, **load_kwargs)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def os_error_behind(err: BaseException) -> OSError | None:
    """The OSError that caused `err`, if any: torch's writer swallows a failed `write` (its context) and raises
    an internal error instead ("unexpected pos 704 vs 598")."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def write_cause(err: BaseException) -> str:
    """What made a write fail, ENOSPC named as a full disk (torch's own message alone names no cause)."""
    said = f"{type(err).__name__}: {err}"
    os_err = os_error_behind(err)
    if os_err is not None and os_err.errno == errno.ENOSPC:
        reported = "" if os_err is err else f"; reported as {said}"
        return f"the disk is full (ENOSPC: {os_err.strerror}{reported})"
    return said


def write_failed(path: Path, err: Exception) -> CheckpointWriteError:
    """The error for a checkpoint write that failed, naming the path and the free space. torch reports a full disk
    as an internal error ("unexpected pos 704 vs 598")."""
    free = shutil.disk_usage(path.parent).free
    return CheckpointWriteError(
        f"could not write checkpoint {path}: {type(err).__name__}: {err}; {mib(free)} free in {path.parent}; free "
        f"space there (or point hydra.run.dir at a larger disk) and resume with ckpt_path=last; the previous "
        f"{path.name}, if any, is kept"
    )


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose saves are write-temp-then-rename in the target directory (local paths)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise ValueError(
                f"AtomicCheckpointIO got storage_options={storage_options!r}; it writes local files only, "
                "drop the option or use Lightning's TorchCheckpointIO for remote storage"
            )
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(path)
        try:
            # O_EXCL: never write into another writer's file; mode 0o666 so the umask decides, as for any file.
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except Exception as err:
            tmp.unlink(missing_ok=True)
            raise write_failed(path, err) from err
        except BaseException:  # KeyboardInterrupt mid-write: no partial temp file left behind
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)  # make the rename itself durable

    def load_checkpoint(self, path, *args, **kwargs) -> dict[str, Any]:
        with named_read_errors(path):
            return super().load_checkpoint(path, *args, **kwargs)


class RunRecord(Callback):
    """Writes the run's resolved config into every checkpoint, so a resume can check what it continues."""

    def __init__(self, cfg: DictConfig) -> None:
        self.config = OmegaConf.to_container(cfg, resolve=True)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[RECORD_KEY] = {"config": self.config}


class RunInterrupted(SystemExit):
    """A run stopped by a signal after saving its checkpoint: exit status 128 + signal number (143, 130)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message


class LastCheckpoint(Checkpoint):
    """The one writer of `<dirpath>/last.ckpt`, so `ckpt_path=last` always means the newest saved state.

    It saves the post-update state (the weights the engine samples the next rollout with, and the datamodule
    state that draws it) every `every_n_steps` steps, at train end, and when a SIGTERM or a first Ctrl-C stops
    the run, always to the same file: Lightning's `ModelCheckpoint` counts versions (`last-v1.ckpt`, ...) whenever
    `last.ckpt` exists and it did not write it itself, which left a resumed run's later saves beside an old
    `last.ckpt`. The train-end save is skipped only for a run that never had a checkpoint (`every_n_steps=0`,
    fresh start). An exception other than a signal stop saves nothing: it may land mid-update, and the last save
    stays the newest consistent state.

    Signals: `topp_rl.run.stop.StopOnSignal` has every rank raise Lightning's `SIGTERMException` at the end of the same
    step, so the save here is the same consistent post-step state on all ranks (a KeyboardInterrupt can land
    mid-update, where a save would not resume exactly). `exit_status_on_signal` turns the stop into exit status
    128 + signal number.
    """

    def __init__(self, *, dirpath: str | Path, every_n_steps: int = 0) -> None:
        if every_n_steps < 0:
            raise ValueError(f"checkpoint.every_n_steps ({every_n_steps}) must be >= 0 (0: no periodic saves)")
        self.path = Path(dirpath) / "last.ckpt"
        self.every_n_steps = every_n_steps
        self.saved_step: int | None = None  # the step last.ckpt holds, once this run or a resumed one wrote it
        self.saving = False  # a save is being written (a second Ctrl-C then waits for it: `StopOnSignal`)

    @property
    def state_key(self) -> str:
        return "LastCheckpoint"  # one per run: independent of every_n_steps, so a resume may change it

    def save(self, trainer) -> None:
        self.saved_step = trainer.global_step  # before the save: it is part of the saved state
        self.saving = True
        try:
            trainer.save_checkpoint(self.path)
        finally:
            self.saving = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self.save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.saved_step != trainer.global_step and (self.every_n_steps or self.saved_step is not None):
            self.save(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # saved_step is the same on every rank, so a sharded (collective) save is entered by all or by none
        if isinstance(exception, SIGTERMException) and self.saved_step != trainer.global_step:
            self.save(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"saved_step": self.saved_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved_step = state.get("saved_step")

    def interrupted(self, step: int, signum: int) -> RunInterrupted:
        return RunInterrupted(signum, (
            f"[topp_rl] stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved to {self.path}; "
            f"resume with {run_dir_override(self.path.parent.parent)} ckpt_path=last (the run's overrides come from its dir; exit "
            f"status {128 + signum})"
        ))
