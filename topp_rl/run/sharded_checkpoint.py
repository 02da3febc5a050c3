"""Sharded checkpoints on disk: `last.ckpt` is a symlink to a directory of torch.distributed.checkpoint files.

Layout (`parallel=fsdp`; `topp_rl.fsdp.strategy` writes and reads it):

    checkpoints/last.ckpt -> last-step12-9f3a.dcp/
    checkpoints/last-step12-9f3a.dcp/{.metadata, __0_0.distcp, __1_0.distcp, ..., meta.pt}

Every rank writes its own shards of the weights and the optimizer state (`*.distcp`, DCP's format, re-shardable
to any world size on load); rank 0 writes `meta.pt`, the rest of Lightning's checkpoint (step, loops, datamodule
and callback state, the run's config) as one `torch.save` file.

Why a symlink: a directory cannot be replaced atomically by `rename` (the target must be absent or empty), but a
symlink can. A save writes a new, uniquely named data directory, then points `last.ckpt` at it with one
`os.replace` and removes the older data directory. A SIGKILL at any point leaves `last.ckpt` naming a complete
checkpoint; a data directory it does not name is unfinished or superseded and is removed at the next start (the
run dir is locked then) or at the next save. Lightning's own `ModelCheckpoint(save_last="link")` uses a symlink
for `last.ckpt` the same way. The files must be on a file system every rank sees (as DCP requires).

Faults: DCP reports a failed read or write as a `CheckpointException` (a BaseException, so `except Exception`
misses it) holding each rank's bare error ("unexpected pos 704 vs 598", a zip-reader error), which names no file.
Every shard file is opened through `_NamingFileSystem`, so the error names the file, and a read or write that
fails raises `CheckpointReadError` / `CheckpointWriteError` with the file, the cause (a full disk as ENOSPC,
a shard truncated or corrupt against the sizes DCP's index records) and the fix. A save that fails removes its
data dir (`discard_unpublished`); `last.ckpt` keeps naming the last complete one. A data dir that lacks a part
(`.metadata`, `meta.pt`) is still recognised (`is_sharded`) and refused naming the missing file. Corruption
inside a tensor's bytes goes unseen: DCP stores no checksums.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from topp_rl.run.checkpoint import (
    AtomicCheckpointIO,
    CheckpointReadError,
    CheckpointWriteError,
    fsync_dir,
    mib,
    named_read_errors,
    os_error_behind,
    temp_path,
    write_cause,
)

META = "meta.pt"
INDEX = ".metadata"  # DCP's index: which file holds which bytes of each tensor
_DATA = re.compile(r"^(?P<link>.+)-step(?P<step>\d+)-[0-9a-f]+\.dcp$")
_PARTS = {INDEX: "DCP's index of the shards, written once every rank's shards are",
          META: "the step, loops and run config, written after the shards"}
_READ_FIX = ("a save never points last.ckpt at an unfinished checkpoint, so the file was lost or damaged after "
             "its save: restore it from a copy of the run dir, or use another complete checkpoint (ckpt_path=<dir> "
             "to resume, python -m topp_rl.export <dir> <hf dir> to export), or drop ckpt_path to start over in a "
             "new run dir")


def is_sharded(path: str | Path) -> bool:
    """A sharded checkpoint: a directory (or a link to one) holding `meta.pt` or DCP's index, or named as a data
    dir. One that lacks a part still is one: its read names the missing file (not 'no checkpoint')."""
    path = Path(path)
    if not path.is_dir():
        return False
    return (path / META).is_file() or (path / INDEX).is_file() or bool(_DATA.match(path.resolve().name))


def require_complete(path: str | Path) -> None:
    """Refuse a sharded checkpoint that lacks `.metadata` or `meta.pt`, naming the missing file."""
    data_dir = Path(path).resolve()
    for name, what in _PARTS.items():
        if not (data_dir / name).is_file():
            raise CheckpointReadError(
                f"sharded checkpoint {path} is incomplete: {data_dir / name} ({what}) is missing; {_READ_FIX}"
            )


def data_dir_for(link: Path, step: int) -> Path:
    """A new, unique data directory beside `link` for the state of `step` (`last-step12-9f3a.dcp`)."""
    return link.parent / f"{link.stem}-step{step}-{secrets.token_hex(2)}.dcp"


def publish(link: Path, data_dir: Path) -> None:
    """Point `link` at the complete `data_dir` (one atomic `os.replace` of a symlink), then remove the data
    directories of `link` it no longer names. A regular file at `link` (a single-file checkpoint) is replaced."""
    if link.is_dir() and not link.is_symlink():
        raise IsADirectoryError(f"{link} is a directory, not a topp_rl checkpoint link; move it away and resume "
                                f"from it explicitly (ckpt_path=<dir>) or start a new run dir")
    fsync_dir(data_dir)  # DCP fsyncs its (flat) shard files; their directory entries need it too
    tmp = temp_path(link)
    os.symlink(data_dir.name, tmp)  # relative: the run dir can be moved or copied as a whole
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(link.parent)
    remove_unreferenced(link.parent, keep=(data_dir,))


def remove_unreferenced(directory: Path, *, keep: tuple[Path, ...] = ()) -> list[Path]:
    """Remove every data directory in `directory` that no link there names (a save cut short, or superseded),
    except `keep`; returns what was removed."""
    named = {(directory / os.readlink(p)).resolve() for p in directory.iterdir() if p.is_symlink()}
    named |= {Path(p).resolve() for p in keep}
    removed = []
    for path in sorted(directory.iterdir()):
        if _DATA.match(path.name) and path.is_dir() and not path.is_symlink() and path.resolve() not in named:
            shutil.rmtree(path)
            removed.append(path)
    return removed


def discard_unpublished(link: Path, data_dir: Path) -> None:
    """Remove the data dir of a save that failed, unless `link` names it (then it is complete). If the removal
    fails too, the next start or save removes it (`remove_unreferenced`)."""
    if link.is_symlink() and (link.parent / os.readlink(link)).resolve() == data_dir.resolve():
        return
    shutil.rmtree(data_dir, ignore_errors=True)


def read_meta(path: str | Path) -> dict[str, Any]:
    """A sharded checkpoint's `meta.pt` (everything but the weights and the optimizer state), read safely; a
    checkpoint lacking a part is refused here, before anything is built."""
    require_complete(path)
    meta = Path(path) / META
    with named_read_errors(meta):
        return torch.load(meta, map_location="cpu", weights_only=True)


def read_tensors(path: str | Path, template: dict[str, Any]) -> dict[str, Any]:
    """Fill `template` (nested dicts of full, unsharded tensors under the saved keys) from a sharded checkpoint,
    in this process alone (no process group): DCP assembles each tensor from the shards of every saving rank."""
    with warnings.catch_warnings():
        # no_dist=True is the intent; torch still warns that it assumes so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_shards(template, path, no_dist=True)
    return template


def saved_keys(path: str | Path) -> set[str]:
    """The flattened keys a sharded checkpoint holds (`state_dict.policy.model.<HF name>`, ...)."""
    require_complete(path)
    try:
        return set(_reader(path).read_metadata().state_dict_metadata)
    except (Exception, dcp.CheckpointException) as err:
        raise CheckpointReadError(_read_failed(Path(path), err)) from err


# ----- shard files: DCP's reads and writes, failures naming the file -----
class ShardFileError(Exception):
    """A shard file's read or write failed: its path, what went wrong, and the errno behind it. Plain values only:
    DCP hands every rank's error to every rank pickled, which drops an exception's cause."""

    def __init__(self, path: str, error: str, errno: int | None) -> None:
        super().__init__(path, error, errno)
        self.path, self.error, self.errno = path, error, errno

    def __str__(self) -> str:
        return f"{self.path}: {self.error}"


class _NamingFileSystem(FileSystem):
    """DCP's local file system; any failure while a file's stream is open is re-raised naming that file."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as err:
            os_err = os_error_behind(err)
            said = write_cause(err) if "w" in mode else f"{type(err).__name__}: {_first_line(err)}"
            raise ShardFileError(str(path), said, os_err.errno if os_err else None) from err


def _reader(path: str | Path) -> dcp.FileSystemReader:
    reader = dcp.FileSystemReader(str(path))
    reader.fs = _NamingFileSystem()  # DCP opens every file through `fs`
    return reader


def _writer(path: str | Path) -> dcp.FileSystemWriter:
    writer = dcp.FileSystemWriter(str(path))
    writer.fs = _NamingFileSystem()
    return writer


def load_shards(state: dict[str, Any], path: str | Path, *, no_dist: bool = False) -> None:
    """Fill `state` in place from a sharded checkpoint (DCP, resharded to this world); a checkpoint that lacks
    a part, or a shard file missing, truncated or corrupt, raises `CheckpointReadError` naming the file."""
    require_complete(path)
    try:
        dcp.load(state, storage_reader=_reader(path), no_dist=no_dist)
    except (Exception, dcp.CheckpointException) as err:  # CheckpointException is a BaseException
        raise CheckpointReadError(_read_failed(Path(path), err)) from err


def write_shards(shards: dict[str, Any], data_dir: Path, *, link: Path) -> None:
    """This rank's shards into `data_dir` (DCP; a collective: a failure on any rank raises on every rank)."""
    try:
        dcp.save(shards, storage_writer=_writer(data_dir))
    except (Exception, dcp.CheckpointException) as err:
        failed = _shard_failure(err)
        file, cause = (failed.path, failed.error) if failed else (None, write_cause(_first_error(err)))
        raise shard_write_failed(link, data_dir, file, cause) from err


def finish_save(checkpoint: dict[str, Any], data_dir: Path, *, link: Path) -> None:
    """Rank 0, once every rank's shards are written: `meta.pt`, then `link` switched to `data_dir`. On failure
    the data dir is removed and `link` keeps naming the previous checkpoint."""
    meta = data_dir / META
    try:
        AtomicCheckpointIO().save_checkpoint(checkpoint, meta)
        publish(link, data_dir)
    except Exception as err:
        discard_unpublished(link, data_dir)
        written = isinstance(err, CheckpointWriteError) and err.__cause__ is not None  # meta.pt's own write
        file, cause = (meta, write_cause(err.__cause__)) if written else (link, write_cause(err))
        raise shard_write_failed(link, data_dir, file, cause) from err


def shard_write_failed(link: Path, data_dir: Path, file: str | Path | None, cause: str) -> CheckpointWriteError:
    """The error for a sharded save that failed: the file, the cause, the free space and the fix."""
    free = shutil.disk_usage(link.parent).free
    return CheckpointWriteError(
        f"could not write sharded checkpoint {data_dir}: {file or 'a shard'}: {cause}; {mib(free)} free in "
        f"{link.parent}; free space there (or point hydra.run.dir at a larger disk) and resume with "
        f"ckpt_path=last; {link} still names the last complete checkpoint, if any, and the unfinished "
        f"{data_dir.name} is removed"
    )


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else ""


def _first_error(err: BaseException) -> BaseException:
    """The lowest rank's error inside DCP's `CheckpointException`, else `err`."""
    if isinstance(err, dcp.CheckpointException) and err.failures:
        return err.failures[min(err.failures)][0]
    return err


def _shard_failure(err: BaseException) -> ShardFileError | None:
    """The lowest rank's `ShardFileError` inside DCP's `CheckpointException` (or `err` itself), if any."""
    if isinstance(err, ShardFileError):
        return err
    if isinstance(err, dcp.CheckpointException):
        return next((e for _, (e, _tb) in sorted(err.failures.items()) if isinstance(e, ShardFileError)), None)
    return None


def _read_failed(path: Path, err: BaseException) -> str:
    failed = _shard_failure(err)
    if failed is None:
        first = _first_error(err)
        return f"could not read sharded checkpoint {path}: {type(first).__name__}: {_first_line(first)}; {_READ_FIX}"
    file = Path(failed.path).resolve()  # the data dir's file, not the path through the link
    return f"could not read sharded checkpoint {path}: {file} {_damage(path, file)} ({failed.error}); {_READ_FIX}"


def _damage(path: Path, file: Path) -> str:
    """How a shard file that failed to load differs from what the checkpoint's index records."""
    if not file.exists():
        return "is missing"
    size = file.stat().st_size
    needed = _indexed_size(path, file.name)
    if needed is None:
        return f"is corrupt ({size} bytes)"
    if size < needed:
        return f"is truncated: {size} bytes, where the index ({INDEX}) records {needed}"
    return f"is corrupt: {size} bytes as the index ({INDEX}) records, but its data does not load"


def _indexed_size(path: Path, name: str) -> int | None:
    """The bytes DCP's index records for shard file `name` (None: the index is unreadable or lacks it)."""
    try:
        index = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception:
        return None
    return max((s.offset + s.length for s in index.storage_data.values() if s.relative_path == name), default=None)


def single_file_refusal(path: Path) -> str:
    return (f"checkpoint {path} is a single-file checkpoint (another parallel config wrote it); parallel=fsdp "
            f"resumes its own sharded checkpoints only (at any world size). Resume it with the parallel config "
            f"that wrote it, or start an FSDP run from its weights: python -m topp_rl.export {path} <hf dir>, "
            f"then model=hf_path model.path=<hf dir>")
