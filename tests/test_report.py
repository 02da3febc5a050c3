"""`python -m topp_rl.report`: PNGs from a synthetic run dir (Lightning CSV) and from a real W&B offline run."""

import csv
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from matplotlib import image

from topp_rl import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = list(range(1, 9))


def rows():
    for s in STEPS:
        yield {
            "step": s,
            "rollout/reward_mean": 0.1 * s,
            "rollout/reward_std": 0.05,
            "rollout/accuracy": 0.05 * s,
        }
        yield {
            "step": s,
            "train/rollout_logprob_abs_diff": 1e-7 * s,
            "train/rollout_logprob_abs_diff_unmasked": 0.3 / s,
        }


def write_run(run_dir):
    csv_dir = run_dir / "csv" / "version_0"
    csv_dir.mkdir(parents=True)
    fields = ["step", "rollout/reward_mean", "rollout/reward_std", "rollout/accuracy"]
    fields += ["train/rollout_logprob_abs_diff", "train/rollout_logprob_abs_diff_unmasked"]
    with open(csv_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows())
    counts = {"1": 500, "2": 120, "3": 40, "7": 9, "40": 1}
    (run_dir / report.COUNTS_FILE).write_text(json.dumps({"steps": 8, "counts": counts}))


def assert_real_png(path):
    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = image.imread(path)[..., :3]
    assert pixels.shape[0] > 200 and pixels.shape[1] > 300
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    assert len(colours) > 20  # axes, text, lines: not a blank canvas
    assert (pixels < 0.5).mean() > 0.005  # some dark ink


def test_render_from_csv(tmp_path):
    write_run(tmp_path)
    history = report.load_history(tmp_path)
    assert history["rollout/reward_mean"] == [(float(s), pytest.approx(0.1 * s)) for s in STEPS]
    assert history["train/rollout_logprob_abs_diff"][0] == (1.0, pytest.approx(1e-7))
    paths = report.render(tmp_path)
    assert sorted(p.name for p in paths) == ["mismatch.png", "reward.png", "support_size_hist.png"]
    for p in paths:
        assert_real_png(p)


def test_cli_writes_pngs(tmp_path):
    write_run(tmp_path / "run")
    out = tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, "-m", "topp_rl.report", str(tmp_path / "run"), "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert sorted(proc.stdout.split()) == sorted(
        str(out / n) for n in ("mismatch.png", "reward.png", "support_size_hist.png")
    )
    for name in ("mismatch.png", "reward.png", "support_size_hist.png"):
        assert_real_png(out / name)


def test_render_from_wandb_offline_run(tmp_path):
    import wandb

    run = wandb.init(mode="offline", dir=str(tmp_path), project="topp_rl_report_test")
    for s in STEPS:
        run.log(
            {
                "rollout/reward_mean": 0.1 * s,
                "train/rollout_logprob_abs_diff": 1e-7 * s,
                "trainer/global_step": s,
            }
        )
        run.log({"train/rollout_logprob_abs_diff_unmasked": 0.3 / s, "trainer/global_step": s})
    run.log({"rollout/big": list(range(5000)), "trainer/global_step": 99})  # a record spanning blocks
    run.finish()
    (log,) = tmp_path.rglob("run-*.wandb")
    deadline = time.monotonic() + 20  # finish() can return before the service has written the log's tail
    while not report.wandb_run_finished(log) and time.monotonic() < deadline:
        time.sleep(0.2)
    history = report.load_history(tmp_path)
    assert history["rollout/reward_mean"] == [(float(s), pytest.approx(0.1 * s)) for s in STEPS]
    assert history["train/rollout_logprob_abs_diff_unmasked"] == [
        (float(s), pytest.approx(0.3 / s)) for s in STEPS
    ]
    paths = report.render(tmp_path)
    assert sorted(p.name for p in paths) == ["mismatch.png", "reward.png"]
    for p in paths:
        assert_real_png(p)


def test_missing_run_dir_or_metrics_raise(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        report.render(tmp_path / "nope")
    with pytest.raises(ValueError, match="no metrics found"):
        report.render(tmp_path)


def test_cli_reports_bad_run_dir_without_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        report.main([str(tmp_path)])
    assert exc.value.code == 2
    assert "no metrics found" in capsys.readouterr().err
