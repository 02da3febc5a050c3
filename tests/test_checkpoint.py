"""Checkpointing: atomic writes, file modes and named read/write errors (unit); a run killed with SIGKILL, or
stopped with SIGTERM, resumes at the same step with the same next rollouts as an uninterrupted run, and Ctrl-C
saves too (subprocesses running the real `train.py`)."""

import csv
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, train_env
from lightning.pytorch.callbacks import Callback

from topp_rl.run.checkpoint import (
    AtomicCheckpointIO,
    CheckpointReadError,
    CheckpointWriteError,
    temp_writer_pid,
)
from topp_rl.run.rundir import read_record


def test_atomic_save_replaces_whole_file_and_leaves_no_temp(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "ck" / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.arange(4)}, path)
    io.save_checkpoint({"step": 2, "w": torch.arange(8)}, path)
    assert torch.load(path)["step"] == 2
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom mid-write")

    with pytest.raises(RuntimeError, match="boom"):
        io.save_checkpoint({"step": 2, "bad": Unpicklable()}, path)
    assert torch.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    with pytest.raises(ValueError, match="storage_options"):
        io.save_checkpoint({"step": 3}, path, storage_options={"x": 1})


def test_checkpoint_gets_the_umask_mode_and_a_temp_name_with_the_writer_pid(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    seen = []
    real_replace = os.replace

    def spy(src, dst):  # the temp file's name, just before it becomes the checkpoint
        seen.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    old = os.umask(0o022)
    try:
        io.save_checkpoint({"step": 1}, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o644  # mkstemp gave 0o600: unreadable for the group
        os.umask(0o077)
        io.save_checkpoint({"step": 2}, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the umask decides, nothing else
    finally:
        os.umask(old)
    assert len(seen) == 2 and seen[0] != seen[1]
    assert all(n.startswith(".last.ckpt.") and temp_writer_pid(n) == os.getpid() for n in seen), seen


def test_full_disk_error_names_the_file_and_the_free_space(tmp_path):
    """A real write failure through torch's writer (a 1 MiB file-size limit; torch's own message is
    'unexpected pos 704 vs 598'); the previous checkpoint and no temp file are left."""
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the test process
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(CheckpointWriteError) as info:
            io.save_checkpoint({"step": 2, "w": torch.zeros(1 << 20)}, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    message = str(info.value)
    assert message.startswith(f"could not write checkpoint {path}: ")
    assert f"MiB free in {tmp_path}" in message and "the previous last.ckpt, if any, is kept" in message
    assert torch.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_unreadable_checkpoint_error_names_the_file_its_size_and_the_fix(tmp_path):
    io = AtomicCheckpointIO()
    empty, cut = tmp_path / "empty.ckpt", tmp_path / "cut.ckpt"
    empty.touch()  # torch alone: a bare "EOFError: Ran out of input"
    io.save_checkpoint({"w": torch.arange(1000)}, cut)
    cut.write_bytes(cut.read_bytes()[:500])  # truncated mid-file
    for path, size in ((empty, 0), (cut, 500)):
        with pytest.raises(CheckpointReadError, match=f"could not read checkpoint {path} \\({size} bytes\\)") as info:
            io.load_checkpoint(path)
        assert "delete it and resume from another one (ckpt_path=<file>)" in str(info.value)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")


class RolloutDump(Callback):
    """Test callback (loaded by the subprocess through PYTHONPATH=tests): one JSON line per rollout step, rank r > 0
    (parallel=fsdp) to its own file (`_rank_dump`)."""

    def __init__(self, *, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rollout = outputs["rollout"]
        line = {"global_step": trainer.global_step, "step": rollout.step,
                "responses": [s.response_ids for s in rollout.samples]}
        with _rank_dump(self.path, trainer.global_rank).open("a") as f:
            f.write(json.dumps(line) + "\n")


RUN = ["trainer.max_steps=6", "rollout.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=4",
       "rollout.top_p=0.9", "trainer.enable_progress_bar=false", "num_threads=1"]


def _cmd(out: Path, dump: Path, *extra: str, logger: str = "none") -> list[str]:
    return [sys.executable, "train.py", f"hydra.run.dir={out}", *RUN, f"logger={logger}",
            "+callbacks.dump._target_=test_checkpoint.RolloutDump", f"+callbacks.dump.path={dump}", *extra]


def _env() -> dict[str, str]:
    return train_env(PYTHONPATH=str(ROOT / "tests"))  # the run loads this module's RolloutDump


def _rank_dump(dump: Path, rank: int) -> Path:
    return dump if rank == 0 else dump.with_name(f"{dump.name}.rank{rank}")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


FSDP = ("parallel=fsdp", "trainer.devices=2")


def _reference(tmp: Path, *extra: str, ranks: int = 1) -> list[list[dict]]:
    """Each rank's rollouts of an uninterrupted 6-step run."""
    ref = subprocess.run(_cmd(tmp / "ref", tmp / "ref.jsonl", "checkpoint.every_n_steps=0", *extra), cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    per_rank = [_lines(_rank_dump(tmp / "ref.jsonl", rank)) for rank in range(ranks)]
    for lines in per_rank:
        assert [r["global_step"] for r in lines] == list(range(1, 7))
    return per_rank


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The rollouts of an uninterrupted 6-step run, which every interrupted-and-resumed run must reproduce."""
    return _reference(tmp_path_factory.mktemp("reference"))[0]


def _assert_same_rollouts(after: list[dict], reference: list[dict], first_step: int, last_step: int = 6) -> None:
    assert [r["global_step"] for r in after] == list(range(first_step, last_step + 1))
    # Same data position, RNG and weights: the resumed run draws exactly the rollouts of the uninterrupted one.
    for got in after:
        want = reference[got["global_step"] - 1]
        assert got["step"] == want["step"]
        assert got["responses"] == want["responses"], got["global_step"]


def _start_and_signal(out: Path, dump: Path, signum: int, *extra: str, steps: int = 40, logger: str = "none",
                      meanwhile=lambda: None) -> tuple[subprocess.Popen, str]:
    """Start a long run, call `meanwhile` and send `signum` once its first step is done; (process, stderr)."""
    proc = subprocess.Popen(_cmd(out, dump, f"trainer.max_steps={steps}", *extra, logger=logger), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (dump.exists() and dump.read_text()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        meanwhile()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc, stderr


def _sigkill_then_resume(tmp_path: Path, references: list[list[dict]], *extra: str) -> None:
    """`references`: each rank's uninterrupted rollouts; every rank's resumed rollouts must equal its own."""
    dump = tmp_path / "run.jsonl"
    out = tmp_path / "run"
    last = out / "checkpoints" / "last.ckpt"
    # Its own session: SIGKILL goes to the whole group, so Lightning's rank-1 child (parallel=fsdp) dies with rank 0
    # as on a preempted node, instead of being left waiting in a collective.
    proc = subprocess.Popen(_cmd(out, dump, "checkpoint.every_n_steps=2", *extra), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed; make it longer"
    saved_step = read_record(last)[1]  # a file, or (parallel=fsdp) a link to a sharded checkpoint's dir
    assert saved_step in (2, 4)
    # The killed run may finish a step past its last checkpoint before SIGKILL lands: only lines written by the
    # resumed run count below.
    dumps = [_rank_dump(dump, rank) for rank in range(len(references))]
    killed_lines = [len(_lines(d)) if d.exists() else 0 for d in dumps]

    resumed = subprocess.run(_cmd(out, dump, "checkpoint.every_n_steps=2", "ckpt_path=last", *extra), cwd=ROOT,
                             env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for d, killed, reference in zip(dumps, killed_lines, references, strict=True):
        _assert_same_rollouts(_lines(d)[killed:], reference, saved_step + 1)


@pytest.mark.subprocess
@pytest.mark.slow
def test_sigkill_then_resume_continues_at_the_same_step_with_the_same_rollouts(tmp_path, reference):
    _sigkill_then_resume(tmp_path, [reference])


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_sigkill_then_resume_continues_at_the_same_step_with_the_same_rollouts(tmp_path):
    """The same under FSDP on 2 ranks (both ranks killed): last.ckpt links the sharded checkpoint (each rank's
    shards of the weights and AdamW state), which gives each rank the uninterrupted FSDP run's rollouts (its own
    share of each step); the resumed run leaves one data dir, the one last.ckpt names, at its last step."""
    _sigkill_then_resume(tmp_path, _reference(tmp_path / "ref", *FSDP, ranks=2), *FSDP)
    checkpoints = tmp_path / "run" / "checkpoints"
    last = checkpoints / "last.ckpt"
    assert last.is_symlink() and read_record(last)[1] == 6
    assert [p.name for p in checkpoints.glob("*.dcp")] == [os.readlink(last)]
    assert os.readlink(last).startswith("last-step6-")


@pytest.mark.subprocess
@pytest.mark.slow
def test_sigterm_saves_exits_143_and_resumes_with_the_same_rollouts(tmp_path, reference):
    """Lightning alone exits 0 on SIGTERM without saving: preemption looked like success."""
    out, dump = tmp_path / "run", tmp_path / "run.jsonl"
    last = out / "checkpoints" / "last.ckpt"
    # No periodic checkpoints: the only checkpoint is the one the signal saves.
    proc, stderr = _start_and_signal(out, dump, signal.SIGTERM, "checkpoint.every_n_steps=0")
    assert proc.returncode == 143, stderr[-3000:]
    done = len(_lines(dump))  # the step under way when the signal came is finished, then saved
    assert 1 <= done < 6, "the signal came too late for the resume below to train anything"
    assert f"[topp_rl] stopped by SIGTERM after step {done}; checkpoint saved to {last}" in stderr
    assert f"hydra.run.dir={out} ckpt_path=last (the run's overrides come from its dir; exit status 143)" in stderr
    assert torch.load(last, weights_only=True, mmap=True)["global_step"] == done

    resumed = subprocess.run(_cmd(out, dump, "checkpoint.every_n_steps=0", "ckpt_path=last"), cwd=ROOT,
                             env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_rollouts(_lines(dump)[done:], reference, done + 1)


AHEAD = ("rollout.max_staleness=2", "rollout.engine.share_weights=false", "algo.loss.tis_cap=2.0")


def _held_responses(last: Path) -> dict[int, list[list[int]]]:
    """The responses of every generation in flight a checkpoint holds, by rollout step."""
    from topp_rl.rollout.broadcast import samples_from_state

    state = torch.load(last, weights_only=True)["RolloutDataModule"]
    return {step: [s.response_ids for s in samples_from_state(entry["samples"])]
            for step, entry in state["in_flight"][0]["steps"].items()}


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_two_updates_ahead_a_stopped_run_resumes_training_no_step_twice_and_losing_none(tmp_path, signum):
    """Two updates ahead, the checkpoint holds the generations of the next two steps; after SIGKILL (resumed from
    the last periodic checkpoint) or SIGTERM (which saves), the resumed run trains those samples first, then the
    rest: every rollout step of the 6 once over the two runs' checkpointed and resumed steps."""
    out, dump = tmp_path / "run", tmp_path / "run.jsonl"
    last = out / "checkpoints" / "last.ckpt"
    if signum == signal.SIGKILL:
        proc = subprocess.Popen(_cmd(out, dump, "checkpoint.every_n_steps=2", "trainer.max_steps=40", *AHEAD),
                                cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        deadline = time.monotonic() + 240
        while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    else:
        proc, stderr = _start_and_signal(out, dump, signal.SIGTERM, "checkpoint.every_n_steps=0", *AHEAD)
        assert proc.returncode == 143, stderr[-3000:]
    saved = read_record(last)[1]
    held = _held_responses(last)
    assert sorted(held) == [saved, saved + 1]  # the next two steps, generated while the saved step trained
    before = [line["step"] for line in _lines(dump)][:saved]
    killed = len(_lines(dump))
    resumed = subprocess.run(_cmd(out, dump, "checkpoint.every_n_steps=0", "ckpt_path=last", "trainer.max_steps=6",
                                  *AHEAD), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _lines(dump)[killed:]
    assert before + [line["step"] for line in after] == list(range(6))
    for line in after[:2]:  # the checkpoint's generations, not new ones
        assert line["responses"] == held[line["step"]], line["step"]


@pytest.mark.subprocess
@pytest.mark.slow
def test_ctrl_c_saves_and_exits_130_and_a_second_run_in_its_dir_is_refused(tmp_path):
    out, dump = tmp_path / "run", tmp_path / "run.jsonl"
    last = out / "checkpoints" / "last.ckpt"
    second = {}

    def start_a_second_run_in_the_same_dir():  # while the first one trains (and holds the run dir's lock)
        second["proc"] = subprocess.run(_cmd(out, tmp_path / "other.jsonl"), cwd=ROOT, env=_env(),
                                        capture_output=True, text=True, timeout=300)

    proc, stderr = _start_and_signal(out, dump, signal.SIGINT, "checkpoint.every_n_steps=0", steps=1000,
                                     meanwhile=start_a_second_run_in_the_same_dir)
    assert proc.returncode == 130, stderr[-3000:]
    done = len(_lines(dump))
    assert 1 <= done < 1000
    assert f"[topp_rl] stopped by SIGINT after step {done}; checkpoint saved to {last}" in stderr
    assert torch.load(last, weights_only=True, mmap=True)["global_step"] == done
    other = second["proc"]
    assert other.returncode == 2
    assert (f"error: run dir {out} is in use by another run (pid {proc.pid}, holding {out}/.lock); wait for "
            "that run to end") in other.stderr
    assert not (tmp_path / "other.jsonl").exists()  # it trained nothing


OVERLAP = ("rollout.overlap=true", "rollout.engine.share_weights=false", "algo.loss.tis_cap=2.0")


def _csv_steps(out: Path) -> list[int]:
    """The `step` of every training row of every CSV a run dir's starts wrote (one csv/version_N per start)."""
    steps = []
    for path in sorted(out.glob("csv/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with path.open() as f:
            steps += [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    return steps


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), OVERLAP], ids=["on_policy", "overlap"])
def test_interrupted_before_the_first_checkpoint_then_resumed_twice_continues_from_the_newest_state(tmp_path, extra):
    """The sequence that once went back in time: Ctrl-C before the first periodic checkpoint (last.ckpt written
    by the signal), a resume that runs to its end (periodic and final saves: Lightning's ModelCheckpoint wrote them
    to last-v1.ckpt, leaving last.ckpt at the interrupted step), and a second resume that extends the run."""
    out, dump = tmp_path / "run", tmp_path / "run.jsonl"
    last = out / "checkpoints" / "last.ckpt"
    logged = ("checkpoint.every_n_steps=4", *extra)
    ref = subprocess.run(_cmd(tmp_path / "ref", tmp_path / "ref.jsonl", "trainer.max_steps=10", *logged, logger="csv"),
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = _lines(tmp_path / "ref.jsonl")

    proc, stderr = _start_and_signal(out, dump, signal.SIGINT, *logged, logger="csv")
    assert proc.returncode == 130, stderr[-3000:]
    done = len(_lines(dump))
    assert 1 <= done < 4, "the signal must come before the first periodic checkpoint (step 4)"
    steps = {}
    for max_steps in (8, 10):
        resumed = subprocess.run(_cmd(out, dump, f"trainer.max_steps={max_steps}", *logged, "ckpt_path=last",
                                      logger="csv"), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        steps[max_steps] = torch.load(last, weights_only=True, mmap=True)["global_step"]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["checkpoint"] == str(last) and summary["checkpoint_step"] == max_steps
        assert summary["resumed_from"] == str(last)
        assert f"checkpoint: {last} (step {max_steps})" in resumed.stdout
    assert steps == {8: 8, 10: 10}
    assert summary["resumed_step"] == 8
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # never a last-v1.ckpt
    _assert_same_rollouts(_lines(dump), reference[:10], 1, last_step=10)
    assert _csv_steps(out) == list(range(10))  # each step logged once, in order, over the three starts
