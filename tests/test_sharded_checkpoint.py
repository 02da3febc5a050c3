"""Sharded checkpoints on disk (`topp_rl.sharded_checkpoint`, written by `parallel=fsdp`): `last.ckpt` a symlink
switched atomically to a complete data dir, unnamed data dirs removed, the shards read back in one process, and a
resume that mixes a sharded checkpoint with a single-file strategy (or the reverse) refused at start. The FSDP
runs that write and resume these (world 2 -> 2 and 2 -> 4, SIGKILL) are in test_fsdp_train / test_checkpoint."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import TINY, compose_config

from topp_rl.checkpoint import RECORD_KEY, AtomicCheckpointIO
from topp_rl.rundir import read_record
from topp_rl.sharded_checkpoint import (
    META,
    data_dir_for,
    is_sharded,
    publish,
    read_meta,
    read_tensors,
    remove_unreferenced,
    saved_keys,
)
from topp_rl.train import train

# The one-process saves below (no_dist=True) are the intent; torch warns that it assumes so.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(link: Path, step: int, weight: torch.Tensor) -> Path:
    """One process's sharded checkpoint, written as the FSDP strategy writes it (DCP, then meta.pt, then the link)."""
    data_dir = data_dir_for(link, step)
    dcp.save({"state_dict": {"policy.model.w": weight}}, checkpoint_id=str(data_dir), no_dist=True)
    AtomicCheckpointIO().save_checkpoint({"global_step": step, RECORD_KEY: {"config": {"seed": 0}}}, data_dir / META)
    publish(link, data_dir)
    return data_dir


def test_a_save_switches_the_link_to_a_complete_dir_and_removes_the_previous_one(tmp_path):
    link = tmp_path / "last.ckpt"
    first = _save(link, 2, torch.arange(6.0))
    assert link.is_symlink() and os.readlink(link) == first.name  # relative: the run dir can move
    assert first.name.startswith("last-step2-") and first.name.endswith(".dcp")
    assert is_sharded(link) and read_record(link) == ({"seed": 0}, 2)

    second = _save(link, 4, torch.arange(6.0) * 2)
    assert os.readlink(link) == second.name and not first.exists()
    assert read_meta(link)["global_step"] == 4
    assert saved_keys(link) == {"state_dict.policy.model.w"}
    got = read_tensors(link, {"state_dict": {"policy.model.w": torch.empty(6)}})["state_dict"]["policy.model.w"]
    assert torch.equal(got, torch.arange(6.0) * 2)


def test_a_single_file_checkpoint_at_the_link_is_replaced_and_a_real_dir_is_refused(tmp_path):
    link = tmp_path / "last.ckpt"
    torch.save({"global_step": 1}, link)
    _save(link, 3, torch.zeros(2))
    assert link.is_symlink() and read_meta(link)["global_step"] == 3

    other = tmp_path / "other"
    (other / "best.ckpt").mkdir(parents=True)
    with pytest.raises(IsADirectoryError, match="best.ckpt is a directory, not a topp_rl checkpoint link"):
        _save(other / "best.ckpt", 1, torch.zeros(2))


def test_data_dirs_no_link_names_are_removed_except_the_ones_kept(tmp_path):
    """A SIGKILL mid-save leaves a data dir that no link names; the named ones (last and best) stay."""
    last, best = tmp_path / "last.ckpt", tmp_path / "best.ckpt"
    named = [_save(last, 6, torch.zeros(2)), _save(best, 5, torch.zeros(2))]
    cut_short = data_dir_for(last, 8)
    cut_short.mkdir()
    (cut_short / "__0_0.distcp").write_bytes(b"partial")
    explicit = data_dir_for(last, 7)  # a resume target named by ckpt_path, not by a link
    explicit.mkdir()
    unrelated = tmp_path / "notes.dcp"  # not a data dir's name: never touched
    unrelated.mkdir()
    assert remove_unreferenced(tmp_path, keep=(explicit,)) == [cut_short]
    assert all(p.is_dir() for p in (*named, explicit, unrelated))


def _fake_sharded_run(run_dir: Path, cfg) -> Path:
    from omegaconf import OmegaConf

    link = run_dir / "checkpoints" / "last.ckpt"
    link.parent.mkdir(parents=True)
    data_dir = data_dir_for(link, 1)
    data_dir.mkdir()
    torch.save({"global_step": 1, RECORD_KEY: {"config": OmegaConf.to_container(cfg, resolve=True)}}, data_dir / META)
    publish(link, data_dir)
    return link


def test_a_resume_mixing_sharded_and_single_file_checkpoints_is_refused_at_start(tmp_path):
    """A sharded checkpoint loads into FSDP shards only; FSDP reads DCP shards only: both say the way over."""
    single = tmp_path / "single"
    link = _fake_sharded_run(single, compose_config(single, *TINY))
    with pytest.raises(ValueError) as info:
        train(compose_config(single, *TINY, "ckpt_path=last"))
    assert str(info.value) == (
        f"checkpoint {link} is a sharded checkpoint (parallel=fsdp wrote it); resume it with parallel=fsdp (at any "
        f"trainer.devices), or export its weights (python -m topp_rl.export {link} <hf dir>) and start a new run "
        f"from model.path=<hf dir>")

    fsdp = tmp_path / "fsdp"
    (fsdp / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 1}, fsdp / "checkpoints" / "last.ckpt")
    with pytest.raises(ValueError, match=r"is a single-file checkpoint \(another parallel config wrote it\); "
                                         r"parallel=fsdp resumes its own sharded checkpoints only"):
        train(compose_config(fsdp, *TINY, "parallel=fsdp", "ckpt_path=last"))
