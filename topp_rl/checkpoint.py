"""Checkpointing: atomic writes, and a ModelCheckpoint for manual-optimisation RL steps.

Lightning's `TorchCheckpointIO` writes through an fsspec transaction, which for local paths stages the file in
the system temp dir and then `shutil.move`s it: across file systems that is a copy, so a SIGKILL mid-write can
leave a truncated `last.ckpt`. `AtomicCheckpointIO` writes a temp file next to the target, fsyncs it and
`os.replace`s it (atomic on POSIX), so a checkpoint path always holds a complete file.

The rollout state (step, RNG, data position) travels in the checkpoint through the datamodule's `state_dict`,
which Lightning saves and restores itself; resume with `ckpt_path=last`.
"""

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO


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
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class RolloutCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that saves after the step's optimizer updates, without Lightning's manual-opt warning.

    Saving the post-update state is what resume needs: the checkpoint at global step k holds the weights the
    engine samples rollout k+1 with, and the datamodule state that draws it.
    """

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*no pre-optimization state was saved.*")
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
