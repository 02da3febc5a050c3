"""End-to-end training runs, as short as possible: every algorithm in one process (one with the CSV logger),
a Hydra `-m` sweep in one subprocess (two W&B offline runs in one group)."""

import json
import math
import subprocess
import sys

import pytest
from helpers import ROOT, TINY, column, compose_cfg, read_metrics, train_env

from topp_rl.train import train

GROUP = "sweep_grp7"
ALGOS = ("grpo", "dr_grpo", "gspo", "cispo", "reinforce_pp")
STABLE = (
    "rollout/reward_mean", "rollout/response_length_mean", "rollout/support_size_mean", "train/loss",
    "train/rollout_logprob_abs_diff", "train/rollout_logprob_abs_diff_unmasked",
    "train/rollout_logprob_abs_diff_max", "train/is_ratio_mean", "train/kl_k3_rollout", "train/entropy",
    "train/grad_norm",
)


def test_every_algorithm_trains_end_to_end(tmp_path):
    for algo in ALGOS:
        out = tmp_path / algo
        # grpo logs, with groups big enough that some hold different rewards (a nonzero gradient to check).
        logged = ("logger=csv", "rollout.prompts_per_step=4", "rollout.n_samples=4")
        summary = train(compose_cfg(out, f"algo={algo}", *(logged if algo == "grpo" else ("logger=none",))))
        # On-policy pass, mask on: training and rollout agree to float32 precision; unmasked shows the bias.
        assert summary["train/rollout_logprob_abs_diff_max"] <= 1e-5, algo
        assert summary["train/rollout_logprob_abs_diff_unmasked"] > 1e-3, algo
        assert (out / "config.yaml").is_file()
    rows = read_metrics(tmp_path / "grpo")
    for key in STABLE:
        values = column(rows, key)
        assert len(values) == 2 and all(math.isfinite(v) for v in values), key
    assert max(column(rows, "train/rollout_logprob_abs_diff")) <= 1e-5
    assert max(column(rows, "train/grad_norm")) > 0  # zero when every group has equal rewards
    assert [int(float(r["step"])) for r in rows if r.get("train/loss")] == [0, 1]


def test_module_logs_its_own_training_metrics_without_metric_callbacks(tmp_path, capsys):
    """callbacks=minimal (WeightSync only): the module's train/* figures still reach metrics.csv, and the run
    prints its layout once."""
    out = tmp_path / "minimal"
    train(compose_cfg(out, "callbacks=minimal", "logger=csv", "optimizer.lr=0.01"))
    rows = read_metrics(out)
    keys = set().union(*rows)
    for key in ("train/loss", "train/pg_loss", "train/clip_frac", "train/grad_norm", "train/lr", "train/entropy",
                "perf/old_logprob_s", "perf/optim_s"):
        assert len(column(rows, key)) == 2, key
    assert column(rows, "train/lr") == pytest.approx([0.01, 0.01], rel=1e-7)  # Lightning logs float32
    assert all(0 < v <= math.log(128) for v in column(rows, "train/entropy"))  # tiny model: vocab 128
    assert not any(k.startswith("train/rollout_logprob") for k in keys)  # LogProbMismatch is not in the run
    assert capsys.readouterr().out.count("[topp_rl] layout: world=1 dp=1 tp=1 cp=1 ep=1\n") == 1


@pytest.mark.subprocess
def test_sweep_runs_each_job_as_its_own_wandb_run_in_one_group(tmp_path):
    env = train_env(WANDB_SILENT="true")
    cmd = [sys.executable, "train.py", "-m", "rollout.top_p=0.8,1.0", "logger=wandb", *TINY[:-1],
           f"hydra.sweep.dir={tmp_path}/{GROUP}", "group=null", "num_threads=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted((tmp_path / GROUP).glob("*/wandb/offline-run-*"))
    assert len(runs) == 2, runs
    names = []
    assert [r.parent.parent.name for r in runs] == ["0-rollout.top_p=0.8", "1-rollout.top_p=1.0"]  # swept values
    group = f"{GROUP} [rollout.top_p]".encode()  # the sweep: its dir and its swept keys
    for run in runs:
        data = next(run.glob("run-*.wandb")).read_bytes()
        # The run record holds the group and the run name as length-prefixed protobuf strings.
        assert bytes([len(group)]) + group in data
        names += [n for n in (b"copy_digit-tiny-grpo-top_p0.8-seed0 [rollout.top_p=0.8]",
                              b"copy_digit-tiny-grpo-top_p1.0-seed0 [rollout.top_p=1.0]") if bytes([len(n)]) + n in data]
    assert sorted(names) == [b"copy_digit-tiny-grpo-top_p0.8-seed0 [rollout.top_p=0.8]",
                             b"copy_digit-tiny-grpo-top_p1.0-seed0 [rollout.top_p=1.0]"]  # the task and model too
    assert proc.stdout.count("[topp_rl] run finished") == 2


def test_bf16_and_gradient_checkpointing_options_train(tmp_path):
    """trainer=cpu_bf16 trains with bf16 autocast (mismatch at bf16 precision, not float32's); gradient
    checkpointing gives the same run as without it, step for step."""
    runs = {"plain": (), "ckpt": ("module.gradient_checkpointing=true",), "bf16": ("trainer=cpu_bf16",)}
    rows = {}
    for name, overrides in runs.items():
        out = tmp_path / name
        train(compose_cfg(out, "logger=csv", "trainer.max_steps=3", *overrides))
        rows[name] = read_metrics(out)
    for key in ("train/loss", "train/grad_norm", "train/rollout_logprob_abs_diff"):
        assert column(rows["ckpt"], key) == column(rows["plain"], key), key
    assert max(column(rows["plain"], "train/rollout_logprob_abs_diff")) < 1e-5
    bf16 = column(rows["bf16"], "train/rollout_logprob_abs_diff")
    # bf16 rounding (3e-4 with AVX2 and AVX-512 kernels alike): 100x float32's 1e-7, and 25x under 1e-2, which is
    # 2.6 unit round-offs (2^-8) of bf16 on every log-prob
    assert len(bf16) == 3 and all(1e-5 < v < 1e-2 for v in bf16)


@pytest.mark.subprocess
def test_console_shows_one_bar_and_each_line_once_and_writes_summary_json(tmp_path):
    env = train_env()
    env.pop("WANDB_SILENT", None)
    cmd = [sys.executable, "train.py", *[o for o in TINY if "progress_bar" not in o], "trainer.max_steps=3",
           f"hydra.run.dir={tmp_path}", "num_threads=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert "Epoch" not in console and "LeafSpec" not in console
    assert "GPU available" not in console  # Lightning's INFO lines go to the run's log file, once
    assert (tmp_path / "train.log").read_text().count("GPU available") == 1
    final = console.replace("\r", "\n").splitlines()
    assert any(line.startswith("step: 100%") and "3/3" in line and "reward=" in line and "mismatch=" in line
               for line in final), console[-2000:]
    assert "wandb: Run history" not in console  # the run prints its own summary
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["train/rollout_logprob_abs_diff_max"] < 1e-5
    assert summary["reward_first"] >= 0 and summary["wall_s"] > 0
    rows = read_metrics(tmp_path)
    for key in ("perf/step_s", "perf/generate_s", "perf/old_logprob_s", "perf/optim_s", "perf/weight_sync_s",
                "perf/train_tokens_per_s", "perf/peak_rss_mb"):
        values = column(rows, key)
        assert len(values) == 3 and all(v > 0 for v in values), key
    phases = [column(rows, k) for k in ("perf/generate_s", "perf/old_logprob_s", "perf/optim_s")]
    for step_s, *parts in zip(column(rows, "perf/step_s"), *phases, strict=True):
        assert step_s >= sum(parts)  # the whole step holds its phases


def test_refill_keeps_every_step_full_or_counts_the_cap(tmp_path):
    """data.refill=true end to end: every step trains prompts_per_step groups whose rewards differ, or says it
    stopped at data.max_refill_factor; the counts add up."""
    out = tmp_path / "refill"
    train(compose_cfg(out, "logger=csv", "trainer.max_steps=4", "rollout.prompts_per_step=4", "rollout.n_samples=4",
                      "data.drop_zero_variance_groups=true", "data.refill=true", "data.max_refill_factor=3"))
    rows = [r for r in read_metrics(out) if r.get("rollout/groups_generated")]
    assert len(rows) == 4
    for r in rows:
        generated, filtered, trained, surplus, rounds, capped = (float(r[f"rollout/{k}"]) for k in (
            "groups_generated", "groups_filtered", "groups_trained", "groups_surplus", "refill_rounds",
            "refill_capped"))
        assert generated == trained + filtered + surplus and 4 <= generated <= 12, r
        assert trained == 4 or capped == 1.0, r
        assert (rounds > 0) == (generated > 4), r
    assert any(float(r["rollout/refill_rounds"]) > 0 for r in rows)  # the run did refill
