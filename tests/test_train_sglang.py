"""End to end with `rollout=sglang`: a real SGLang server on CPU samples, the trainer scores over its candidate
sets, and weights are synced to the server through `/update_weights_from_disk` after each step."""

import csv
import re

import pytest
from hydra import compose, initialize_config_dir
from sglang_checks import require_sglang
from test_train import ROOT, TINY

from topp_rl.train import train

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
require_sglang(module=True)


def test_sglang_rollouts_train_with_exact_logprobs(tmp_path, capsys):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.output_dir={tmp_path}", *TINY, "rollout=sglang", "logger=csv"])
    summary = train(cfg)
    # The server's recorded sets and renormalised log-probs match the trainer's float32 pass (two engines).
    assert summary["train/rollout_logprob_abs_diff_max"] <= 1e-4
    assert summary["train/rollout_logprob_abs_diff"] <= 1e-5
    assert summary["train/rollout_logprob_abs_diff_unmasked"] > 1e-2  # top_p=0.9 drops ~10% of the mass
    (metrics,) = tmp_path.glob("csv/*/metrics.csv")
    assert "rollout/support_size_mean" in metrics.read_text().splitlines()[0]
    out = capsys.readouterr().err  # the console says when the server starts and how long it took
    assert re.search(r"\[topp_rl\] SGLang server http://127\.0\.0\.1:\d+: starting \(log: ", out), out
    assert re.search(r"\[topp_rl\] SGLang server http://127\.0\.0\.1:\d+: ready in \d+\.\d s", out), out


def test_sglang_overlap_generates_beside_training_one_update_behind(tmp_path):
    """rollout.overlap=true with a real server: step k + 1's requests run on a background thread while step k
    trains; each step's weight push waits for them, so every step after the first trains one update behind."""
    overrides = [f"paths.output_dir={tmp_path}", *TINY, "rollout=sglang", "logger=csv", "trainer.max_steps=3",
                 "rollout.overlap=true", "algo.loss.tis_cap=2.0"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    train(cfg)
    (path,) = tmp_path.glob("csv/*/metrics.csv")
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/weight_staleness")]
    assert [float(r["rollout/weight_staleness"]) for r in rows] == [0.0, 1.0, 1.0]
    assert float(rows[0]["train/rollout_logprob_abs_diff_max"]) <= 1e-4  # step 0: on-policy, exact
