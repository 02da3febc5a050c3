"""On-policy distillation demo: OPD (full-vocabulary and kept-set teacher, and untruncated sampling), GRPO and GRPO +
teacher KL, several seeds each; accuracy and the teacher KL against steps and against wall time, in one PNG and one
JSON. Two presets:

- `--preset tiny` (`experiment=opd_tiny_copy_digit`): the tiny model after 400 GRPO steps on copy_digit teaches a
  freshly initialised tiny model (trained here once, into ~/.cache/topp_rl/distill-tiny-teacher; minutes on CPU);
- `--preset smollm2` (`experiment=opd_smollm2_arith`): SmolLM2-135M-Instruct teaching a 4-layer cut of itself on
  1-digit sums (build the student once: .venv/bin/python scripts/build_distill_student.py).

    .venv/bin/python benchmarks/bench_distill.py [--preset tiny] [--steps 60] [--seeds 0 1 2] [--out DIR]

Each run is `train.py experiment=<preset's> <arm> seed=<s>` in its own process, CSV logger, run dirs under
`--out`/runs (default docs/evidence/distill/<preset>). Every arm has the teacher configured, so GRPO's runs log `train/teacher_kl` too (figures only: its
coefficient is 0). Accuracy is `rollout/accuracy` (exact answers among the step's samples); wall time is the sum of
`perf/step_s`, start-up excluded.
"""

import argparse
import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The full-vocabulary teacher is the default; "-keptset" arms score it over the kept set (docs/distillation.md: blind
# to a student collapsed onto one-token sets); "opd-top_p1" samples untruncated (q = pi, the plain reverse KL).
ARMS = {
    "opd": ["algo=opd"],
    "opd-keptset": ["algo=opd", "teacher.use_candidate_mask=true"],
    "opd-top_p1": ["algo=opd", "rollout.top_p=1.0"],
    "grpo": ["algo=grpo", "teacher.use_candidate_mask=true"],
    "grpo+teacher_kl-keptset": ["algo=grpo", "algo.teacher_kl_coeff=0.5", "teacher.use_candidate_mask=true"],
}
KEYS = ("rollout/accuracy", "train/teacher_kl", "perf/step_s")
PRESETS = {  # experiment, plot title, default arms
    "tiny": ("opd_tiny_copy_digit", "a GRPO-trained tiny model teaching a fresh one, copy_digit, top_p 0.9",
             ["opd", "opd-keptset", "grpo", "grpo+teacher_kl"]),
    "smollm2": ("opd_smollm2_arith", "SmolLM2-135M-Instruct teaching a 4-layer student, 1-digit sums, top_p 0.9",
                list(ARMS)),
}  # fmt: skip
ARMS["grpo+teacher_kl"] = ["algo=grpo", "algo.teacher_kl_coeff=0.5"]
TINY_TEACHER = Path.home() / ".cache" / "topp_rl" / "distill-tiny-teacher"  # conf/experiment/opd_tiny_copy_digit.yaml
TEACHER_STEPS = 400


def tiny_teacher(out: Path) -> None:
    """The tiny preset's teacher: `TEACHER_STEPS` GRPO steps on copy_digit from seed 0's init, its HF export kept."""
    if (TINY_TEACHER / "config.json").is_file():
        return
    run_dir = out / "runs" / "teacher"
    subprocess.run([sys.executable, str(ROOT / "train.py"), f"trainer.max_steps={TEACHER_STEPS}", "rollout.top_p=0.9",
                    "logger=csv", "checkpoint.every_n_steps=0", "trainer.enable_progress_bar=false",
                    f"hydra.run.dir={run_dir}"], check=True, cwd=ROOT)  # fmt: skip
    TINY_TEACHER.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run_dir / "hf", TINY_TEACHER)


def run(arm: str, seed: int, *, steps: int, out: Path, experiment: str) -> Path:
    run_dir = out / "runs" / f"{arm}-seed{seed}"
    if not (run_dir / "summary.json").is_file():  # finished runs are kept: rerun the script to complete a sweep
        cmd = [sys.executable, str(ROOT / "train.py"), f"experiment={experiment}", *ARMS[arm], f"seed={seed}",
               f"trainer.max_steps={steps}", "logger=csv", "checkpoint.every_n_steps=0", "trainer.enable_progress_bar=false",
               f"hydra.run.dir={run_dir}"]
        subprocess.run(cmd, check=True, cwd=ROOT)
    return run_dir


def curves(run_dir: Path) -> dict[str, list[float]]:
    (path,) = run_dir.glob("csv/*/metrics.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return {key: [float(r[key]) for r in rows if r.get(key)] for key in KEYS}


def plot(results: dict[str, dict[int, dict[str, list[float]]]], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for color, (arm, seeds) in zip((f"C{i}" for i in range(10)), results.items(), strict=False):
        for i, c in enumerate(seeds.values()):
            label = arm if i == 0 else None
            wall = [sum(c["perf/step_s"][: k + 1]) for k in range(len(c["perf/step_s"]))]
            axes[0].plot(c["rollout/accuracy"], color=color, alpha=0.7, label=label)
            axes[1].plot(wall[: len(c["rollout/accuracy"])], c["rollout/accuracy"], color=color, alpha=0.7, label=label)
            axes[2].plot(c["train/teacher_kl"], color=color, alpha=0.7, label=label)
    for ax, (x, y) in zip(axes, (("step", "accuracy"), ("wall seconds (train steps)", "accuracy"),
                                 ("step", "teacher KL (k1, per token)")), strict=True):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=list(PRESETS), default="tiny")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: the preset's trainer.max_steps)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    experiment, title, default_arms = PRESETS[args.preset]
    arms = args.arms or default_arms
    out = args.out or ROOT / "docs" / "evidence" / "distill" / args.preset
    steps = args.steps or {"tiny": 60, "smollm2": 40}[args.preset]
    out.mkdir(parents=True, exist_ok=True)
    if args.preset == "tiny":
        tiny_teacher(out)
    results = {arm: {} for arm in arms}
    for seed in args.seeds:  # seeds outermost: a partial sweep still compares the arms
        for arm in arms:
            results[arm][seed] = curves(run(arm, seed, steps=steps, out=out, experiment=experiment))
    (out / "distill.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "distill.png", title=title)
    for arm, seeds in results.items():
        last = [c["rollout/accuracy"][-1] for c in seeds.values()]
        kl = [c["train/teacher_kl"][-1] for c in seeds.values()]
        print(f"{arm}: last-step accuracy {last}, teacher KL {[round(k, 3) for k in kl]}")
    print(f"plot: {out / 'distill.png'}")


if __name__ == "__main__":
    main()
