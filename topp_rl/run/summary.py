"""The end-of-run summary: a few figures kept during the run (`RunSummary`), what the run leaves behind
(checkpoints, the HF export and a LoRA run's adapter dir, the last evaluation), `summary.json`, and the console
lines.

The console lines name only what exists: a logger directory, `hf/`, `hf_adapter/`, `best.ckpt` or the report
command appear when the run wrote them (`logger=none` writes no `csv/`, so neither it nor the report command is
named). The report command is the one that works from where the run started (`topp_rl.run.commands`).
"""

import json
import math
import shlex
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from topp_rl.run.checkpoint import LastCheckpoint
from topp_rl.run.commands import report_command
from topp_rl.run.export import HFExport
from topp_rl.run.sweep import run_dir_override

MISMATCH = "train/rollout_logprob_abs_diff"  # mean |train - rollout| log-prob, candidate mask on
SUMMARY_KEYS = ("rollout/reward_mean", MISMATCH, f"{MISMATCH}_unmasked", f"{MISMATCH}_max")
# Per logger directory a run may hold: what the summary says about it.
LOGGER_DIRS = (("csv", "metrics.csv"), ("tensorboard", "tensorboard --logdir"), ("wandb", "W&B"))


class RunSummary(Callback):
    """Keeps the per-step history of a few logged metrics for the end-of-run summary (reads, never logs)."""

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {k: [] for k in SUMMARY_KEYS}
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for key in SUMMARY_KEYS:
            value = trainer.callback_metrics.get(key)
            if value is not None:
                self.history[key].append(float(value))

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {"wall_s": time.perf_counter() - self.start}
        rewards = self.history["rollout/reward_mean"]
        if rewards:
            k = max(1, len(rewards) // 5)  # mean of the first / last fifth: single steps are noisy
            out["reward_first"] = sum(rewards[:k]) / k
            out["reward_last"] = sum(rewards[-k:]) / k
        for key in SUMMARY_KEYS[1:]:
            values = self.history[key]
            if values:
                out[key] = max(values) if key.endswith("_max") else sum(values) / len(values)
        if self.history[MISMATCH]:
            out["mismatch_last"] = self.history[MISMATCH][-1]  # the sweep table's column: where training ended
        return out


def outputs_summary(trainer, run_dir) -> dict[str, float | str]:
    """What the run resumed from and leaves: `last.ckpt` and the HF export with their steps (the last evaluation's
    figures are the evaluation callback's own `summary()`, added by `topp_rl.train`)."""
    out: dict[str, float | str] = {}
    if run_dir.resume_from is not None:
        out |= {"resumed_from": str(run_dir.resume_from), "resumed_step": run_dir.resume_step}
    for callback in trainer.callbacks:
        if isinstance(callback, LastCheckpoint) and callback.saved_step is not None:
            out |= {"checkpoint": str(callback.path), "checkpoint_step": callback.saved_step}
        elif isinstance(callback, HFExport) and callback.exported_step is not None:
            out |= export_summary(callback)
    return out


def export_summary(export: HFExport) -> dict[str, float | str]:
    """Every dir the export wrote, with its step: `hf_export` (the model, merged for LoRA) and `adapter_export`
    (a LoRA run's adapters); a dir not written (`export.merge_lora=false`) is not named."""
    keys = {"model": "hf_export", "adapters": "adapter_export"}
    out: dict[str, float | str] = {}
    for kind, path in export.exported_dirs.items():
        out |= {keys[kind]: str(path), f"{keys[kind]}_step": export.exported_step}
    return out


def write_summary(summary: dict[str, float | str], path: Path) -> None:
    """The printed summary as JSON (NaN / inf written as strings: JSON has no such numbers)."""
    values = {k: v if isinstance(v, str) or math.isfinite(v) else str(v) for k, v in summary.items()}
    path.write_text(json.dumps(values, indent=2) + "\n")


def print_summary(summary: dict[str, float | str], output_dir: str) -> None:
    print("\n".join(summary_lines(summary, output_dir)), flush=True)


def summary_lines(summary: dict[str, float | str], output_dir: str) -> list[str]:
    run_dir = Path(output_dir)
    lines = [f"[topp_rl] run finished: {summary['steps']} steps in {summary['wall_s']:.0f} s; run dir: {output_dir}"]
    if "reward_first" in summary:
        lines.append(f"  reward mean: first {summary['reward_first']:.3f} -> last {summary['reward_last']:.3f}")
    for key in SUMMARY_KEYS[1:]:
        if key in summary:  # NaN / inf included: a summary must never hide them
            lines.append(f"  {key}: {summary[key]:.3g}")
    if "eval_step" in summary:
        figures = ", ".join(f"{k} {v:.3g}" for k, v in summary.items() if k.startswith("val/"))
        lines.append(f"  eval at step {summary['eval_step']} ({summary['eval_set']}, {summary['eval_prompts']} "
                     f"prompts): {figures}")
    if "best_checkpoint" in summary:
        lines.append(f"  best {summary['best_metric']}: {summary['best_value']:.3g} at step {summary['best_step']}: "
                     f"{summary['best_checkpoint']}")
    if "resumed_from" in summary:
        lines.append(f"  resumed from: {summary['resumed_from']} (step {summary['resumed_step']})")
    if "checkpoint" in summary:
        lines.append(f"  checkpoint: {summary['checkpoint']} (step {summary['checkpoint_step']}); resume with "
                     f"{run_dir_override(output_dir)} ckpt_path=last")
    if "hf_export" in summary and Path(summary["hf_export"]).is_dir():
        lines.append(f"  HF checkpoint: {summary['hf_export']} (step {summary['hf_export_step']}; loads with "
                     "transformers' from_pretrained)")
    if "adapter_export" in summary and Path(summary["adapter_export"]).is_dir():
        lines.append(f"  LoRA adapters: {summary['adapter_export']} (step {summary['adapter_export_step']}; PEFT's "
                     "format: PeftModel.from_pretrained(base model, dir))")
    logs = [f"{name}/ ({what})" for name, what in LOGGER_DIRS if (run_dir / name).is_dir()]
    files = ["summary.json"] if (run_dir / "summary.json").is_file() else []
    if files or logs:
        lines.append(f"  in the run dir: {', '.join(files + logs)}")
    if (run_dir / "csv").is_dir():
        lines.append(f"  plots: {report_command()} {shlex.quote(output_dir)}")
    return lines
