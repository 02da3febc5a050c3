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
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from topp_rl.checkpoint import fsync_dir, named_read_errors, temp_path

META = "meta.pt"
_DATA = re.compile(r"^(?P<link>.+)-step(?P<step>\d+)-[0-9a-f]+\.dcp$")


def is_sharded(path: str | Path) -> bool:
    """A sharded checkpoint: a directory (or a link to one) holding `meta.pt`."""
    path = Path(path)
    return path.is_dir() and (path / META).is_file()


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


def read_meta(path: str | Path) -> dict[str, Any]:
    """A sharded checkpoint's `meta.pt` (everything but the weights and the optimizer state), read safely."""
    meta = Path(path) / META
    with named_read_errors(meta):
        return torch.load(meta, map_location="cpu", weights_only=True)


def read_tensors(path: str | Path, template: dict[str, Any]) -> dict[str, Any]:
    """Fill `template` (nested dicts of full, unsharded tensors under the saved keys) from a sharded checkpoint,
    in this process alone (no process group): DCP assembles each tensor from the shards of every saving rank."""
    import torch.distributed.checkpoint as dcp

    with named_read_errors(path), warnings.catch_warnings():
        # no_dist=True is the intent; torch still warns that it assumes so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, checkpoint_id=str(path), no_dist=True)
    return template


def saved_keys(path: str | Path) -> set[str]:
    """The flattened keys a sharded checkpoint holds (`state_dict.policy.model.<HF name>`, ...)."""
    import torch.distributed.checkpoint as dcp

    with named_read_errors(path):
        return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
