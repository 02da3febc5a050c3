"""Rollout routing replay on a tiny Qwen3-MoE: train / rollout mismatch per precision, replay and mask, and the
step time of the MoE model on the HF and Megatron backbones (issue 20 parts 5 and 6), on CPU.

    .venv/bin/python benchmarks/bench_routing_replay.py [--seeds 3 --steps 3 --speed-repeats 3 --speed-steps 6] \
        [--out docs/results/routing_replay]

Accuracy grid: every (precision, rollout.routing_replay, module.use_mask, seed) cell is one short in-process run
of the real Trainer (`train.py model=tiny model.family=qwen3_moe rollout.top_p=0.9`, the default embedded engine
and callbacks) on a Qwen3-MoE bigger than the default tiny one (`--layers 4 --experts 8`, top-2, and 8 new
tokens per sample instead of 2, so that more tokens cross more routers). Per run: the step means of
`train/routing_agreement`, `train/kl_k3_rollout`, `train/rollout_extreme_frac`, `train/rollout_logprob_abs_diff`
(masked and unmasked) and the step max of `train/rollout_logprob_abs_diff_max`; per cell the median over seeds.
Precisions: fp32 (`trainer=cpu`), bf16 (`trainer=cpu_bf16`) and fp16 (`trainer=cpu_fp16`: float16 autocast
with a loss scale, `topp_rl.trainer.precision.LossScaledFP16`).

Which side runs in 16 bits is recorded, not assumed: the script wraps the engine's decode batch and the
trainer's on-policy pass and records whether CPU autocast is on and the dtype of the final hidden states.

Speed: `train.py` subprocesses (CSV logger, `callbacks=minimal`, float32), interleaved per repeat: HF backbone
with replay off and on, Megatron backbone at ep1 (`parallel=megatron trainer.devices=1`) and ep2 (`parallel=ep2`,
2 gloo ranks, each sampling and training half the prompts). Figures: median `perf/step_s` (the whole step,
generation included: the same HF engine for every arm) and of `perf/old_logprob_s + perf/optim_s` (the trainer
part, which the backbone changes) over each run's steps after the first (warm-up), then the median over repeats; Megatron is measured with replay off (its replay is
not wired yet). On a 2-core machine the two ep2 ranks take both cores.

Writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PRECISIONS = {"fp32": "trainer=cpu", "bf16": "trainer=cpu_bf16", "fp16": "trainer=cpu_fp16"}
MEANS = {  # column -> metric averaged over a run's steps
    "agreement": "train/routing_agreement",
    "kl_k3": "train/kl_k3_rollout",
    "extreme_frac": "train/rollout_extreme_frac",
    "mismatch_mean": "train/rollout_logprob_abs_diff",
    "mismatch_mean_unmasked": "train/rollout_logprob_abs_diff_unmasked",
}
MAXES = {"mismatch_max": "train/rollout_logprob_abs_diff_max"}
COLUMNS = (*MEANS, *MAXES)
SPEED_ARMS = {
    "HF, replay off": ["rollout.routing_replay=false"],
    "HF, replay on": ["rollout.routing_replay=true"],
    "Megatron ep1 (1 rank)": ["parallel=megatron", "trainer.devices=1", "rollout.routing_replay=false"],
    "Megatron ep2 (2 ranks)": ["parallel=ep2", "rollout.routing_replay=false"],
}


def model_overrides(args) -> list[str]:
    return ["model=tiny", "model.family=qwen3_moe", f"model.layers={args.layers}", f"model.hidden={args.hidden}",
            f"+model.num_experts={args.experts}", f"+model.num_experts_per_tok={args.top_k}",
            "rollout.top_p=0.9", f"rollout.max_new_tokens={args.max_new_tokens}"]


class Probe:
    """Records whether CPU autocast is on, and the hidden states' dtype, in the engine and in the trainer."""

    current: Probe | None = None

    def __init__(self) -> None:
        self.seen: dict[str, set[str]] = {"engine": set(), "trainer": set()}

    def install(self, run) -> None:
        from topp_rl.engines.embedded import EmbeddedEngine

        probe = self
        Probe.current = self  # the engine's class is patched once; each run's probe records
        decode = EmbeddedEngine._decode
        if not getattr(decode, "_probed", False):
            def _decode(engine, *a, **kw):
                dtype = next(engine.model.parameters()).dtype
                Probe.current.seen["engine"].add(f"autocast={torch.is_autocast_enabled('cpu')} weights={dtype}")
                return decode(engine, *a, **kw)

            _decode._probed = True
            EmbeddedEngine._decode = _decode
        onpolicy = run.module.onpolicy_from_hidden

        def onpolicy_from_hidden(batch, hidden, weight):
            autocast = torch.is_autocast_enabled("cpu")
            dtype = torch.get_autocast_dtype("cpu") if autocast else None
            probe.seen["trainer"].add(f"autocast={autocast}{f' ({dtype})' if autocast else ''} hidden={hidden.dtype}")
            return onpolicy(batch, hidden, weight)

        run.module.onpolicy_from_hidden = onpolicy_from_hidden


def accuracy_run(args, *, precision: str, replay: bool, mask: bool, seed: int, probe: Probe) -> dict:
    from hydra import compose, initialize_config_dir
    from lightning.pytorch.callbacks import Callback

    from topp_rl.train import build_run, fit

    class Grab(Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    with tempfile.TemporaryDirectory(prefix="bench_routing_replay_") as tmp:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[
                *model_overrides(args), PRECISIONS[precision], f"seed={seed}", f"trainer.max_steps={args.steps}",
                f"rollout.routing_replay={str(replay).lower()}", f"module.use_mask={str(mask).lower()}",
                "logger=none", "checkpoint.every_n_steps=0", "export.hf=false", "trainer.enable_progress_bar=false",
                "callbacks.completions=null", f"paths.output_dir={tmp}",
            ])
        torch.set_num_threads(int(cfg.num_threads))
        run = build_run(cfg)
        probe.install(run)
        grab = Grab()
        run.trainer.callbacks.append(grab)
        fit(run)
    rows = grab.rows
    out = {c: statistics.fmean(r[m] for r in rows) for c, m in MEANS.items()}
    out |= {c: max(r[m] for r in rows) for c, m in MAXES.items()}
    out["grad_norm_step0"] = rows[0]["train/grad_norm"]
    return out


def read_step_times(run_dir: Path) -> list[tuple[float, float]]:
    """(whole step, trainer part: old-log-prob pass + optimisation) per step, in seconds."""
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as f:
        return [(float(r["perf/step_s"]), float(r["perf/old_logprob_s"]) + float(r["perf/optim_s"]))
                for r in csv.DictReader(f) if r.get("perf/step_s")]


def speed_run(args, arm: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "train.py"), *model_overrides(args), "trainer=cpu",
           f"trainer.max_steps={args.speed_steps}", "logger=csv", "callbacks=minimal", "checkpoint.every_n_steps=0",
           f"hydra.run.dir={run_dir}", *arm]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - start
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"}
    times = read_step_times(run_dir)[1:] or read_step_times(run_dir)  # the first step is warm-up
    return {"step_s": statistics.median(t[0] for t in times), "train_s": statistics.median(t[1] for t in times),
            "process_wall_s": wall}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "load_average_start": [round(x, 2) for x in os.getloadavg()],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def markdown(res: dict) -> str:
    lines = [f"Qwen3-MoE tiny: {res['model']}; {res['steps']} steps per run, seeds {res['seeds']}; medians over "
             "seeds of per-run step means (max: of per-run step maxima).", "",
             "| precision | replay | mask | routing agreement | k3 KL | extreme frac | mismatch mean | mismatch max "
             "| unmasked mean |", "|---|---|---|---|---|---|---|---|---|"]
    for cell in res["cells"]:
        m = cell["median"]
        lines.append(f"| {cell['precision']} | {'on' if cell['replay'] else 'off'} | {'on' if cell['mask'] else 'off'} "
                     f"| {m['agreement']:.4f} | {fmt(m['kl_k3'])} | {fmt(m['extreme_frac'])} | {fmt(m['mismatch_mean'])} "
                     f"| {fmt(m['mismatch_max'])} | {fmt(m['mismatch_mean_unmasked'])} |")
    lines += ["", "Where the 16 bits are (recorded during the runs):", ""]
    lines += [f"- {prec}: engine {', '.join(sorted(p['engine']))}; trainer {', '.join(sorted(p['trainer']))}"
              for prec, p in res["probe"].items()]
    if res.get("speed"):
        sp = res["speed"]
        base = sp["arms"]["HF, replay off"].get("step_s")
        base_train = sp["arms"]["HF, replay off"].get("train_s")
        lines += ["", f"Step time (float32, {sp['steps']} steps per run, median of the steps after the first, then "
                  f"of {sp['repeats']} interleaved repeats):", "", "| arm | step s | vs HF replay off | trainer part s | vs HF replay off | step s per repeat |",
                  "|---|---|---|---|---|---|"]
        for name, arm in sp["arms"].items():
            if "step_s" not in arm:
                lines.append(f"| {name} | failed: {arm.get('error')} | | | | |")
                continue
            reps = " / ".join(f"{r['step_s']:.3f}" if "step_s" in r else "fail" for r in arm["repeats"])
            ratio = f"{arm['step_s'] / base:.2f}" if base else ""
            ratio_train = f"{arm['train_s'] / base_train:.2f}" if base_train else ""
            lines.append(f"| {name} | {arm['step_s']:.3f} | {ratio} | {arm['train_s']:.3f} | {ratio_train} | {reps} |")
        lines += ["", f"Routes carried per token: {sp['routes_bytes_per_token']} B ({sp['routes_desc']})."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in res["cells"] if c["mask"]]
    precs = list(dict.fromkeys(c["precision"] for c in cells))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, title, log in ((axes[0], "agreement", "routing agreement", False),
                                (axes[1], "mismatch_mean", "masked |train - rollout| mean", True),
                                (axes[2], "mismatch_max", "masked |train - rollout| max", True)):
        for j, replay in enumerate((False, True)):
            vals = [next(c["median"][key] for c in cells if c["precision"] == p and c["replay"] == replay)
                    for p in precs]
            ax.bar([i + 0.38 * j for i in range(len(precs))], vals, width=0.38,
                   label=f"replay {'on' if replay else 'off'}")
        ax.set_xticks([i + 0.19 for i in range(len(precs))], precs)
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(0.98, 1.0005)  # agreement sits within 1% of 1
    axes[0].legend(fontsize=8)
    fig.suptitle(f"tiny Qwen3-MoE ({res['model']}), mask on, top_p 0.9, median of {len(res['seeds'])} seeds",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("seeds", 3), ("steps", 3), ("layers", 4), ("hidden", 64), ("experts", 8), ("top-k", 2),
                          ("max-new-tokens", 8), ("speed-repeats", 3), ("speed-steps", 6)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--parts", default="accuracy,speed",
                        help="'speed' alone re-measures the step times and keeps <out>.json's accuracy grid")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "routing_replay")
    args = parser.parse_args()
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    seeds = list(range(args.seeds))
    res = {"machine": machine(), "steps": args.steps, "seeds": seeds, "argv": sys.argv[1:],
           "model": f"{args.layers} layers, hidden {args.hidden}, {args.experts} experts top-{args.top_k}, "
                    f"{args.max_new_tokens} new tokens", "cells": [], "probe": {}}
    start = time.perf_counter()

    def save() -> None:
        res["elapsed_s"] = round(time.perf_counter() - start, 1)
        res["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(res, indent=2, default=sorted))
        args.out.with_suffix(".md").write_text(markdown(res))

    parts = set(args.parts.split(","))
    if "accuracy" not in parts:  # keep the grid already measured (its own machine figures and date)
        old = json.loads(args.out.with_suffix(".json").read_text())
        res |= {k: old[k] for k in ("cells", "probe", "steps", "seeds", "model")}
        res["accuracy_machine"] = old.get("accuracy_machine", old["machine"])
    for precision in args.precisions.split(",") if "accuracy" in parts else []:
        probe = Probe()
        for replay in (False, True):
            for mask in (True, False):
                runs = []
                for seed in seeds:
                    runs.append(accuracy_run(args, precision=precision, replay=replay, mask=mask, seed=seed,
                                             probe=probe))
                median = {c: statistics.median(r[c] for r in runs) for c in (*COLUMNS, "grad_norm_step0")}
                res["cells"].append({"precision": precision, "replay": replay, "mask": mask, "median": median,
                                     "runs": runs})
                print(f"[{time.perf_counter() - start:6.0f} s] {precision} replay={'on ' if replay else 'off'} "
                      f"mask={'on ' if mask else 'off'}: agreement {median['agreement']:.4f}, k3 "
                      f"{fmt(median['kl_k3'])}, extreme {fmt(median['extreme_frac'])}, mismatch mean "
                      f"{fmt(median['mismatch_mean'])} max {fmt(median['mismatch_max'])}", flush=True)
        res["probe"][precision] = probe.seen
        save()
    plot(res, args.out.with_suffix(".png"))

    if args.speed_repeats and "speed" in parts:
        from topp_rl.data.routes import MoeRouting

        routing = MoeRouting(layer_ids=tuple(range(args.layers)), top_k=args.top_k, num_experts=args.experts,
                             num_hidden_layers=args.layers)
        speed = {"steps": args.speed_steps, "repeats": args.speed_repeats,
                 "routes_bytes_per_token": routing.bytes_per_token,
                 "routes_desc": f"{routing.num_layers} MoE layers x top-{routing.top_k} x "
                                f"{routing.dtype.itemsize} B ({str(routing.dtype).removeprefix('torch.')})",
                 "arms": {name: {"repeats": []} for name in SPEED_ARMS}}
        res["speed"] = speed
        with tempfile.TemporaryDirectory(prefix="bench_routing_speed_") as tmp:
            for rep in range(args.speed_repeats):  # interleaved: a load change hits every arm
                for i, (name, arm) in enumerate(SPEED_ARMS.items()):
                    r = speed_run(args, arm, Path(tmp) / f"{rep}-{i}")
                    speed["arms"][name]["repeats"].append(r)
                    print(f"[{time.perf_counter() - start:6.0f} s] speed {name} repeat {rep}: "
                          f"{r.get('step_s', r.get('error'))}", flush=True)
        for arm in speed["arms"].values():
            ok = [r for r in arm["repeats"] if "step_s" in r]
            if ok:
                arm["step_s"] = statistics.median(r["step_s"] for r in ok)
                arm["train_s"] = statistics.median(r["train_s"] for r in ok)
            else:
                arm["error"] = arm["repeats"][0].get("error")
    save()
    print(markdown(res))


if __name__ == "__main__":
    main()
