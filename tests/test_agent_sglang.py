"""The agent loop (`task=lookup`, turns of 4 tokens around the environment's "=v") with the real SGLang server
(float32, on CPU): each turn is a /generate of the running ids, whose earlier turns SGLang serves from its prefix
cache; the trainer recomputes the whole trajectory. Over trained tokens the masked on-policy |train - rollout|
log-prob stays <= 1e-5 mean and <= 1e-4 max at rollout.top_p=0.9, the unmasked figure far above, and no turn was
a prefix break (the server answered every turn conditioned on exactly the ids sent)."""

import pytest
from helpers import column, compose_cfg, read_metrics
from sglang_checks import require_sglang

from topp_rl.train import train

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
require_sglang(module=True)


def test_lookup_through_sglang_stays_exact(tmp_path, tiny_sglang_url):
    train(compose_cfg(tmp_path, "task=lookup", "rollout=sglang", f"rollout.engine.urls=['{tiny_sglang_url}']",
                      "logger=csv", "rollout.top_p=0.9", "rollout.max_new_tokens=4", "rollout.prompts_per_step=4",
                      "rollout.n_samples=4", "trainer.max_steps=3"))
    rows = read_metrics(tmp_path)
    masked, worst = column(rows, "train/rollout_logprob_abs_diff"), column(rows, "train/rollout_logprob_abs_diff_max")
    unmasked = column(rows, "train/rollout_logprob_abs_diff_unmasked")
    print("sglang masked mean", max(masked), "max", max(worst), "unmasked", min(unmasked))
    assert len(masked) == len(worst) == 3
    assert max(masked) <= 1e-5 and max(worst) <= 1e-4
    assert min(unmasked) > 1e-2
    # Some trajectories reached a second turn (after the environment's tokens), served from the prefix cache.
    assert max(column(rows, "rollout/env_tokens_frac")) > 0 and max(column(rows, "rollout/turns_mean")) > 1
    assert column(rows, "rollout/prefix_breaks") == [0.0] * 3
    assert column(rows, "rollout/trajectories_failed") == [0.0] * 3


def test_the_endpoint_through_sglang_two_updates_ahead_with_partial_rollouts(tmp_path, tiny_sglang_url):
    """Agent code against the OpenAI-compatible endpoint, served by SGLang, generating two weight updates ahead of
    training, weight updates landing in the requests in flight (retract): every step within the bound, the tokens
    the trained weights sampled on-policy to float32 rounding."""
    train(compose_cfg(tmp_path, "task=agent", "task.agent=topp_rl.tasks.agents.lookup:lookup_agent", "rollout=sglang",
                      f"rollout.engine.urls=['{tiny_sglang_url}']", "logger=csv", "rollout.top_p=0.9",
                      "rollout.prompts_per_step=4", "rollout.n_samples=4", "trainer.max_steps=3",
                      "rollout.max_staleness=2", "rollout.partial_rollouts=true", "algo.loss.tis_cap=2.0"))
    rows = read_metrics(tmp_path)
    current = column(rows, "train/rollout_logprob_abs_diff_current")
    print("sglang endpoint ahead: current", current, "staleness", column(rows, "rollout/staleness_max"))
    assert 1 <= len(current) <= 3 and max(current) <= 1e-5
    assert max(column(rows, "rollout/staleness_max")) <= 2 and column(rows, "rollout/dropped_stale") == [0.0] * 3
    assert min(column(rows, "train/rollout_logprob_abs_diff_unmasked")) > 1e-2
    assert column(rows, "rollout/trajectories_failed") == [0.0] * 3
