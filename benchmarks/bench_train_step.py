"""Time per RL step of the default run, split into generation, old-log-prob pass and optimisation, with the
candidate mask on and off, side by side in one process.

    .venv/bin/python benchmarks/bench_train_step.py [--steps N] [--repeats 2] [--json out.json] [overrides ...]

Each variant runs the default config (`train.py algo=grpo rollout.top_p=0.9` unless overridden) through the real
Trainer. Generation is the time from the previous step's end (after the weight sync) to this step's start, i.e.
`RolloutDataModule.on_before_batch_transfer`; the old-log-prob pass and optimisation are the module's own logged
`perf/old_logprob_s` and `perf/optim_s`; `wall_s` (in the rows) is the whole step, callbacks included. The
first step of each run is warm-up and not counted; figures are medians over the remaining steps of `--repeats`
runs per variant, interleaved (on, off, on, off) so that load changes on a shared machine hit both.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import Callback

from topp_rl.train import build_run, fit, process_settings

CONF = Path(__file__).resolve().parents[1] / "conf"
PHASES = ("generate_s", "old_logprob_s", "optim_s", "step_s")
COLUMNS = (*PHASES, "support_size_mean")


class StepTimer(Callback):
    """Per-step wall-clock phases; must be the last callback so the weight sync is not counted as generation."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self._mark = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self._mark = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()
        self._generate = self._start - self._mark

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        end = time.perf_counter()
        metrics = trainer.callback_metrics
        row = {"generate_s": self._generate, "old_logprob_s": float(metrics["perf/old_logprob_s"]),
               "optim_s": float(metrics["perf/optim_s"])}
        row["step_s"] = row["generate_s"] + row["old_logprob_s"] + row["optim_s"]
        # Wall time since the previous step's end: also the callbacks (weight sync, metrics), and under
        # rollout.overlap the wait for the generation running beside the step.
        row["wall_s"] = end - self._mark
        row["support_size_mean"] = float(trainer.callback_metrics.get("rollout/support_size_mean", float("nan")))
        gen_rate, gen_s = (metrics.get(k) for k in ("perf/generate_tokens_per_s", "perf/generate_s"))
        row["tokens"] = float(gen_rate * gen_s) if gen_rate is not None and gen_s is not None else float("nan")
        self.rows.append(row)
        self._mark = end


def run_variant(overrides: list[str], *, steps: int | None, use_mask: bool) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="bench_train_step_") as tmp:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[
                "algo=grpo", "rollout.top_p=0.9", "logger=none", "checkpoint.every_n_steps=0",
                *([f"trainer.max_steps={steps}"] if steps else []), "trainer.enable_progress_bar=false",
                f"paths.output_dir={tmp}",
                f"module.use_mask={str(use_mask).lower()}", *overrides,
            ])
        with process_settings(cfg):  # threads and host memory reuse, as train() sets them
            run = build_run(cfg)
            timer = StepTimer()
            run.trainer.callbacks.append(timer)
            fit(run)
    return timer.rows[1:] or timer.rows  # the first step is warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="rollout steps per run (default: the config's)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant, interleaved on/off/on/off")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="hydra overrides, e.g. rollout.n_samples=16")
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"mask_on": [], "mask_off": []}
    for _ in range(args.repeats):  # interleaved, so a load change on a shared machine hits both variants
        for name, mask in (("mask_on", True), ("mask_off", False)):
            rows[name] += run_variant(args.overrides, steps=args.steps, use_mask=mask)
    results = {name: {k: statistics.median(r[k] for r in rs) for k in COLUMNS} for name, rs in rows.items()}
    print(f"{'phase':<16}{'mask on (ms)':>14}{'mask off (ms)':>15}{'on/off':>9}")
    for phase in PHASES:
        on, off = results["mask_on"][phase] * 1e3, results["mask_off"][phase] * 1e3
        print(f"{phase:<16}{on:>14.1f}{off:>15.1f}{on / off:>9.2f}")
    print(f"candidate-set size (mean per token): {results['mask_on']['support_size_mean']:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "overrides": args.overrides, **results}, indent=2))


if __name__ == "__main__":
    main()
