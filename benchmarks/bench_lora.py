"""Full fine-tuning against LoRA (`module.lora.rank=R`) on SmolLM2-135M-Instruct: peak RSS, step time, weight-sync
bytes and time per step, checkpoint size, reward, each variant in its own `train.py` process (peak RSS is per
process).

    .venv/bin/python benchmarks/bench_lora.py [--steps 20] [--rank 16] [--lora-lr 1e-4] [--json out.json]
                                              [overrides ...]

Both variants run `experiment=smollm2_arith` with `rollout.engine.share_weights=false`: the embedded engine keeps
its own copy and is synced like a server, so `perf/weight_sync_bytes` is what a server would receive (LoRA: the
merged weights, see docs/lora.md). The first step is warm-up and not counted in the step time; the reward is
the mean of the last 5 steps. Full fine-tuning keeps the experiment's lr (3e-6); LoRA trains a rank-R update
from zero and takes `--lora-lr`.
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ("experiment=smollm2_arith", "rollout.engine.share_weights=false", "logger=csv", "export.hf=false",
          "trainer.enable_progress_bar=false")


def run_variant(out: Path, steps: int, overrides: list[str]) -> dict[str, float]:
    cmd = [sys.executable, "train.py", f"hydra.run.dir={out}", *COMMON, f"trainer.max_steps={steps}",
           f"checkpoint.every_n_steps={steps}", *overrides]
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = []
    for path in out.glob("csv/*/metrics.csv"):
        with path.open() as f:
            rows += list(csv.DictReader(f))

    def col(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key)]

    ckpt = out / "checkpoints" / "last.ckpt"
    steps_s = col("perf/step_s") or col("perf/optim_s")
    return {
        "wall_s": time.perf_counter() - start,
        "peak_rss_mb": max(col("perf/peak_rss_mb")),
        "step_s": statistics.median(steps_s[1:]),
        "optim_s": statistics.median(col("perf/optim_s")[1:]),
        "weight_sync_mb": statistics.median(col("perf/weight_sync_bytes")) / 2**20,
        "weight_sync_s": statistics.median(col("perf/weight_sync_s")),
        "checkpoint_mb": ckpt.resolve().stat().st_size / 2**20,
        "reward_first5": statistics.mean(col("rollout/reward_mean")[:5]),
        "reward_last5": statistics.mean(col("rollout/reward_mean")[-5:]),
        "mismatch_max": max(col("train/rollout_logprob_abs_diff_max")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-lr", type=float, default=1e-4)
    parser.add_argument("--only", choices=("full", "lora"), help="run one variant")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    variants = {"full": [], f"lora r={args.rank}": [f"module.lora.rank={args.rank}", f"optimizer.lr={args.lora_lr}"]}
    if args.only:
        variants = {k: v for k, v in variants.items() if k.startswith(args.only)}
    results = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in variants.items():
            results[name] = run_variant(Path(tmp) / name.replace(" ", "_").replace("=", ""), args.steps,
                                        [*extra, *args.overrides])
            print(name, json.dumps(results[name]), flush=True)
    results["load_after"] = os.getloadavg()
    keys = list(next(v for k, v in results.items() if k in variants))
    print("| variant | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name in variants:
        print(f"| {name} | " + " | ".join(f"{results[name][k]:.4g}" for k in keys) + " |")
    print(f"load average (1, 5, 15 min): before {results['load_before']}, after {results['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
