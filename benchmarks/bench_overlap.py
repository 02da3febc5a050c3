"""rollout.overlap on / off: seconds per RL step when step k + 1 is generated beside step k, side by side.

    .venv/bin/python benchmarks/bench_overlap.py [--engine embedded|sglang] [--scale tiny|smollm2] [--steps 8]
        [--repeats 2] [--json out.json]

The bench_vs_trl workload (1-digit sums, 8 prompts x 4 samples, top_p 0.9, mask on) through the real Trainer,
arms interleaved (off, on, off, on). "off" is the on-policy default; "on" adds rollout.overlap=true with
algo.loss.tis_cap=2.0 (and, for the embedded engine, its own copy of the weights: share_weights=false; the
"off" arm then also keeps a copy, so the two differ only in the overlap). Step = wall time between step ends;
wait = the part of it spent waiting for the rollout (all of the generation when off). The first step is warm-up.
`--engine sglang` needs TOPP_RL_SGLANG_PYTHON (scripts/setup_sglang.sh); each run starts its own server.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_step import run_variant  # noqa: E402
from bench_vs_trl import topp_overrides  # noqa: E402

OVERLAP = ["rollout.overlap=true", "algo.loss.tis_cap=2.0"]


def arm_overrides(engine: str, scale: str, overlap: bool) -> list[str]:
    base = [*topp_overrides(scale), f"rollout={engine}"]
    if engine == "embedded":
        base.append("rollout.engine.share_weights=false")
    return [*base, *(OVERLAP if overlap else [])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["embedded", "sglang"], default="embedded")
    ap.add_argument("--scale", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for arm in rows:
            overrides = arm_overrides(args.engine, args.scale, arm == "on")
            rows[arm] += run_variant(overrides, steps=args.steps, use_mask=True)
    table = {arm: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "generate_s", "optim_s")}
             for arm, rs in rows.items()}
    print(f"engine={args.engine} scale={args.scale} steps/run={args.steps} repeats={args.repeats}")
    print(f"{'overlap':<9}{'step s':>9}{'wait s':>9}{'optim s':>9}")
    for arm, m in table.items():
        print(f"{arm:<9}{m['wall_s']:>9.3f}{m['generate_s']:>9.3f}{m['optim_s']:>9.3f}")
    print(f"speedup (off / on step time): {table['off']['wall_s'] / table['on']['wall_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "table": table,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
