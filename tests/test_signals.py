"""SIGTERM and Ctrl-C on distributed runs (real `train.py` subprocesses, Lightning's launcher, gloo): each signal
kind, to rank 0 alone or to the whole process group, stops every rank after the same step, saves one checkpoint
of it and exits 128 + signal with the resume line; the next start resumes at the step after it. A rank whose
peer is hung (SIGSTOP) exits after `checkpoint.stop_timeout_s` with the reason, last.ckpt still naming the last
complete checkpoint. Each layout runs its cases as phases of one run dir, then a final resume to the end. A second
Ctrl-C during the stop's save waits for the save (`BlockedStopSave` holds the save until it came)."""

import os
import signal
import subprocess
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT
from lightning.pytorch.callbacks import Callback
from test_checkpoint import _cmd, _env, _lines, _rank_dump

from topp_rl.run.rundir import read_record
from topp_rl.run.stop import StopOnSignal

WAIT_S = 300  # for a start to finish a step, and for a stopped run to exit: a hang fails here


@dataclass(frozen=True)
class Stop:
    signum: int
    whole_group: bool  # else rank 0 alone (`kill PID`, `timeout`)

    def send(self, proc: subprocess.Popen) -> None:
        if self.whole_group:
            os.killpg(proc.pid, self.signum)  # what Ctrl-C in a terminal, SLURM or a preemption sends
        else:
            os.kill(proc.pid, self.signum)


FOUR_KINDS = [Stop(signal.SIGTERM, False), Stop(signal.SIGTERM, True), Stop(signal.SIGINT, True),
              Stop(signal.SIGINT, False)]
LAYOUTS = {
    "fsdp": (("parallel=fsdp", "trainer.devices=2"), FOUR_KINDS),
    # Megatron starts take longer: the two kinds that differ most (a lone rank's SIGTERM, a group's Ctrl-C).
    "tp2": (("parallel=tp2",), [Stop(signal.SIGTERM, False), Stop(signal.SIGINT, True)]),
}
RANKS = 2


class Phases:
    """One run dir, started again and again (`ckpt_path=last` after the first); every rank's rollout steps are
    dumped, one line per step (test_checkpoint.RolloutDump)."""

    def __init__(self, tmp_path: Path, layout: tuple[str, ...]) -> None:
        self.out, self.dump = tmp_path / "run", tmp_path / "run.jsonl"
        self.last = self.out / "checkpoints" / "last.ckpt"
        self.layout = layout
        self.saved = 0  # the step last.ckpt holds
        self.steps: list[list[int]] = [[] for _ in range(RANKS)]  # each rank's trained steps, as kept

    def start(self, *extra: str, max_steps: int = 10_000) -> subprocess.Popen:
        resume = ("ckpt_path=last",) if self.last.exists() else ()
        self.lines_before = [self._dumped(rank) for rank in range(RANKS)]
        self.stderr = (self.out.parent / f"stderr-{time.monotonic_ns()}.txt").open("w+")
        cmd = _cmd(self.out, self.dump, f"trainer.max_steps={max_steps}", "checkpoint.every_n_steps=0", *self.layout,
                   *resume, *extra)
        # Its own session: a group signal reaches exactly this run's processes.
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=self.stderr,
                                start_new_session=True)

    def wait_for_a_step(self, proc: subprocess.Popen) -> None:
        """Until every rank trained a step of this start (the ranks are all inside the training loop)."""
        deadline = time.monotonic() + WAIT_S
        while any(self._dumped(r) <= self.lines_before[r] for r in range(RANKS)):
            assert proc.poll() is None, self.err()
            assert time.monotonic() < deadline, "no step within the wait: " + self.err()
            time.sleep(0.05)

    def finish(self, proc: subprocess.Popen, *, stop_kept_every_step: bool = True) -> None:
        """Wait for the start to exit, then take its dumped steps up to the step last.ckpt now holds."""
        try:
            proc.wait(timeout=WAIT_S)
        finally:
            _kill_session(proc)
        previous, self.saved = self.saved, read_record(self.last)[1]
        for rank in range(RANKS):
            new = [line["global_step"] for line in _lines(_rank_dump(self.dump, rank))[self.lines_before[rank]:]]
            kept = [s for s in new if s <= self.saved]
            assert kept == list(range(previous + 1, self.saved + 1)), (rank, new, previous, self.saved)
            if stop_kept_every_step:  # stopped right after the saved step: no step trained past it
                assert new == kept, (rank, new, self.saved)
            self.steps[rank] += kept

    def _dumped(self, rank: int) -> int:
        path = _rank_dump(self.dump, rank)
        return len(path.read_text().splitlines()) if path.exists() else 0

    def err(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-4000:]


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL whatever this test's start left (its own session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_signal_kind_stops_all_ranks_after_one_step_then_resumes(tmp_path, name):
    layout, kinds = LAYOUTS[name]
    run = Phases(tmp_path, layout)
    for kind in kinds:
        proc = run.start()
        run.wait_for_a_step(proc)
        kind.send(proc)
        run.finish(proc)
        status, sig = 128 + kind.signum, signal.Signals(kind.signum).name
        assert proc.returncode == status, (kind, run.err())
        assert (f"[topp_rl] stopped by {sig} after step {run.saved}; checkpoint saved to {run.last}; resume with "
                f"hydra.run.dir={run.out} ckpt_path=last (the run's overrides come from its dir; exit status {status})") in run.err()

    # A hung peer: rank 1 stopped (SIGSTOP) and rank 0 told to stop cannot agree with it; after the timeout rank 0
    # exits with the reason, and last.ckpt still names the checkpoint of the last phase.
    proc = run.start("checkpoint.stop_timeout_s=3")
    run.wait_for_a_step(proc)
    (rank1,) = _children(proc.pid)
    os.kill(rank1, signal.SIGSTOP)
    saved_before = run.saved
    os.kill(proc.pid, signal.SIGTERM)
    run.finish(proc, stop_kept_every_step=False)  # the steps after last.ckpt's are trained again on resume
    assert proc.returncode == 143, run.err()
    assert run.saved == saved_before
    assert ("rank 0: SIGTERM came and this rank has not finished stopping within checkpoint.stop_timeout_s=3 s: "
            "another rank is hung, dead or still in a long step. Exiting now (status 143) without a new checkpoint; "
            f"the last complete checkpoint, {run.last} (step {saved_before}), is kept: resume with "
            f"hydra.run.dir={run.out} ckpt_path=last (the run's overrides come from its dir)") in run.err()

    proc = run.start(max_steps=run.saved + 2)
    run.finish(proc)
    assert proc.returncode == 0, run.err()
    for rank_steps in run.steps:  # every step trained once, in order, on every rank
        assert rank_steps == list(range(1, run.saved + 1)) and run.saved >= len(kinds) + 2


class _HeldPickle:
    """Pickled inside the checkpoint's `torch.save`: says so in `marker` (with the step), then waits for `go`."""

    def __init__(self, marker: str, go: str, step: int) -> None:
        self.marker, self.go, self.step = Path(marker), Path(go), step

    def __reduce__(self):
        self.marker.write_text(str(self.step))
        while not self.go.exists():
            time.sleep(0.01)
        return (OrderedDict, ())  # stored as an empty OrderedDict: the checkpoint still loads with weights_only


class BlockedStopSave(Callback):
    """Test callback (loaded by the subprocess through PYTHONPATH=tests): a save made after this rank got a stop
    signal holds in the middle of writing the checkpoint until the test writes `go`."""

    def __init__(self, *, marker: str, go: str) -> None:
        self.marker, self.go = marker, go

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        stopper = next(c for c in trainer.callbacks if isinstance(c, StopOnSignal))
        if stopper.received is not None:
            checkpoint["held"] = _HeldPickle(self.marker, self.go, trainer.global_step)


def _wait(proc: subprocess.Popen, done, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within the wait"
        time.sleep(0.01)


@pytest.mark.subprocess
@pytest.mark.parametrize("layout", [(), pytest.param(("parallel=fsdp", "trainer.devices=2"),
                                                    marks=pytest.mark.distributed)], ids=["one_rank", "fsdp"])
def test_a_second_ctrl_c_during_the_save_finishes_it_and_leaves_no_partial_checkpoint(tmp_path, layout):
    """The second Ctrl-C raised KeyboardInterrupt inside the save: the single-file save was dropped (a run with no
    earlier checkpoint kept none), and a sharded one left its unfinished data dir (and a peer rank waiting)."""
    out, marker, go = tmp_path / "run", tmp_path / "saving", tmp_path / "go"
    checkpoints = out / "checkpoints"
    cmd = _cmd(out, tmp_path / "run.jsonl", "trainer.max_steps=10000", "checkpoint.every_n_steps=2", *layout,
               "+callbacks.held._target_=test_signals.BlockedStopSave", f"+callbacks.held.marker={marker}",
               f"+callbacks.held.go={go}")
    stdout, stderr = (tmp_path / "stdout.txt").open("w+"), (tmp_path / "stderr.txt").open("w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        _wait(proc, lambda: (checkpoints / "last.ckpt").exists(), "a periodic checkpoint")
        os.killpg(proc.pid, signal.SIGINT)
        _wait(proc, marker.exists, "the stop's save")
        os.killpg(proc.pid, signal.SIGINT)  # while the checkpoint is half written
        said = "Ctrl-C again during the stop: finishing the checkpoint save first"
        _wait(proc, lambda: said in (tmp_path / "stdout.txt").read_text(), "the second Ctrl-C's answer")
        go.write_text("go")
        proc.wait(timeout=WAIT_S)
    finally:
        _kill_session(proc)
    stderr.seek(0)
    err = stderr.read()
    step = int(marker.read_text())
    assert proc.returncode == 130, err[-3000:]
    assert f"[topp_rl] stopped by SIGINT after step {step}; checkpoint saved to {checkpoints}/last.ckpt" in err
    assert read_record(checkpoints / "last.ckpt")[1] == step  # the stop's checkpoint, complete
    left = sorted(p.name for p in checkpoints.iterdir())
    if layout:  # one data dir, the one last.ckpt names: no unfinished one beside it
        assert len(left) == 2 and left[1] == "last.ckpt" and left[0].startswith(f"last-step{step}-"), left
        assert os.readlink(checkpoints / "last.ckpt") == left[0]
    else:
        assert left == ["last.ckpt"]  # no temp file


def test_the_stop_watchdog_of_a_one_rank_run_names_the_long_step_not_a_rank(tmp_path, monkeypatch, capsys):
    """No other rank exists to blame: the message names the step's own bounds (the environment's and agent's
    timeouts)."""
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    StopOnSignal(run_dir=tmp_path, timeout_s=3)._give_up(signal.SIGTERM)
    err = capsys.readouterr().err
    assert exits == [143] and "another rank" not in err
    assert ("SIGTERM came and this rank has not finished stopping within checkpoint.stop_timeout_s=3 s: the run is "
            "still in a long step (an environment's or agent's call ends within rollout.step.env_timeout_s / "
            f"agent_timeout_s). Exiting now (status 143) without a new checkpoint; there is no checkpoint to resume "
            f"from ({tmp_path / 'checkpoints' / 'last.ckpt'} does not exist)") in err
