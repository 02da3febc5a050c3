"""`python -m topp_rl.report`: PNGs from a synthetic run dir (Lightning CSV), one curve per job of a sweep, and
several run dirs overlaid, labelled by the overrides that differ."""

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
from matplotlib import image

from topp_rl.report import curves
from topp_rl.report import plots as report
from topp_rl.report.labels import run_labels

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = list(range(1, 9))
REWARD, (MASKED, UNMASKED) = report.REWARD, report.MISMATCH


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


@pytest.mark.subprocess
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


def write_csv(path, rows_):
    path.parent.mkdir(parents=True)
    fields = sorted({k for r in rows_ for k in r}, key=lambda k: (k != "step", k))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows_)


def test_sweep_dir_draws_one_curve_per_job(tmp_path):
    """Two jobs of a sweep; the second was resumed (version_1 re-logs step 2 and goes on: it wins there)."""
    jobs = ["0-grpo-top_p0.8-seed0", "1-grpo-top_p1.0-seed0"]
    write_csv(tmp_path / jobs[0] / "csv/version_0/metrics.csv",
              [{"step": s, REWARD: 0.1 * s, MASKED: 1e-7} for s in (0, 1, 2)])
    write_csv(tmp_path / jobs[1] / "csv/version_0/metrics.csv",
              [{"step": s, REWARD: 0.5, MASKED: 2e-7, UNMASKED: 0.2} for s in (0, 1, 2)])
    write_csv(tmp_path / jobs[1] / "csv/version_1/metrics.csv", [{"step": s, REWARD: 0.9} for s in (2, 3)])
    for job in jobs:
        (tmp_path / job / report.COUNTS_FILE).write_text(json.dumps({"steps": 3, "counts": {"1": 5, "3": 2}}))
    histories = report.load_jobs(tmp_path)
    assert list(histories) == jobs
    assert histories[jobs[0]][REWARD] == [(0.0, 0.0), (1.0, pytest.approx(0.1)), (2.0, pytest.approx(0.2))]
    assert histories[jobs[1]][REWARD] == [(0.0, 0.5), (1.0, 0.5), (2.0, 0.9), (3.0, 0.9)]
    reward = report.reward_figure(histories)
    assert [line.get_label() for line in reward.axes[0].lines] == [f"{j}: reward mean" for j in jobs]
    mismatch = report.mismatch_figure(histories)
    assert [line.get_label() for line in mismatch.axes[0].lines] == [
        f"{jobs[0]}: mask on", f"{jobs[1]}: mask on", f"{jobs[1]}: mask off (full vocabulary)"]
    support = report.support_figure(report.read_counts(tmp_path))
    assert [line.get_label() for line in support.axes[0].lines] == [f"{j} (7 tokens)" for j in jobs]
    with pytest.raises(ValueError, match="holds 2 jobs"):
        report.load_history(tmp_path)
    paths = report.render(tmp_path)
    assert sorted(p.name for p in paths) == ["mismatch.png", "reward.png", "support_size_hist.png"]
    for p in paths:
        assert_real_png(p)


def test_versions_merge_in_numeric_order(tmp_path):
    for version in (2, 10):  # version_10 was written after version_2: it wins on step 0
        write_csv(tmp_path / f"csv/version_{version}/metrics.csv", [{"step": 0, REWARD: float(version)}])
    assert report.load_history(tmp_path)[REWARD] == [(0.0, 10.0)]


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


def test_out_onto_a_file_is_a_named_error_not_a_file_exists_error(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run)
    taken = tmp_path / "plots.png"
    taken.write_text("an earlier plot")
    with pytest.raises(ValueError) as info:
        report.render(run, out_dir=taken)
    assert str(info.value) == (
        f"--out {taken} is a file: the plots go into a directory; pass a directory path (absent: it is created), "
        "or leave --out out for RUN_DIR/plots"
    )
    with pytest.raises(ValueError, match=rf"^--out {taken}/plots is below the file {taken}: "):
        report.render(run, out_dir=taken / "plots")
    with pytest.raises(SystemExit) as exc:  # the command: exit status 2 and the message, no traceback
        report.main([str(run), "--out", str(taken)])
    assert exc.value.code == 2 and f"--out {taken} is a file" in capsys.readouterr().err
    assert taken.read_text() == "an earlier plot"


@pytest.mark.parametrize("content", ["", "step,epoch,rollout/reward_mean\n"], ids=["zero bytes", "header only"])
def test_an_empty_metrics_csv_is_a_named_error_not_an_empty_success(tmp_path, capsys, content):
    """`report` on a run that logged nothing exited 0 having written nothing (issue 35)."""
    path = tmp_path / "csv" / "version_0" / "metrics.csv"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        report.main([str(tmp_path)])
    assert exc.value.code == 2
    assert (f"error: no logged values in {path} (empty, or its header only: the run logged no step yet); plot a "
            "run that trained at least one step") in capsys.readouterr().err
    assert not (tmp_path / "plots").exists()


def test_val_figure_draws_each_evaluation_metric(tmp_path):
    csv_dir = tmp_path / "csv" / "version_0"
    csv_dir.mkdir(parents=True)
    evals = [(0, 0.0625, 0.25, 0.125), (5, 0.375, 0.3125, 0.21875), (10, 0.5, 0.625, 0.40625)]
    with open(csv_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "rollout/reward_mean", *(k for k, _, _ in report.VAL)])
        writer.writeheader()
        writer.writerows({"step": s, "rollout/reward_mean": 0.1} for s in range(10))
        writer.writerows({"step": s, "val/accuracy": a, "val/pass@k": p, "val/mean@k": m} for s, a, p, m in evals)
    fig = report.val_figure(report.load_jobs(tmp_path))
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert sorted(lines) == ["greedy accuracy", "mean@k", "pass@k"]
    assert list(lines["greedy accuracy"].get_xdata()) == [0.0, 5.0, 10.0]
    assert list(lines["pass@k"].get_ydata()) == [0.25, 0.3125, 0.625]
    assert "val.png" in [p.name for p in report.render(tmp_path)]
    assert report.val_figure({"": {"rollout/reward_mean": [(0.0, 0.1)]}}) is None  # no evaluation, no figure


def write_rewards(job_dir, means, stds, task_config=None):
    write_csv(job_dir / "csv/version_0/metrics.csv", [
        {"step": s, REWARD: m, "rollout/reward_std": sd} for s, (m, sd) in enumerate(zip(means, stds, strict=True))])
    if task_config is not None:
        (job_dir / "config.yaml").write_text(task_config)


def band_ys(ax):
    (band,) = ax.collections  # fill_between's PolyCollection
    return band.get_paths()[0].vertices[:, 1]


def test_metric_ranges_by_name_and_override():
    assert curves.metric_range("rollout/truncation_rate") == (0.0, 1.0)
    assert curves.metric_range("train/is_ratio_outside_frac_unmasked") == (0.0, 1.0)
    assert curves.metric_range("val/pass@k") == (0.0, 1.0)
    assert curves.metric_range("val/response_length_mean") == (0.0, None)  # a length, not a fraction
    assert curves.metric_range("train/rollout_logprob_abs_diff_p99") == (0.0, None)
    assert curves.metric_range("train/kl_k3_rollout") == (0.0, None)
    assert curves.metric_range("train/loss") == (None, None)
    assert curves.metric_range(REWARD) == (None, None)  # a reward function may return any float
    assert curves.metric_range(REWARD, {REWARD: (-1.0, 1.0)}) == (-1.0, 1.0)
    assert curves.parse_range("rollout/reward_mean=0:1") == (REWARD, (0.0, 1.0))
    assert curves.parse_range("train/loss=:5") == ("train/loss", (None, 5.0))
    for bad in ("rollout/reward_mean", "x=1:0", "x=a:b", "x=0-1"):
        with pytest.raises(ValueError, match=r"expected METRIC=LOW:HIGH with LOW < HIGH"):
            curves.parse_range(bad)


def test_moving_average_is_centred_and_shrinks_at_the_ends():
    assert curves.moving_average([0, 3, 6, 0, 9], 3) == [1.5, 3.0, 3.0, 5.0, 4.5]
    assert curves.moving_average([1, 2], 1) == [1.0, 2.0]
    assert [curves.smoothing_window(n) for n in (8, 11, 12, 30, 120, 10_000)] == [1, 1, 3, 5, 21, 51]
    assert [curves.smoothing_window(100, r) for r in (0, 1, 4, 7)] == [1, 1, 5, 7]


def test_task_reward_range_from_the_run_config(tmp_path):
    cases = {
        "copy": ("task:\n  _target_: topp_rl.tasks.generated.CopyDigitTask\n  digit_credit: 0.2\n", (0.0, 1.0)),
        "penalty": ("task:\n  _target_: topp_rl.tasks.generated.ArithmeticTask\n  partial_credit: -0.5\n",
                    (-0.5, 1.0)),
        "own_reward": ("task:\n  _target_: topp_rl.tasks.generated.CopyDigitTask\n  reward_fn: my.mod:fn\n",
                       (None, None)),
        "dataset": ("task:\n  _target_: topp_rl.tasks.datasets.DatasetTask\n", (None, None)),
    }
    for name, (text, expected) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(text)
        assert curves.task_reward_range(tmp_path / name) == expected, name
    assert curves.task_reward_range(tmp_path / "absent") == (None, None)


def test_reward_plot_draws_raw_and_smoothed_lines_and_a_band_clipped_to_the_task_range(tmp_path):
    means = [0.05 * (s % 5) + 0.01 * s for s in range(24)]  # a saw tooth on a rising line, all in [0, 0.43]
    stds = [0.3] * 24  # mean - std < 0 at every step: a {0, 1} reward's spread
    copy_digit = "task:\n  _target_: topp_rl.tasks.generated.CopyDigitTask\n  digit_credit: 0.2\n"
    write_rewards(tmp_path / "copy", means, stds, copy_digit)
    write_rewards(tmp_path / "custom", means, stds)  # no config.yaml: the reward's range is unknown
    for job, low in (("copy", 0.0), ("custom", min(curves.moving_average(means, 5)) - 0.3)):  # the band is smoothed too
        history = report.load_jobs(tmp_path / job)
        fig = report.reward_figure(history, reward_ranges=report.reward_ranges(tmp_path / job), run=f"run {job}")
        ax = fig.axes[0]
        raw, smooth = ax.lines
        window = curves.smoothing_window(24)  # 24 points: a 5-point window
        assert window == 5 and raw.get_label() == "reward mean, each step" and smooth.get_label() == "reward mean"
        assert list(raw.get_ydata()) == pytest.approx(means)
        assert list(smooth.get_ydata()) == pytest.approx(curves.moving_average(means, 5))
        assert band_ys(ax).min() == pytest.approx(low)  # clipped at 0 for copy_digit, not for an unknown task
        assert ax.get_title() == f"Rollout reward\nrun {job}" and ax.get_xlabel() == "rollout step"
        legend = ax.get_legend()
        assert legend.get_title().get_text() == "thick: 5-point centred moving average\nfaint: each step"
        labels = [t.get_text() for t in legend.get_texts()]
        assert labels[-1] == ("± std of the step's rewards, clipped to [0, 1]" if job == "copy"
                              else "± std of the step's rewards")
    # --range overrides the task's range; --smooth 0 draws the raw values alone (with markers)
    assert report.reward_ranges(tmp_path / "custom", {REWARD: (0.0, None)}) == {"": (0.0, None)}
    fig = report.reward_figure(report.load_jobs(tmp_path / "custom"), smooth=0)
    assert [line.get_label() for line in fig.axes[0].lines] == ["reward mean"]
    assert fig.axes[0].get_legend().get_title().get_text() == ""


def test_seed_groups_read_both_job_dir_styles_and_clip_their_bands(tmp_path):
    assert report.variant_of("4-p0.9-k0-maskTrue-tisNone-seed1") == "p0.9-k0-maskTrue-tisNone"
    assert report.variant_of("3-seed=1,experiment=study_arith_tis") == "experiment=study_arith_tis"
    assert report.variant_of("5-rollout.top_p=0.9,seed=12") == "rollout.top_p=0.9"
    for seed, values in ((0, [0.0, 0.2, 0.9, 1.0]), (1, [0.1, 0.0, 1.0, 1.0])):
        write_csv(tmp_path / f"{seed}-seed={seed},algo=gspo/csv/version_0/metrics.csv",
                  [{"step": s, "train/clip_frac": v} for s, v in enumerate(values)])
    groups = report.group_seeds(report.load_jobs(tmp_path))
    assert list(groups) == ["algo=gspo"]
    fig = report.seeds_figure(groups, smooth=3)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "train/clip_frac" and ax.get_title() == "clip fraction"
    assert list(ax.lines[1].get_ydata()) == pytest.approx(curves.moving_average([0.05, 0.1, 0.95, 1.0], 3))
    ys = band_ys(ax)
    assert ys.min() >= 0.0 and ys.max() <= 1.0


def test_cli_takes_smoothing_and_ranges_and_names_a_bad_range(tmp_path, capsys):
    write_rewards(tmp_path / "run", [0.1 * (s % 3) for s in range(30)], [0.5] * 30)
    report.main([str(tmp_path / "run"), "--smooth", "7", "--range", "rollout/reward_mean=0:1"])
    assert capsys.readouterr().out.split() == [str(tmp_path / "run/plots/reward.png")]
    assert_real_png(tmp_path / "run/plots/reward.png")
    with pytest.raises(SystemExit) as exc:
        report.main([str(tmp_path / "run"), "--range", "rollout/reward_mean=1:0"])
    assert exc.value.code == 2 and "--range 'rollout/reward_mean=1:0': expected METRIC=LOW:HIGH" in \
        capsys.readouterr().err


def write_started_run(run_dir, overrides, *, choices, config):
    """A run dir as a start leaves it: metrics.csv, `.hydra/overrides.yaml`, `.hydra/hydra.yaml`'s group choices,
    `config.yaml`."""
    write_csv(run_dir / "csv/version_0/metrics.csv", [{"step": s, REWARD: 0.1 * s, MASKED: 1e-7} for s in (0, 1, 2)])
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (run_dir / ".hydra" / "hydra.yaml").write_text(json.dumps({"hydra": {"runtime": {"choices": choices}}}))
    (run_dir / "config.yaml").write_text(json.dumps(config))


def test_several_run_dirs_overlay_labelled_by_the_overrides_that_differ(tmp_path, capsys):
    """Keys one run overrides and the other does not take the other's group choice or config value; keys both
    set alike, and where / how a run started (hydra.*, ckpt_path), are left out."""
    runs = [tmp_path / "a", tmp_path / "b"]
    write_started_run(runs[0], ["rollout.top_p=0.9", "trainer.max_steps=2", "algo=gspo", "seed=1",
                                "hydra.run.dir=a", "ckpt_path=last"],
                      choices={"algo": "gspo", "task": "copy_digit"}, config={"seed": 1})
    write_started_run(runs[1], ["trainer.max_steps=2", "rollout.top_p=1.0"],
                      choices={"algo": "grpo", "task": "copy_digit"}, config={"seed": 0})
    labels = ["rollout.top_p=0.9,algo=gspo,seed=1", "rollout.top_p=1.0,algo=grpo,seed=0"]
    assert run_labels(runs) == dict(zip(runs, labels, strict=True))
    jobs = report.load_jobs(runs)
    assert list(jobs) == labels
    fig = report.reward_figure(jobs)
    assert [line.get_label() for line in fig.axes[0].lines] == [f"{label}: reward mean" for label in labels]
    report.main([str(runs[0]), str(runs[1])])  # the default --out: the first run's plots/compare
    written = [tmp_path / "a" / "plots" / "compare" / name for name in ("reward.png", "mismatch.png")]
    assert capsys.readouterr().out.split() == [str(p) for p in written]
    for path in written:
        assert_real_png(path)
    from topp_rl import cli

    cli.main(["report", str(runs[0]), str(runs[1]), "--out", str(tmp_path / "both")])
    assert sorted(p.name for p in (tmp_path / "both").iterdir()) == ["mismatch.png", "reward.png"]


def test_runs_that_nothing_tells_apart_are_labelled_by_their_dirs(tmp_path):
    same = ["rollout.top_p=0.9"]
    for run in ("x/r1", "y/r2"):
        write_started_run(tmp_path / run, same, choices={}, config={})
    write_csv(tmp_path / "plain/csv/version_0/metrics.csv", [{"step": 0, REWARD: 0.5}])  # no .hydra/ at all
    assert list(report.load_jobs([tmp_path / "x/r1", tmp_path / "y/r2"])) == ["x/r1", "y/r2"]
    assert list(report.load_jobs([tmp_path / "x/r1", tmp_path / "plain"])) == ["x/r1", "plain"]
    with pytest.raises(ValueError, match="is given twice"):
        report.render([tmp_path / "x/r1", tmp_path / "x/r1"])
    with pytest.raises(ValueError, match=r"x/r1 is given twice \(or inside another one given\)"):
        report.render([tmp_path / "x/r1", tmp_path / "x"])  # x holds r1: its curves would be drawn twice
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"no metrics found under {tmp_path / 'empty'}: "):
        report.render([tmp_path / "x/r1", tmp_path / "empty"])
