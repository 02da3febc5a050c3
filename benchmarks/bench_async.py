"""Rollouts ahead of training (`rollout.max_staleness`), side by side: throughput and learning.

    .venv/bin/python benchmarks/bench_async.py throughput [--steps 8] [--repeats 3] [--json out.json]
    .venv/bin/python benchmarks/bench_async.py learning [--steps 40] [--seeds 0 1 2] [--json out.json] [--plot out.png]

throughput: a long-tail workload (the tiny Qwen2 widened to hidden 256 x 4 layers, copy_digit prompts, up to 256
new tokens: the random-init model ends a response with p ~ 1/128 per token, so lengths run from 1 to 256, ~14%
cut at 256), 8 prompts x 8 samples a step, the embedded engine with its own weights, learning rate 1e-12 (the same
length distribution in every arm and step; the weight push, the versions and the staleness run as in training). Arms: K=0 (on-policy), K=1
(one step ahead, static batching), K=2 with partial rollouts (continuous batching). `--cores`: `one` (every thread
pinned to core 0: engine and trainer share one core, as on one shared device), `separate` (the trainer's thread
pinned to core 0, every other thread, the engine's, to core 1: a miniature of separate inference and training
devices), `free` (no pinning; with `num_threads=1` the two threads take a core each when they run at once). Figures per arm: trained tokens per second (`rollout/trained_tokens`
over `perf/step_s`, after the first K + 1 steps), the mean decode batch (`perf/decode_batch_mean`: the responses
in flight per decode step), the mean staleness; medians over repeats, arms interleaved so load changes hit all.

learning: the default copy_digit run (tiny model, top_p 0.9) at K=0 and at K=2 with partial rollouts (both with
TIS, cap 2), 3 seeds: reward against steps and against wall time, plotted.
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
# optimizer.lr=1e-12 (0 is refused): the policy stays the random init, so every arm samples the same length
# distribution (learning moves the lengths a lot, arm by arm: 74 to 227 tokens mean in 8 steps); the weights are
# still pushed every step.
LONG_TAIL = ["model.hidden=256", "model.layers=4", "rollout.max_new_tokens=256", "rollout.prompts_per_step=8",
             "rollout.n_samples=8", "rollout.top_p=0.9", "data.max_tokens_per_micro_batch=4096", "optimizer.lr=1e-12"]
COMMON = ["rollout.engine.share_weights=false", "algo.loss.tis_cap=2.0", "logger=csv", "checkpoint.every_n_steps=0",
          "trainer.enable_progress_bar=false", "export.hf=false", "num_threads=1"]
ARMS = {"K0": ["rollout.max_staleness=0"], "K1": ["rollout.max_staleness=1"],
        "K2_partial": ["rollout.max_staleness=2", "rollout.partial_rollouts=true"]}
PIN = ["+callbacks.pin_threads._target_=bench_async.PinThreads"]


class PinThreads(Callback):
    """Loaded by a run through PYTHONPATH=benchmarks, checked each step (threads start lazily). BENCH_CORES=separate:
    the trainer's thread on core 0, every other thread of the process (the scheduler's, the engine's decode loop) on
    core 1; one: every thread on core 0 (engine and trainer share one core)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        main, separate = threading.main_thread(), os.environ["BENCH_CORES"] == "separate"
        for thread in threading.enumerate():
            if thread.native_id is not None:
                os.sched_setaffinity(thread.native_id, {0} if thread is main or not separate else {1})


def run(overrides: list[str], *, cores: str) -> list[dict[str, float]]:
    """One train.py run (`cores`: free, separate or one, see PinThreads); its metrics rows (one per step)."""
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=str(ROOT / "benchmarks"), BENCH_CORES=cores)
        cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp}/run", *COMMON, *overrides,
               *(PIN if cores != "free" else [])]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise RuntimeError(f"{' '.join(overrides)} failed:\n{done.stderr[-3000:]}")
        (path,) = Path(tmp, "run").glob("csv/*/metrics.csv")
        steps: dict[int, dict[str, float]] = {}
        with path.open() as f:
            for row in csv.DictReader(f):
                steps.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
        return [steps[k] for k in sorted(steps)]


def throughput_figures(rows: list[dict[str, float]], skip: int) -> dict[str, float]:
    steady = [r for r in rows[skip:] if "perf/step_s" in r]
    tokens = sum(r["rollout/trained_tokens"] for r in steady)
    return {"trained_tokens_per_s": tokens / sum(r["perf/step_s"] for r in steady),
            "step_s": statistics.median(r["perf/step_s"] for r in steady),
            "decode_batch_mean": statistics.mean(r.get("perf/decode_batch_mean", float("nan")) for r in steady),
            "staleness_mean": statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in steady),
            "partial_frac": statistics.mean(r.get("rollout/partial_frac", 0.0) for r in steady),
            "response_length_mean": statistics.mean(r["rollout/response_length_mean"] for r in steady)}


def throughput(args: argparse.Namespace) -> dict:
    results: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for cores in args.cores:
            for arm, keys in ARMS.items():
                rows = run([*LONG_TAIL, *keys, f"trainer.max_steps={args.steps}", f"seed={repeat}"], cores=cores)
                figures = throughput_figures(rows, skip=int(arm[1]) + 1)
                results.setdefault(f"{arm}/{cores}", []).append(figures)
                print(f"repeat {repeat} {cores:<8} {arm:<11} " + " ".join(f"{k}={v:.3g}" for k, v in figures.items()),
                      flush=True)
    table = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in results.items()}
    print(f"\n{'arm':<22}{'tokens/s':>10}{'step s':>8}{'decode batch':>14}{'staleness':>11}{'partial':>9}{'vs K0':>7}")
    for name, m in table.items():
        base = table[f"K0/{name.split('/')[1]}"]["trained_tokens_per_s"]
        print(f"{name:<22}{m['trained_tokens_per_s']:>10.0f}{m['step_s']:>8.2f}{m['decode_batch_mean']:>14.1f}"
              f"{m['staleness_mean']:>11.2f}{m['partial_frac']:>9.2f}{m['trained_tokens_per_s'] / base:>7.2f}")
    return {"table": table, "runs": results}


def learning(args: argparse.Namespace) -> dict:
    curves: dict[str, list[dict]] = {}
    for seed in args.seeds:
        for arm in ("K0", "K2_partial"):
            rows = run([*ARMS[arm], f"trainer.max_steps={args.steps}", f"seed={seed}", "rollout.top_p=0.9"],
                       cores="free")
            wall, curve = 0.0, []
            for r in rows:
                wall += r.get("perf/step_s", 0.0)
                curve.append({"reward": r["rollout/reward_mean"], "wall_s": wall})
            curves.setdefault(arm, []).append({"seed": seed, "curve": curve})
            print(f"{arm} seed {seed}: reward {curve[0]['reward']:.3f} -> {curve[-1]['reward']:.3f} in {wall:.0f} s",
                  flush=True)
    if args.plot:
        plot_learning(curves, args.plot)
    return curves


def plot_learning(curves: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for arm, color in (("K0", "tab:blue"), ("K2_partial", "tab:orange")):
        for i, run_ in enumerate(curves[arm]):
            reward = [p["reward"] for p in run_["curve"]]
            label = None if i else {"K0": "K=0 (on-policy)", "K2_partial": "K=2, partial rollouts"}[arm]
            axes[0].plot(range(len(reward)), reward, color=color, alpha=0.8, label=label)
            axes[1].plot([p["wall_s"] for p in run_["curve"]], reward, color=color, alpha=0.8, label=label)
    axes[0].set(xlabel="step", ylabel="rollout reward mean", title="reward per step")
    axes[1].set(xlabel="wall time (s)", title="reward per wall second")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("copy_digit, tiny model, 3 seeds each: K=0 vs K=2 with partial rollouts")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["throughput", "learning"])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--cores", nargs="+", choices=["one", "separate", "free"], default=["one", "separate"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    args.steps = args.steps or (8 if args.part == "throughput" else 40)
    out = throughput(args) if args.part == "throughput" else learning(args)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": out},
                                        indent=1))


if __name__ == "__main__":
    main()
