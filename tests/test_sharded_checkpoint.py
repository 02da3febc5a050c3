"""Sharded checkpoints on disk (`topp_rl.run.sharded_checkpoint`, written by `parallel=fsdp`): `last.ckpt` a symlink
switched atomically to a complete data dir, unnamed data dirs removed, the shards read back in one process, and a
resume that mixes a sharded checkpoint with a single-file strategy (or the reverse) refused at start. The FSDP
runs that write and resume these (world 2 -> 2 and 2 -> 4, SIGKILL) are in test_fsdp_train / test_checkpoint.

Faults (one 2-rank FSDP spawn for the runs, `_fault_runs`): a shard truncated, corrupt or missing, a checkpoint
without `.metadata` or `meta.pt` (resume and export), and a save that fails (a full disk: ENOSPC injected into
DCP's file writes on one rank, and a real full tmpfs where this machine may mount one; a `meta.pt` that cannot be
written on rank 0) each give one error naming the file, the cause and the fix; a failed save leaves no data dir
and `last.ckpt` naming the last complete checkpoint."""

import errno
import math
import os
import re
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_distributed
from helpers import TINY, compose_config
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint.filesystem import FileSystem

from topp_rl.run.checkpoint import RECORD_KEY, AtomicCheckpointIO, CheckpointReadError
from topp_rl.run.export import export_checkpoint
from topp_rl.run.rundir import RunDir, read_record
from topp_rl.run.sharded_checkpoint import (
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
        f"from model=hf_path model.path=<hf dir>")

    fsdp = tmp_path / "fsdp"
    (fsdp / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 1}, fsdp / "checkpoints" / "last.ckpt")
    with pytest.raises(ValueError, match=r"is a single-file checkpoint \(another parallel config wrote it\); "
                                         r"parallel=fsdp resumes its own sharded checkpoints only"):
        train(compose_config(fsdp, *TINY, "parallel=fsdp", "ckpt_path=last"))


# ----- faults -----
READ_FIX = ("a save never points last.ckpt at an unfinished checkpoint, so the file was lost or damaged after its "
            "save: restore it from a copy of the run dir, or use another complete checkpoint (ckpt_path=<dir> to "
            "resume, python -m topp_rl.export <dir> <hf dir> to export), or drop ckpt_path to start over in a new "
            "run dir")
PARTS = {".metadata": "DCP's index of the shards, written once every rank's shards are",
         "meta.pt": "the step, loops and run config, written after the shards"}


def damage(file: Path, how: str) -> str:
    """Damage a shard file as a disk fault or a partial copy would; the message part that names it."""
    size = file.stat().st_size
    if how == "truncated":
        file.write_bytes(file.read_bytes()[: size // 2])
        return f"{file} is truncated: {size // 2} bytes, where the index (.metadata) records {size} ("
    if how == "corrupt":  # garbage over the first record's header: its size stays the indexed one
        file.write_bytes(b"\xff" * 64 + file.read_bytes()[64:])
        return f"{file} is corrupt: {size} bytes as the index (.metadata) records, but its data does not load ("
    file.unlink()
    return f"{file} is missing (FileNotFoundError: "


def _tiny_sharded_checkpoint(run_dir: Path) -> Path:
    """A real one-rank sharded checkpoint of the tiny model (its weights as DCP shards, meta.pt with the run's
    config), as `parallel=fsdp` lays it out; the link."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = compose_config(run_dir, *TINY)
    model, _ = instantiate(cfg.model)
    link = run_dir / "checkpoints" / "last.ckpt"
    link.parent.mkdir(parents=True)
    data_dir = data_dir_for(link, 1)
    weights = {f"policy.model.{k}": v.float() for k, v in model.state_dict().items()}
    dcp.save({"state_dict": weights}, checkpoint_id=str(data_dir), no_dist=True)
    AtomicCheckpointIO().save_checkpoint(
        {"global_step": 1, RECORD_KEY: {"config": OmegaConf.to_container(cfg, resolve=True)}}, data_dir / META)
    publish(link, data_dir)
    return link


@pytest.mark.parametrize("how", ["truncated", "corrupt", "missing"])
def test_export_of_a_damaged_shard_names_the_file_the_damage_and_the_fix(tmp_path, how):
    """torch alone: a bare CheckpointException around an EOFError or a zip-reader error, naming no file."""
    link = _tiny_sharded_checkpoint(tmp_path / "run")
    named = damage(link.resolve() / "__0_0.distcp", how)
    with pytest.raises(CheckpointReadError) as info:
        export_checkpoint(link, tmp_path / "hf")
    message = str(info.value)
    assert message.startswith(f"could not read sharded checkpoint {link}: {named}"), message
    assert message.endswith(f"; {READ_FIX}")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("part", list(PARTS))
def test_a_checkpoint_missing_a_part_is_refused_naming_the_file_at_resume_and_export(tmp_path, part):
    """Was: 'no checkpoint at last.ckpt' (no meta.pt), or accepted at start (no .metadata)."""
    link = _tiny_sharded_checkpoint(tmp_path / "run")
    (link.resolve() / part).unlink()
    want = (f"sharded checkpoint {link} is incomplete: {link.resolve() / part} ({PARTS[part]}) is missing; "
            f"{READ_FIX}")
    with pytest.raises(CheckpointReadError) as info:
        RunDir(compose_config(tmp_path / "run", *TINY, "parallel=fsdp", "ckpt_path=last"))
    assert str(info.value) == want
    with pytest.raises(CheckpointReadError) as info:
        export_checkpoint(link, tmp_path / "hf")
    assert str(info.value) == want


class FullDisk(Callback):
    """The injected fault: from the save at `step` on, DCP's file writes on `rank` fail as on a full disk (a write
    past `room` bytes writes what fits, then raises ENOSPC). Active inside `with` (it swaps DCP's
    `FileSystem.create_stream`). The default room lies past the small optimizer values a shard file starts with,
    inside a tensor, where torch's writer turns the error into 'unexpected pos 704 vs 598'."""

    def __init__(self, *, rank: int, step: int, room: int = 1 << 16) -> None:
        self.rank, self.step, self.room, self.armed = rank, step, room, False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.armed = trainer.global_rank == self.rank and trainer.global_step >= self.step

    def __enter__(self) -> "FullDisk":
        real, fault = FileSystem.create_stream, self

        @contextmanager
        def create_stream(fs, path, mode):
            with real(fs, path, mode) as stream:
                yield _FillingStream(stream, fault.room) if fault.armed and "w" in mode else stream

        self.real, FileSystem.create_stream = real, create_stream
        return self

    def __exit__(self, *exc) -> None:
        FileSystem.create_stream = self.real


class _FillingStream:
    def __init__(self, raw, room: int) -> None:
        self.raw, self.room = raw, room

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self.room:
            self.raw.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.raw.write(data)

    def __getattr__(self, name):
        return getattr(self.raw, name)


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("boom mid-write")


class UnpicklableMeta(Callback):
    """From the save at `step` on, the checkpoint holds an object torch.save cannot write: rank 0's `meta.pt`
    write fails (the shards, all tensors, are written)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_step >= self.step:
            checkpoint["unpicklable"] = _Unpicklable()


FSDP_RUN = ("parallel=fsdp", "trainer.devices=2", "logger=none", "checkpoint.every_n_steps=1")


def _fit(run_dir: Path, *, callbacks=(), ckpt_path: Path | None = None) -> None:
    from topp_rl.train import build_run

    run = build_run(compose_config(run_dir, *TINY, *FSDP_RUN))
    run.trainer.callbacks[:0] = list(callbacks)
    try:
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt_path)
    finally:
        run.datamodule.close_engine()


def _outcome(run) -> tuple[str, str] | None:
    """(error type, message) of a run that failed, None for one that finished."""
    try:
        run()
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        return type(err).__name__, str(err)
    return None


def _failed_save(run_dir: Path, *callbacks) -> dict:
    """A 2-step run saving after every step, whose callbacks fail the step-2 save: the error, and what it left."""
    error = _outcome(lambda: _fit(run_dir, callbacks=callbacks))
    dist.barrier()  # rank 0's clean-up is done
    link = run_dir / "checkpoints" / "last.ckpt"
    return {"error": error, "files": sorted(p.name for p in link.parent.iterdir()), "link": os.readlink(link),
            "step": read_record(link)[1]}


def _mount_tmpfs(path: Path, size: int) -> str | None:
    """Mount a tmpfs of `size` bytes at `path`: None, or why not (it needs CAP_SYS_ADMIN, i.e. root)."""
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)
    except OSError as err:
        return f"mount: {err}"
    return None if done.returncode == 0 else f"mount exited {done.returncode}: {done.stderr.strip()}"


def _full_tmpfs_save(run_dir: Path, checkpoint_bytes: int) -> dict:
    """`_failed_save` with `checkpoints/` on a real tmpfs room for 1.5 checkpoints: the step-2 save fills it."""
    checkpoints = run_dir / "checkpoints"
    size = 4096 * math.ceil(1.5 * checkpoint_bytes / 4096)
    if dist.get_rank() == 0:
        checkpoints.mkdir(parents=True)
    box = [_mount_tmpfs(checkpoints, size) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    if box[0] is not None:
        return {"skipped": box[0]}
    try:
        return _failed_save(run_dir)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            subprocess.run(["umount", str(checkpoints)], check=True, timeout=60)


def _resume_damaged(tmp: Path, source: Path, how: str) -> dict:
    """Resume a copy of the step-1 checkpoint `source` (a checkpoints dir) whose rank-1 shard is damaged."""
    copy = tmp / f"resume_{how}" / "checkpoints"
    box = [None]
    if dist.get_rank() == 0:
        shutil.copytree(source, copy, symlinks=True)
        box = [damage(copy / os.readlink(copy / "last.ckpt") / "__1_0.distcp", how)]
    dist.broadcast_object_list(box)
    return {"named": box[0], "error": _outcome(lambda: _fit(copy.parent, ckpt_path=copy / "last.ckpt"))}


def _dir_bytes(path: Path) -> int:
    return sum(4096 * math.ceil(p.stat().st_size / 4096) for p in path.iterdir())


def _fault_worker(rank: int, tmp: str, cases: list[str]) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group is up: Lightning only reads ranks
    tmp = Path(tmp)
    out = {}
    with FullDisk(rank=1, step=2) as fault:  # every case below starts from this run's step-1 checkpoint
        out["injected"] = _failed_save(tmp / "injected", fault)
    step1 = tmp / "injected" / "checkpoints"
    for how in ("truncated", "corrupt", "missing"):
        if how in cases:
            out[how] = _resume_damaged(tmp, step1, how)
    if "tmpfs" in cases:
        out["tmpfs"] = _full_tmpfs_save(tmp / "tmpfs", _dir_bytes(step1 / out["injected"]["link"]))
    if "meta" in cases:  # last: before the fix, rank 1 waits in a barrier for a rank 0 that failed
        out["meta"] = _failed_save(tmp / "meta", UnpicklableMeta(step=2))
    return out


FAULT_CASES = ["truncated", "corrupt", "missing", "tmpfs", "meta"]


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory) -> list[dict]:
    """Every fault case of 2-rank FSDP runs in one spawn (spawns are the slow part); each rank's outcomes."""
    tmp = tmp_path_factory.mktemp("faults")
    return run_distributed(_fault_worker, 2, str(tmp), FAULT_CASES, timeout=600,
                           preload=("topp_rl.train", "topp_rl.fsdp", "hydra"))


WRITE_FIX = ("; free space there (or point hydra.run.dir at a larger disk) and resume with ckpt_path=last; {link} "
             "still names the last complete checkpoint, if any, and the unfinished {name} is removed")


def _assert_failed_save_left_the_step1_checkpoint(result: dict, file: str, cause: str) -> None:
    """The error names the step-2 data dir's `file` (a regex) and the cause; only the step-1 checkpoint is left."""
    kind, message = result["error"]
    assert kind == "CheckpointWriteError", message
    link = re.search(r"^could not write sharded checkpoint (\S+)/(last-step2-[0-9a-f]+\.dcp): ", message)
    assert link, message
    checkpoints, name = Path(link[1]), link[2]
    assert re.match(rf"could not write sharded checkpoint {checkpoints / name}: {checkpoints / name}/{file}: "
                    rf"{cause}.*; \d+\.\d MiB free in {checkpoints}", message), message
    assert message.endswith(WRITE_FIX.format(link=checkpoints / "last.ckpt", name=name)), message
    assert result["link"].startswith("last-step1-") and result["step"] == 1
    assert result["files"] == sorted(["last.ckpt", result["link"]])  # no partial step-2 dir


ENOSPC = re.escape("the disk is full (ENOSPC: No space left on device")
FREE_SPACE = re.compile(r"\d+\.\d MiB free in ")


def assert_same_error_but_free_space(a: tuple[str, str], b: tuple[str, str]) -> None:
    """Two ranks' (kind, message) alike but for the free space, which each rank reads at its own moment of a
    disk that other processes write to."""
    assert a[0] == b[0] and FREE_SPACE.sub("<free> MiB free in ", a[1]) == FREE_SPACE.sub("<free> MiB free in ", b[1])


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_save_on_a_full_disk_names_the_shard_and_enospc_and_keeps_the_last_checkpoint(fault_runs):
    """Injected into DCP's writes on rank 1 (runs everywhere); torch alone: a CheckpointException around 'unexpected
    pos 704 vs 598', the partial data dir left behind. Both ranks raise the same error."""
    for result in fault_runs:
        _assert_failed_save_left_the_step1_checkpoint(
            result["injected"], re.escape("__1_0.distcp"), ENOSPC + re.escape("; reported as RuntimeError: ")
            + r".*unexpected pos \d+ vs \d+\)")
    assert_same_error_but_free_space(fault_runs[0]["injected"]["error"], fault_runs[1]["injected"]["error"])


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_save_filling_a_real_tmpfs_names_the_file_and_enospc_and_keeps_the_last_checkpoint(fault_runs):
    """The same on a real full disk: `checkpoints/` on a tmpfs with room for 1.5 checkpoints."""
    if "skipped" in fault_runs[0]["tmpfs"]:
        pytest.skip(f"no tmpfs to fill ({fault_runs[0]['tmpfs']['skipped']}); mounting one needs CAP_SYS_ADMIN "
                    "(root); the injected full disk (the test above) takes the same path")
    for result in fault_runs:  # whichever rank's file filled the disk first
        _assert_failed_save_left_the_step1_checkpoint(result["tmpfs"], r"(__[01]_0\.distcp|meta\.pt)", ENOSPC)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_failed_meta_write_on_rank_0_fails_every_rank_and_keeps_the_last_checkpoint(fault_runs):
    """Was: rank 0 raised while rank 1 waited in a barrier for it, and the step-2 shards stayed behind."""
    for result in fault_runs:
        _assert_failed_save_left_the_step1_checkpoint(result["meta"], re.escape("meta.pt"),
                                                      re.escape("RuntimeError: boom mid-write"))
    assert_same_error_but_free_space(fault_runs[0]["meta"]["error"], fault_runs[1]["meta"]["error"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "corrupt", "missing"])
def test_fsdp_resume_of_a_damaged_shard_names_the_file_the_damage_and_the_fix(fault_runs, how):
    """Rank 1's shard is damaged; both ranks name it (torch alone: a bare CheckpointException naming no file)."""
    named = fault_runs[0][how]["named"]
    for result in fault_runs:
        kind, message = result[how]["error"]
        assert kind == "CheckpointReadError", message
        assert re.match(rf"could not read sharded checkpoint \S+/last\.ckpt: {re.escape(named)}", message), message
        assert message.endswith(f"; {READ_FIX}")
