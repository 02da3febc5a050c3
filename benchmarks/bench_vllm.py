"""vLLM against the SGLang CPU server and the embedded engine, in one run on one model: generated tokens per second
at batch 1 and 16, weight-sync seconds, and one whole RL step through the real Trainer.

    .venv/bin/python benchmarks/bench_vllm.py [--reps 3] [--steps 3] [--smollm2] [--engines vllm sglang embedded]
                                              [--json out.json]

Every arm samples top_p 0.9, top_k 20, float32, with its kept sets recorded (what a rollout step costs), EOS ignored
so every sample runs to `--new-tokens`. Servers run one at a time, each launched, warmed up with one call and
stopped before the next. Tokens/s: the median over `--reps` calls of a batch of equal prompts sent at once. Weight
sync: the median over `--reps` pushes of the model's weights (`WeightSyncStats.seconds`; the embedded engine's
in-process copy timed around `update_weights`). RL step: `train.py algo=grpo rollout.top_p=0.9 rollout.top_k=20`
with `rollout=<engine>` for `--steps` steps (the first is warm-up), the median of the later steps' wall time from
the previous step's end (generation, old log-probs, optimisation, weight sync; bench_train_step's `StepTimer`).
The tiny model gets 2 heads (head size 32: vLLM's CPU attention has no 16). Needs $TOPP_RL_VLLM_PYTHON and
$TOPP_RL_SGLANG_PYTHON for the server arms.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_train_step import StepTimer
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from topp_rl.data.params import SamplingParams
from topp_rl.models import save_model
from topp_rl.train import build_run, fit, process_settings

CONF = Path(__file__).resolve().parents[1] / "conf"
TINY = ("model.heads=2", "model.kv_heads=1")
SMOLLM2 = ("model=smollm2",)
ENGINES = ("vllm", "sglang", "embedded")


def config(tmp: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[
            "algo=grpo", "rollout.top_p=0.9", "rollout.top_k=20", "logger=none", "checkpoint.every_n_steps=0",
            "trainer.enable_progress_bar=false", f"paths.output_dir={tmp}", *overrides,
        ])  # fmt: skip


# A busy 2-core machine can take minutes for a batch of SmolLM2 requests on the SGLang CPU server: bounds that
# measure rather than abort.
PATIENT = {"first_byte_s": 900, "per_token_s": 5}
SERVER_TIMEOUT = (f"rollout.engine.timeouts.first_byte_s={PATIENT['first_byte_s']}",
                  f"rollout.engine.timeouts.per_token_s={PATIENT['per_token_s']}")  # fmt: skip


def make_engine(name: str, model, model_dir: Path):
    if name == "vllm":
        from topp_rl.engines.vllm import VLLMEngine

        return VLLMEngine(model_path=model_dir, progress=False, extra_sampling_params={"ignore_eos": True},
                          timeouts=PATIENT)  # fmt: skip
    if name == "sglang":
        from topp_rl.engines.sglang import SGLangEngine

        return SGLangEngine(model_path=model_dir, progress=False, extra_sampling_params={"ignore_eos": True},
                            timeouts=PATIENT)  # fmt: skip
    from topp_rl.engines.embedded import EmbeddedEngine

    return EmbeddedEngine(model, progress=False)  # no eos_token_id: every sample runs to max_new_tokens


def median_of(reps: int, call: Callable[[], float]) -> tuple[float, list[float]]:
    values = [call() for _ in range(reps)]
    return statistics.median(values), values


def engine_figures(name: str, model, model_dir: Path, *, reps: int, prompt_len: int, new_tokens: int) -> dict:
    """Tokens/s at batch 1 and 16 and weight-sync seconds of one engine (launched, measured, closed)."""
    params = SamplingParams(top_p=0.9, top_k=20, max_new_tokens=new_tokens)
    prompt = [(7 * i) % (model.config.vocab_size - 3) + 3 for i in range(prompt_len)]
    out: dict = {}
    start = time.monotonic()
    with make_engine(name, model, model_dir) as engine:
        out["start_s"] = time.monotonic() - start
        engine.generate([prompt], params, seed=0)  # warm-up
        for batch in (1, 16):

            def rate(batch: int = batch) -> float:
                t = time.perf_counter()
                samples = engine.generate([prompt] * batch, params, seed=1)
                return sum(s.response_length for s in samples) / (time.perf_counter() - t)

            out[f"tokens_per_s_b{batch}"], out[f"tokens_per_s_b{batch}_reps"] = median_of(reps, rate)

        def sync() -> float:
            t = time.perf_counter()
            stats = engine.update_weights(model.named_parameters())
            return stats.seconds if stats is not None else time.perf_counter() - t

        out["weight_sync_s"], out["weight_sync_s_reps"] = median_of(reps, sync)
    return out


def rl_step(name: str, model_overrides: tuple[str, ...], *, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp:
        patient = SERVER_TIMEOUT if name != "embedded" else ()
        cfg = config(tmp, f"rollout={name}", *model_overrides, f"trainer.max_steps={steps}", *patient)
        with process_settings(cfg):
            run = build_run(cfg)
            timer = StepTimer()
            run.trainer.callbacks.append(timer)
            fit(run)
    rows = timer.rows[1:] or timer.rows  # the first step is warm-up
    return {"rl_step_s": statistics.median(r["wall_s"] for r in rows),
            "rl_generate_s": statistics.median(r["generate_s"] for r in rows),
            "rl_step_s_reps": [r["wall_s"] for r in rows]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="RL steps per engine (the first is warm-up); 0: none")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct instead of the tiny model")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    overrides = SMOLLM2 if args.smollm2 else TINY
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": os.getloadavg(),
                     "model": "smollm2" if args.smollm2 else "tiny (2 heads)", "reps": args.reps,
                     "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "engines": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench_vllm_model_") as tmp:
        model, tokenizer = instantiate(config(tmp, *overrides).model)
        model = model.float().eval()
        model_dir = save_model(model, tokenizer, Path(tmp) / "model")
        for name in args.engines:
            figures = engine_figures(name, model, model_dir, reps=args.reps, prompt_len=args.prompt_len,
                                     new_tokens=args.new_tokens)  # fmt: skip
            if args.steps:
                figures |= rl_step(name, overrides, steps=args.steps)
            results["engines"][name] = figures
            print(name, json.dumps({k: v for k, v in figures.items() if not k.endswith("_reps")}), flush=True)
    results["load_after"] = os.getloadavg()
    print(f"{'engine':<10}{'tok/s b1':>10}{'tok/s b16':>11}{'sync s':>9}{'RL step s':>11}")
    for name, f in results["engines"].items():
        print(f"{name:<10}{f['tokens_per_s_b1']:>10.0f}{f['tokens_per_s_b16']:>11.0f}{f['weight_sync_s']:>9.3f}"
              f"{f.get('rl_step_s', float('nan')):>11.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
