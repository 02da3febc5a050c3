"""Per-rank training memory of SmolLM2-135M under `parallel=fsdp` at world 1 / 2 / 4 (and Megatron CP=2 x DP with
and without `parallel.distributed_optimizer`), measured inside real `train.py` runs on CPU (issue 21 part 7).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_memory.py [--arms w1,fsdp2,fsdp4,cp2,cp2dp2,cp2dp2_distopt] \
        [--steps 2 --prompts 4 --samples 2 --new-tokens 8 --micro-tokens 24] [--out docs/results/memory]

Each arm is one `train.py model=smollm2 rollout.top_p=0.9 callbacks=minimal logger=csv` subprocess (Lightning
starts the other ranks) with two extra callbacks: `LogProbMismatch` (the masked train / rollout
mismatch, which `callbacks=minimal` lacks) and `MemoryProbe` (this file, added as `+callbacks.memory`), which
sums `numel * element_size` over the tensors each rank actually holds (DTensors: their local shard):
- params: the policy's parameters (`PolicyModule.parameters()`; FSDP: the 1/W shards between uses);
- grads: at the optimizer step (after FSDP's reduce-scatter: the shard; Megatron: `main_grad`, the DDP's full
  gradient buffer, which ZeRO-1 does not shard), and the peak over the step's micro-batches (`on_after_backward`:
  FSDP2 keeps full unsharded gradients until the last micro-batch's reduce-scatter);
- optimizer state: AdamW's moments + step counters (`ShardedOptimizer.state_bytes()` for the distributed
  optimizer), read after the step;
- engine copy: parameters of a rollout engine model that the policy does not share (Megatron's HF engine copy on
  the rollout source rank; 0 under FSDP's shared engine);
- RSS now (VmRSS at the step's end) and peak RSS (`ru_maxrss`, as `perf/peak_rss_mb`, but per rank). The runs get
  `MALLOC_MMAP_THRESHOLD_=65536` (`--mmap-threshold`): with glibc's default dynamic threshold, freed layer-sized
  blocks (gathered weights, full gradients) stay in the heap and RSS never comes down from its high-water mark.
`data.max_tokens_per_micro_batch` is small (default 24) so that each rank accumulates over several micro-batches
and the full-gradient peak shows. Figures are from the last step (the optimizer state exists from the first step).

Writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
ARMS = {  # name -> (world, overrides)
    "w1": (1, ["parallel=none", "trainer.devices=1"]),
    "fsdp2": (2, ["parallel=fsdp", "trainer.devices=2"]),
    "fsdp4": (4, ["parallel=fsdp", "trainer.devices=4"]),
    "cp2": (2, ["parallel=cp2", "trainer.devices=2"]),
    "cp2dp2": (4, ["parallel=cp2", "trainer.devices=4"]),
    "cp2dp2_distopt": (4, ["parallel=cp2", "trainer.devices=4", "parallel.distributed_optimizer=true"]),
}
LABELS = {"w1": "world 1 (parallel=none)", "fsdp2": "FSDP world 2", "fsdp4": "FSDP world 4",
          "cp2": "Megatron CP2 (world 2)", "cp2dp2": "Megatron CP2 x DP2 (world 4)",
          "cp2dp2_distopt": "Megatron CP2 x DP2 + dist. optimizer"}
# What sharding should give: world 1's (params, grads, optimizer state) divided by these. CP replicates weights;
# the distributed optimizer shards AdamW over DP x CP only (its float32 gradient buffer stays whole).
SHARDS = {"w1": (1, 1, 1), "fsdp2": (2, 2, 2), "fsdp4": (4, 4, 4), "cp2": (1, 1, 1), "cp2dp2": (1, 1, 1),
          "cp2dp2_distopt": (1, 1, 4)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _grads(module) -> list[torch.Tensor]:
    out = []
    for p in module.parameters():
        g = getattr(p, "main_grad", None)  # megatron DDP: a view into its gradient buffer; .grad stays None
        g = p.grad if g is None else g
        if g is not None:
            out.append(g)
    return out


def _fsdp_unsharded_grads(module) -> list[torch.Tensor]:
    """FSDP2's full gradients between micro-batches (gradient sync off): they hang on the unsharded parameters,
    which `module.parameters()` does not show. Reads FSDP2 internals (torch 2.13): a benchmark may, code may not."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    unsharded = getattr(fp, "_unsharded_param", None)
                    out += [g for g in (getattr(unsharded, "grad", None), fp.unsharded_accumulated_grad)
                            if g is not None]
    return out


def _optimizer_state_bytes(opt) -> int:
    if hasattr(opt, "state_bytes"):  # topp_rl.megatron.dist_opt.ShardedOptimizer: shards + master weights
        return int(opt.state_bytes())
    return _bytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class MemoryProbe(Callback):
    """Records, per step, the bytes this rank holds (module docstring); writes `<out>/rank<r>.json` at the end."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.rows: list[dict] = []
        self.grad_peak = 0
        self.grad_at_step = 0
        self.backwards = 0  # micro-batches this step

    def on_after_backward(self, trainer, pl_module) -> None:
        held = _bytes(_grads(pl_module)) + _bytes(_fsdp_unsharded_grads(pl_module))
        self.grad_peak = max(self.grad_peak, held)
        self.backwards += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grad_at_step = _bytes(_grads(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        params = list(pl_module.parameters())
        own = {id(p) for p in params}
        engine = getattr(trainer.datamodule, "engine", None)
        engine_model = getattr(engine, "model", None)
        engine_copy = 0 if engine_model is None else _bytes(p for p in engine_model.parameters() if id(p) not in own)
        self.rows.append({
            "step": trainer.global_step, "params": _bytes(params), "grads_at_step": self.grad_at_step,
            "grads_peak": self.grad_peak, "micro_batches": self.backwards, "optimizer_state": sum(map(_optimizer_state_bytes, trainer.strategy.optimizers)),
            "engine_copy": engine_copy, "rss_now": _rss_now(),
            "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
        })
        self.grad_peak = self.backwards = 0
        print(f"[bench_memory] rank {trainer.global_rank} step {trainer.global_step}: "
              + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.rows[-1].items() if isinstance(v, int) and k not in ("step", "micro_batches"))
              + f", {self.rows[-1]['micro_batches']} micro-batches",
              flush=True)

    def on_train_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows, indent=1))


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    (path,) = run_dir.glob("csv/*/metrics.csv")
    with path.open() as f:
        return list(csv.DictReader(f))


def run_arm(args, name: str, run_dir: Path) -> dict:
    world, overrides = ARMS[name]
    cmd = [sys.executable, str(ROOT / "train.py"), "model=smollm2", "rollout.top_p=0.9", "callbacks=minimal",
           "logger=csv", "checkpoint.every_n_steps=0", "trainer.enable_progress_bar=false",
           f"trainer.max_steps={args.steps}", f"rollout.prompts_per_step={args.prompts}",
           f"rollout.n_samples={args.samples}", f"rollout.max_new_tokens={args.new_tokens}",
           f"data.max_tokens_per_micro_batch={args.micro_tokens}", f"hydra.run.dir={run_dir}",
           "+callbacks.log_prob_mismatch._target_=topp_rl.callbacks.LogProbMismatch",  # the masked mismatch
           "+callbacks.memory._target_=bench_memory.MemoryProbe", f"+callbacks.memory.out={run_dir}/memory",
           *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]),
           "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    if args.mmap_threshold:  # glibc returns freed blocks above it to the OS at once: RSS then tracks live tensors
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    start, load = time.perf_counter(), os.getloadavg()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    out = {"world": world, "overrides": overrides, "process_wall_s": round(wall, 1),
           "load_average": [[round(x, 2) for x in load], [round(x, 2) for x in os.getloadavg()]],
           "command": " ".join(["python", "train.py", *cmd[2:]])}
    if proc.returncode:
        tail = [line for line in (proc.stderr or proc.stdout).strip().splitlines()
                if not line.startswith("Set the environment variable HYDRA_FULL_ERROR")][-15:]
        return out | {"error": "\n".join(tail)}
    out["ranks"] = [json.loads((run_dir / "memory" / f"rank{r}.json").read_text())[-1] for r in range(world)]
    rows = read_metrics(run_dir)

    def col(key):
        return [float(r[key]) for r in rows if r.get(key)]

    out["step_s"] = col("perf/step_s")
    out["mismatch_mean"] = col("train/rollout_logprob_abs_diff")
    out["mismatch_max"] = col("train/rollout_logprob_abs_diff_max")
    out["loss"] = col("train/loss")
    return out


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "load_average_start": [round(x, 2) for x in os.getloadavg()],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def rank_total(r: dict) -> int:
    return r["params"] + r["grads_at_step"] + r["optimizer_state"]


def ideal_total(base: dict, name: str) -> float:
    p, g, o = SHARDS[name]
    return base["params"] / p + base["grads_at_step"] / g + base["optimizer_state"] / o


def markdown(res: dict) -> str:
    base = res["arms"].get("w1", {}).get("ranks", [None])[0]
    lines = [f"SmolLM2-135M, float32, AdamW; {res['settings']}. MiB per rank (max over ranks); ratio: to world 1; "
             "ideal: world 1's parts divided by what the arm shards them over.", "",
             "| arm | params | grads at step | grads peak (micro-batches) | optimizer state | total (params + grads "
             "at step + state) | vs world 1 | ideal | engine copy | RSS at step end | peak RSS | step s | masked "
             "mismatch max |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, arm in res["arms"].items():
        if "error" in arm:
            lines.append(f"| {LABELS[name]} | failed: {arm['error'].splitlines()[-1][:120]} |" + " |" * 11)
            continue
        rk = arm["ranks"]

        def mx(key, rk=rk):
            return max(r[key] for r in rk)

        total = max(map(rank_total, rk))
        ratio = f"{total / rank_total(base):.3f}" if base else ""
        ideal = f"{ideal_total(base, name) / rank_total(base):.3f}" if base else ""
        step_s = statistics.median(arm["step_s"][1:] or arm["step_s"])
        lines.append(f"| {LABELS[name]} | {mib(mx('params'))} | {mib(mx('grads_at_step'))} | {mib(mx('grads_peak'))} "
                     f"| {mib(mx('optimizer_state'))} | {mib(total)} | {ratio} | {ideal} | {mib(mx('engine_copy'))} "
                     f"| {mib(mx('rss_now'))} | {mib(mx('rss_peak'))} | {step_s:.1f} "
                     f"| {max(arm['mismatch_max'], default=float('nan')):.2g} |")
    m = res["machine"]
    lines += ["", f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, torch {m['torch']}; load average "
              f"{m['load_average_start']} at the start, {m.get('load_average_end')} at the end; {m['date']}."]
    lines += [f"Arms {', '.join(e.get('arms', []))} (kept from an earlier run): load average {e['load_average_start']} at "
              f"the start, {e.get('load_average_end')} at the end; {e['date']}." for e in res.get("earlier_machine", [])]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [(n, a) for n, a in res["arms"].items() if "ranks" in a]
    if not arms:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(arms)), 4))
    xs = range(len(arms))
    bottom = [0.0] * len(arms)
    for key, label in (("params", "params"), ("grads_at_step", "grads (at step)"), ("optimizer_state", "AdamW state")):
        vals = [max(r[key] for r in a["ranks"]) / 2**20 for _, a in arms]
        ax.bar(xs, vals, bottom=bottom, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.scatter(xs, [max(r["rss_peak"] for r in a["ranks"]) / 2**20 for _, a in arms], marker="_", s=600, color="k",
               label="peak RSS", zorder=3)
    base = res["arms"].get("w1", {}).get("ranks")
    if base:
        ax.scatter(xs, [ideal_total(base[0], n) / 2**20 for n, _ in arms], marker="x", color="r",
                   label="ideal (world 1's, sharded)", zorder=3)
    ax.set_xticks(list(xs), [LABELS[n].replace(" (", "\n(").replace(" + ", "\n+ ") for n, _ in arms], fontsize=8)
    ax.set_ylabel("MiB per rank (max over ranks)")
    ax.set_title("SmolLM2-135M training state per rank, CPU (gloo)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("steps", 2), ("prompts", 4), ("samples", 2), ("new-tokens", 8), ("micro-tokens", 24)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--arms", default="w1,fsdp2,fsdp4")
    parser.add_argument("--mmap-threshold", type=int, default=65536,
                        help="MALLOC_MMAP_THRESHOLD_ for the runs (0: glibc's default, whose dynamic threshold keeps "
                             "freed layer-sized blocks in the heap, so RSS stays at its high-water mark)")
    parser.add_argument("--replot", action="store_true", help="rewrite <out>.md and <out>.png from <out>.json, run nothing")
    parser.add_argument("--keep", action="store_true", help="merge into <out>.json's arms (re-measure some only)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "memory")
    args = parser.parse_args()
    if args.replot:
        res = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(markdown(res))
        plot(res, args.out.with_suffix(".png"))
        print(markdown(res))
        return
    res = {"machine": machine(), "argv": sys.argv[1:], "arms": {},
           "settings": f"{args.steps} steps, {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new "
                       f"tokens per step, micro-batches of <= {args.micro_tokens} tokens, MALLOC_MMAP_THRESHOLD_="
                       f"{args.mmap_threshold or 'unset'}"}
    if args.keep and args.out.with_suffix(".json").exists():
        old = json.loads(args.out.with_suffix(".json").read_text())
        res["arms"] = old["arms"]
        res["earlier_machine"] = old.get("earlier_machine", []) + [old["machine"]]  # the kept arms' machine lines
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        for name in args.arms.split(","):
            print(f"[{time.perf_counter() - start:6.0f} s] {name}: {' '.join(ARMS[name][1])} ...", flush=True)
            arm = run_arm(args, name, Path(tmp) / name)
            res["arms"][name] = arm
            if "error" in arm:
                print(f"  failed:\n{arm['error']}", flush=True)
            else:
                r = max(arm["ranks"], key=rank_total)
                print(f"  {arm['process_wall_s']} s; per rank: params {mib(r['params'])}, grads {mib(r['grads_at_step'])}"
                      f" (peak {mib(r['grads_peak'])}), state {mib(r['optimizer_state'])} MiB, peak RSS "
                      f"{mib(r['rss_peak'])} MiB", flush=True)
            res["arms"] = dict(sorted(res["arms"].items(), key=lambda kv: list(ARMS).index(kv[0])))
            res["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
            args.out.with_suffix(".md").write_text(markdown(res))
            plot(res, args.out.with_suffix(".png"))
    print(markdown(res))


if __name__ == "__main__":
    main()
