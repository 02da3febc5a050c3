"""End to end with `rollout=vllm`: a real vLLM server on CPU samples (top_p 0.9, top_k 20), the trainer scores over
the kept sets read from its processed log-probs, and weights are synced to the server from disk after each step:
the trainer's float32 pass matches the server's recorded log-probs at SGLang's bar; with rollout.overlap=true it
generates one update behind. The tiny model with 2 heads (head size 32: vLLM's CPU attention has no 16)."""

import re

import pytest
from helpers import column, compose_cfg, read_metrics
from vllm_checks import require_vllm

from topp_rl.train import train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
require_vllm(module=True)


def test_vllm_rollouts_train_with_exact_logprobs(tmp_path, capsys):
    summary = train(compose_cfg(tmp_path, "rollout=vllm", "rollout.top_p=0.9", "rollout.top_k=20", "model.heads=2",
                                "model.kv_heads=1", "logger=csv", "trainer.max_steps=3"))  # fmt: skip
    rows = [r for r in read_metrics(tmp_path) if r.get("train/rollout_logprob_abs_diff")]
    assert len(rows) == 3  # every step on-policy after a weight sync, exact
    assert max(column(rows, "train/rollout_logprob_abs_diff_max")) <= 1e-4
    assert max(column(rows, "train/rollout_logprob_abs_diff")) <= 1e-5
    assert summary["train/rollout_logprob_abs_diff_unmasked"] > 1e-2  # the sets drop real mass
    synced = [r for r in read_metrics(tmp_path) if r.get("perf/weight_sync_bytes")]
    assert len(synced) == 3
    out = capsys.readouterr().err
    assert re.search(r"\[topp_rl\] vLLM server http://127\.0\.0\.1:\d+: ready in \d+\.\d s", out), out


def test_vllm_overlap_generates_beside_training_one_update_behind(tmp_path):
    """rollout.overlap=true: step k + 1's requests run while step k trains; each step's weight push (which pauses
    the server) waits for them, so every step after the first trains one update behind."""
    train(compose_cfg(tmp_path, "rollout=vllm", "rollout.top_p=0.9", "rollout.top_k=20", "model.heads=2",
                      "model.kv_heads=1", "logger=csv", "trainer.max_steps=3", "rollout.overlap=true",
                      "algo.loss.tis_cap=2.0"))  # fmt: skip
    rows = [r for r in read_metrics(tmp_path) if r.get("rollout/weight_staleness")]
    assert column(rows, "rollout/weight_staleness") == [0.0, 1.0, 1.0]
    assert float(rows[0]["train/rollout_logprob_abs_diff_max"]) <= 1e-4  # step 0: on-policy, exact
    overflow = [r for r in read_metrics(tmp_path) if r.get("rollout/candidate_overflow_frac")]
    assert column(overflow, "rollout/candidate_overflow_frac") == [0.0, 0.0, 0.0]


def test_the_default_tiny_model_is_refused_naming_its_head_size(tmp_path):
    with pytest.raises(ValueError, match=r"this model's is 16 .*model.heads=2 model.kv_heads=1"):
        train(compose_cfg(tmp_path, "rollout=vllm", "rollout.top_p=0.9", "rollout.top_k=20"))
