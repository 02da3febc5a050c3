"""`task=lookup` trains end to end through the agent loop with the embedded engine, and stays exact: on the
on-policy pass, over trained tokens, |log pi_train - log pi_rollout| is float32 noise with the candidate mask at
rollout.top_p=0.9 (the unmasked figure shows the bias), and every rank logs the agent loop's figures."""

import math

from helpers import column, compose_cfg, read_metrics

from topp_rl.tasks.environment import FAULT_KINDS
from topp_rl.train import train

AGENT_KEYS = ("rollout/turns_mean", "rollout/env_tokens_frac", "rollout/samples_per_trajectory_mean",
              "rollout/prefix_breaks", "rollout/env_errors", "rollout/env_timeouts", "rollout/trajectories_failed",
              "rollout/max_turns_ended", "rollout/max_tokens_ended", "rollout/context_ended",
              *(f"rollout/env_errors/{kind}" for kind in FAULT_KINDS))


def test_lookup_trains_exactly_through_the_agent_loop(tmp_path):
    # Three characters per turn: the call and the answer are each turn's first one, the rest trains too.
    cfg = compose_cfg(tmp_path, "task=lookup", "logger=csv", "rollout.top_p=0.9", "rollout.max_new_tokens=3",
                      "rollout.prompts_per_step=4", "rollout.n_samples=4", "trainer.max_steps=3",
                      "eval.every_n_steps=3", "eval.num_prompts=4", "eval.k=2")  # evaluated through the loop too
    summary = train(cfg)
    assert summary["steps"] == 3
    rows = read_metrics(tmp_path)
    masked, worst = column(rows, "train/rollout_logprob_abs_diff"), column(rows, "train/rollout_logprob_abs_diff_max")
    unmasked = column(rows, "train/rollout_logprob_abs_diff_unmasked")
    assert len(masked) == len(worst) == len(unmasked) == 3
    assert max(masked) <= 1e-5 and max(worst) <= 1e-4
    assert min(unmasked) > 1e-2  # the bias the mask removes, far above
    for key in AGENT_KEYS:
        values = column(rows, key)
        assert len(values) == 3 and all(math.isfinite(v) for v in values), key
    assert all(1.0 <= t <= 2.0 for t in column(rows, "rollout/turns_mean"))
    assert max(column(rows, "rollout/env_tokens_frac")) > 0  # environment tokens were in the packed batches
    assert column(rows, "rollout/samples_per_trajectory_mean") == [1.0] * 3
    assert column(rows, "rollout/trajectories_failed") == [0.0] * 3
    assert column(rows, "rollout/prefix_breaks") == [0.0] * 3
    assert all(0 <= r <= 1 for r in column(rows, "rollout/reward_mean"))
    # Held-out evaluation ran through the same agent loop (figures checked in test_agent_eval.py) at 0 and 3.
    assert [int(float(r["step"])) for r in rows if r.get("val/accuracy")] == [0, 3]
    assert column(rows, "val/accuracy")[0] == 1.0  # the random tiny model's greedy decode solves lookup
    assert all(p >= m for p, m in zip(column(rows, "val/pass@k"), column(rows, "val/mean@k"), strict=True))
    assert all(v >= 3 for v in column(rows, "val/response_length_mean"))  # call, "=v", answer
