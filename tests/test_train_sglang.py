"""End to end with `rollout=sglang`: a real SGLang server on CPU samples, the trainer scores over its candidate
sets, and weights are synced to the server through `/update_weights_from_disk` after each step. The first run
launches its server; the overlap run connects to the session's shared one (conftest's tiny_sglang_url)."""

import re

import pytest
from helpers import column, compose_cfg, read_metrics
from sglang_checks import require_sglang

from topp_rl.train import train

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
require_sglang(module=True)


def test_sglang_rollouts_train_with_exact_logprobs(tmp_path, capsys):
    summary = train(compose_cfg(tmp_path, "rollout=sglang", "logger=csv"))
    # The server's recorded sets and renormalised log-probs match the trainer's float32 pass (two engines).
    assert summary["train/rollout_logprob_abs_diff_max"] <= 1e-4
    assert summary["train/rollout_logprob_abs_diff"] <= 1e-5
    assert summary["train/rollout_logprob_abs_diff_unmasked"] > 1e-2  # top_p=0.9 drops ~10% of the mass
    (metrics,) = tmp_path.glob("csv/*/metrics.csv")
    assert "rollout/support_size_mean" in metrics.read_text().splitlines()[0]
    out = capsys.readouterr().err  # the console says when the server starts and how long it took
    assert re.search(r"\[topp_rl\] SGLang server http://127\.0\.0\.1:\d+: starting \(log: ", out), out
    assert re.search(r"\[topp_rl\] SGLang server http://127\.0\.0\.1:\d+: ready in \d+\.\d s", out), out


def test_sglang_overlap_generates_beside_training_one_update_behind(tmp_path, tiny_sglang_url):
    """rollout.overlap=true with a real server: step k + 1's requests run on a background thread while step k
    trains; each step's weight push waits for them, so every step after the first trains one update behind."""
    train(compose_cfg(tmp_path, "rollout=sglang", f"rollout.engine.urls=['{tiny_sglang_url}']", "logger=csv",
                      "trainer.max_steps=3", "rollout.overlap=true", "algo.loss.tis_cap=2.0"))
    rows = [r for r in read_metrics(tmp_path) if r.get("rollout/weight_staleness")]
    assert column(rows, "rollout/weight_staleness") == [0.0, 1.0, 1.0]
    assert float(rows[0]["train/rollout_logprob_abs_diff_max"]) <= 1e-4  # step 0: on-policy, exact


def test_sglang_colocated_trains_exactly_releasing_memory_between_steps(tmp_path, capsys):
    """rollout.engine.placement=colocated on CPU: after each step's rollouts the server releases its memory (a
    CPU server frees nothing: no memory saver there), the weights go over shared memory (weight_sync null ->
    tensor) and the next step samples with them: the trainer's pass stays exact to the server's every step, and
    the evaluation after each push generates with the server awake."""
    train(compose_cfg(tmp_path, "rollout=sglang", "rollout.engine.placement=colocated", "logger=csv",
                      "trainer.max_steps=3", "eval.every_n_steps=2"))
    rows = [r for r in read_metrics(tmp_path) if r.get("train/rollout_logprob_abs_diff")]
    assert len(rows) == 3
    assert max(column(rows, "train/rollout_logprob_abs_diff_max")) <= 1e-4  # the bounds of the disk-synced run
    assert max(column(rows, "train/rollout_logprob_abs_diff")) <= 1e-5
    synced = [r for r in read_metrics(tmp_path) if r.get("perf/weight_sync_bytes")]
    assert len(synced) == 3 and len(set(column(synced, "perf/weight_sync_bytes"))) == 1  # every step pushed it all
    assert "[topp_rl] eval at step 2" in capsys.readouterr().out
