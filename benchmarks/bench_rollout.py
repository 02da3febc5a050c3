"""Rollout throughput: EmbeddedEngine with vs without candidate recording, side by side (alternating reps).

Same model, prompts, sampling rule and seed in every arm. "record" stores the CSR candidate sets per sample;
"norecord" computes the same kept set (`sampling_candidates`, top-k preselect; the sampler needs it) but
stores nothing; "dense_sort" is a reference sampler without recording that builds the keep mask by a full
vocabulary sort, as HF's and SGLang's torch samplers do; "hf_generate" is HF `generate` on the same model
(do_sample, the same top_p / top_k, no stop id); "embedded_hf" is "record" with `decode="hf"` (HF's forward
and DynamicCache instead of the fused static-cache step). `--smollm2` runs SmolLM2-135M-Instruct instead. When the SGLang venv exists, the real SGLang CPU server is measured on the same model.

    .venv/bin/python benchmarks/bench_rollout.py [--json out.json] [--sglang auto|off|on]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_tiny_model, save_model
from topp_rl.ops.draw import inverse_cdf
from topp_rl.rollout import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from oracles import sglang_keep_mask  # noqa: E402  (the tests' full-sort reference is this arm's sampler)


class DenseSortEngine(EmbeddedEngine):
    """Reference arm: keep mask from one full sort per step, dense [B, V] softmax and inverse-CDF draw, no sets."""

    def _sample(self, logits, params, generator, *, record):
        scaled = logits / params.temperature
        keep = sglang_keep_mask(scaled, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p)
        log_probs = scaled.masked_fill(~keep, float("-inf")).log_softmax(-1)
        u = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64)
        tokens = inverse_cdf(log_probs.exp().double().cumsum(-1), u)
        finite = torch.ones_like(tokens, dtype=torch.bool)  # sglang_keep_mask keeps at least one finite entry
        return tokens, log_probs.gather(1, tokens[:, None]).squeeze(1), None, None, finite


class HFGenerate:
    """HF `generate` on the same model and prompts (sampling with top_p / top_k, no stop id), as an arm."""

    def __init__(self, model, params_top_p: float, params_top_k: int) -> None:
        self.model, self.top_p, self.top_k = model, params_top_p, params_top_k

    @torch.no_grad()
    def generate(self, prompts, params, *, seed):
        torch.manual_seed(seed)
        ids = torch.tensor(prompts)  # equal lengths: no padding
        out = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_p=self.top_p, top_k=self.top_k,
            max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens, eos_token_id=None,
            pad_token_id=0,
        )
        return [_Generated(len(row) - ids.shape[1]) for row in out]


class _Generated:
    def __init__(self, n: int) -> None:
        self.response_length, self.candidates = n, None


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument(
        "--init-range", type=float, default=0.5, help="HF initializer_range (peakier logits when larger)"
    )
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (2 thrash on a loaded 2-core machine)"
    )
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct instead of a random tiny model")
    ap.add_argument("--sglang", choices=["auto", "off", "on"], default="auto")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--baseline", default=None, help="git revision: add an arm recording with the sampler as it was there"
    )
    return ap.parse_args()


def _time(engine: EmbeddedEngine, prompts, params, seed: int) -> tuple[float, int, float]:
    start = time.perf_counter()
    samples = engine.generate(prompts, params, seed=seed)
    seconds = time.perf_counter() - start
    tokens = sum(s.response_length for s in samples)
    sizes = [int(n) for s in samples if s.candidates is not None for n in s.candidates.row_lengths()]
    return tokens / seconds, tokens, statistics.fmean(sizes) if sizes else float("nan")


def main() -> None:
    args = _args()
    torch.set_num_threads(args.threads)
    if args.smollm2:
        from topp_rl.models import load_smollm2

        model = load_smollm2()[0].float().eval()
        args.vocab = int(model.config.vocab_size)
    else:
        model = build_tiny_model(
            vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, initializer_range=args.init_range
        )
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=g).tolist()
    # No stop ids: every sample runs to new_tokens, so both arms generate exactly the same number of tokens.
    params = SamplingParams(top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.new_tokens)
    arms = {
        "embedded_record": EmbeddedEngine(model, eos_token_id=[], progress=False, max_batch_size=args.batch),
        "embedded_hf": EmbeddedEngine(
            model, eos_token_id=[], progress=False, max_batch_size=args.batch, decode="hf"
        ),
        "embedded_norecord": EmbeddedEngine(
            model, eos_token_id=[], progress=False, record_candidates=False, max_batch_size=args.batch
        ),
        "embedded_dense_sort": DenseSortEngine(
            model, eos_token_id=[], progress=False, record_candidates=False, max_batch_size=args.batch
        ),
        "hf_generate": HFGenerate(model, args.top_p, args.top_k),
    }
    if args.baseline:  # the same engine with only `_sample` (kept sets + draw) taken from the baseline revision
        from bench_sampler import sampler_at  # benchmarks/, this script's own dir

        baseline = type("BaselineEngine", (EmbeddedEngine,), {"_sample": sampler_at(args.baseline)})
        arms[f"record@{args.baseline}"] = baseline(model, eos_token_id=[], progress=False, max_batch_size=args.batch)
    for engine in arms.values():  # warm-up
        engine.generate(prompts[:2], SamplingParams(top_p=args.top_p, max_new_tokens=4), seed=0)
    rates: dict[str, list[float]] = {name: [] for name in arms}
    set_size = float("nan")
    for rep in range(args.reps):
        order = list(arms)[rep % len(arms) :] + list(arms)[: rep % len(arms)]  # rotate: no arm always first
        for name in order:
            rate, _, size = _time(arms[name], prompts, params, seed=rep)
            rates[name].append(rate)
            if name == "embedded_record":
                set_size = size
    rows = [{"name": n, "tokens_per_s": statistics.median(r), "reps": r} for n, r in rates.items()]
    median = {n: statistics.median(r) for n, r in rates.items()}
    overhead = median["embedded_norecord"] / median["embedded_record"]
    vs_dense = median["embedded_dense_sort"] / median["embedded_record"]
    if args.sglang != "off":
        rows += _sglang_rows(model, args)
    print(
        f"model {'smollm2-135m' if args.smollm2 else f'qwen2 layers={args.layers} hidden={args.hidden}'} "
        f"vocab={args.vocab} batch={args.batch} "
        f"prompt={args.prompt_len} new={args.new_tokens} top_p={args.top_p} top_k={args.top_k} "
        f"threads={args.threads} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} "
        f"mean candidate-set size={set_size:.1f}"
    )
    print(f"{'engine':<22}{'tokens/s (median)':>20}")
    for row in rows:
        print(f"{row['name']:<22}{row['tokens_per_s']:>20.1f}")
    print(f"recording cost vs norecord: {100 * (overhead - 1):+.1f}% time per token (target <= +15%)")
    print(f"record vs dense_sort sampler: {100 * (vs_dense - 1):+.1f}% time per token")
    print(f"embedded (recording, decode={arms['embedded_record'].decode_path}) vs HF generate: "
          f"{median['embedded_record'] / median['hf_generate']:.2f}x tokens/s")
    print(f"embedded_hf (recording, decode=hf) vs HF generate: "
          f"{median['embedded_hf'] / median['hf_generate']:.2f}x tokens/s")
    if args.baseline:
        paired = statistics.median(a / b for a, b in zip(rates["embedded_record"], rates[f"record@{args.baseline}"],
                                                            strict=True))  # same rep: the same load, near enough
        print(f"record vs record@{args.baseline}: {median['embedded_record'] / median[f'record@{args.baseline}']:.2f}x "
              f"tokens/s (medians), {paired:.2f}x (median of per-rep ratios)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "config": vars(args) | {"json": str(args.json)},
                    "mean_candidate_set_size": set_size,
                    "rows": rows,
                    "norecord_over_record": overhead,
                    "dense_sort_over_record": vs_dense,
                },
                indent=2,
            )
        )


def _sglang_rows(model, args) -> list[dict]:
    from sglang_bench import sglang_tokens_per_s  # benchmarks/, this script's own dir

    from topp_rl.engines.sglang.server import SGLANG_PYTHON_ENV, sglang_python

    if sglang_python() is None:
        if args.sglang == "on":
            raise ValueError(
                f"--sglang on but {SGLANG_PYTHON_ENV} is unset; export it to what scripts/setup_sglang.sh prints"
            )
        print(f"SGLang skipped: {SGLANG_PYTHON_ENV} unset (export it to what scripts/setup_sglang.sh prints)")
        return []
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, None, tmp)
        # Same prompts as the embedded arms (seed-0 randint over [3, vocab), same shape), candidates recorded.
        result = sglang_tokens_per_s(
            model_path=tmp,
            batch=args.batch,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            top_p=args.top_p,
            top_k=args.top_k,
            reps=max(1, args.reps // 2),
        )
    return [{"name": "sglang_server", "tokens_per_s": result["tokens_per_s"], "reps": result["reps"]}]


if __name__ == "__main__":
    main()
