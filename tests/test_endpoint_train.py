"""`python train.py task=agent task.agent=...` trains the shipped openai-SDK agent (two chat turns) from the default
setup, through the endpoint, the embedded engine and the tiny model, and stays exact: on the on-policy pass,
over trained tokens, |log pi_train - log pi_rollout| is float32 noise with the candidate mask at
rollout.top_p=0.9 (the unmasked figure shows the bias). Its replies sometimes hold an id their text drops (a
special id), so some second turns start a second sample: those train too."""

import subprocess
import sys

import pytest
from helpers import ROOT, column, read_metrics, train_env

from topp_rl.tasks.environment import FAULT_KINDS

AGENT = "topp_rl.tasks.agents.lookup:lookup_agent"
AGENT_KEYS = ("rollout/turns_mean", "rollout/env_tokens_frac", "rollout/samples_per_trajectory_mean",
              "rollout/prefix_breaks", "rollout/env_errors", "rollout/env_timeouts", "rollout/trajectories_failed",
              "rollout/max_turns_ended", "rollout/max_tokens_ended", "rollout/context_ended",
              *(f"rollout/env_errors/{kind}" for kind in FAULT_KINDS))


@pytest.mark.subprocess
def test_train_py_task_agent_runs_the_example_agent_exactly(tmp_path):
    cmd = [sys.executable, "train.py", "task=agent", f"task.agent={AGENT}", "logger=csv", "trainer.max_steps=4",
           "rollout.prompts_per_step=8", "rollout.n_samples=4", "checkpoint.every_n_steps=0",
           "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}", "num_threads=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    masked, worst = column(rows, "train/rollout_logprob_abs_diff"), column(rows, "train/rollout_logprob_abs_diff_max")
    unmasked = column(rows, "train/rollout_logprob_abs_diff_unmasked")
    assert len(masked) == len(worst) == len(unmasked) == 4
    assert max(masked) <= 1e-5 and max(worst) <= 1e-4
    assert min(unmasked) > 1e-2  # the bias the mask removes, far above
    for key in AGENT_KEYS:  # every multi-turn figure, every step
        assert len(column(rows, key)) == 4, key
    assert column(rows, "rollout/turns_mean") == [2.0] * 4  # the example always takes two turns
    assert min(column(rows, "rollout/env_tokens_frac")) > 0
    assert column(rows, "rollout/trajectories_failed") == [0.0] * 4
    breaks, per_traj = column(rows, "rollout/prefix_breaks"), column(rows, "rollout/samples_per_trajectory_mean")
    assert sum(breaks) > 0 and all(b == pytest.approx(32 * (s - 1)) for b, s in zip(breaks, per_traj, strict=True))
