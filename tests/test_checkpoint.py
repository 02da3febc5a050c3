"""Checkpointing: atomic writes (unit), and a run killed with SIGKILL resumes at the same step with the same next
rollout as an uninterrupted run (subprocesses running the real `train.py`)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from topp_rl.checkpoint import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[1]


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


class RolloutDump(Callback):
    """Test callback (loaded by the subprocess through PYTHONPATH=tests): one JSON line per rollout step."""

    def __init__(self, *, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rollout = outputs["rollout"]
        line = {"global_step": trainer.global_step, "step": rollout.step,
                "responses": [s.response_ids for s in rollout.samples]}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


RUN = ["trainer.max_steps=6", "rollout.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=4",
       "rollout.top_p=0.9", "logger=none", "trainer.enable_progress_bar=false", "num_threads=1"]


def _cmd(out: Path, dump: Path, *extra: str) -> list[str]:
    return [sys.executable, "train.py", f"hydra.run.dir={out}", *RUN,
            "+callbacks.dump._target_=test_checkpoint.RolloutDump", f"+callbacks.dump.path={dump}", *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT / "tests"), WANDB_MODE="offline", HF_HUB_OFFLINE="1")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_then_resume_continues_at_the_same_step_with_the_same_rollouts(tmp_path):
    ref_dump, dump = tmp_path / "ref.jsonl", tmp_path / "run.jsonl"
    ref = subprocess.run(_cmd(tmp_path / "ref", ref_dump, "checkpoint.every_n_steps=0"), cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = _lines(ref_dump)
    assert [r["global_step"] for r in reference] == list(range(1, 7))

    out = tmp_path / "run"
    last = out / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen(_cmd(out, dump, "checkpoint.every_n_steps=2"), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed; make it longer"
    saved_step = torch.load(last, weights_only=False)["global_step"]
    assert saved_step in (2, 4)
    # The killed run may finish a step past its last checkpoint before SIGKILL lands: only lines written by the
    # resumed run count below.
    killed_lines = len(_lines(dump)) if dump.exists() else 0

    resumed = subprocess.run(_cmd(out, dump, "checkpoint.every_n_steps=2", "ckpt_path=last"), cwd=ROOT,
                             env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _lines(dump)[killed_lines:]
    assert [r["global_step"] for r in after] == list(range(saved_step + 1, 7))
    # Same data position, RNG and weights: the resumed run draws exactly the rollouts of the uninterrupted one.
    for got in after:
        want = reference[got["global_step"] - 1]
        assert got["step"] == want["step"]
        assert got["responses"] == want["responses"], got["global_step"]
