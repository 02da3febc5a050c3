"""The embedded engine's static against continuous batching on a long-tail workload, and what the KV cache at an
in-flight weight update does to the behaviour log-prob.

    .venv/bin/python benchmarks/continuous_batching.py [--repeats 3] [--prompts 64] [--n 4] [--rows 64]
        [--max-new-tokens 256] [--threads 1] [--device cpu|cuda] [--skip-kv] [--json out.json]

Throughput: a tiny Qwen2 (float32, vocab 128, near-uniform logits) samples `prompts` x `n` responses at top_p 0.95
with two stop ids, so response lengths are roughly geometric (mean ~60 tokens) and cut at max_new_tokens: a long
tail. Arms interleaved (static, continuous, static, ...), one `generate` call each (static decodes it in chunks of
`rows`; continuous keeps `rows` decode rows busy); per arm the medians of tokens/s (response tokens / wall time)
and of the mean decode batch size (`engine.decode_counts`: rows that sampled a token / decode steps). `--threads`:
torch's intra-op threads (default 1: the engine on one core; on a 2-core machine shared with other work, 2 threads
busy-wait against each other and the figures swing by 10x).

KV at an update (`--skip-kv` leaves it out): 32 requests of up to 48 tokens on 16 rows, a weight update of about 2%
(and 10%) relative size per tensor landing after decode step 12; for the tokens sampled after it by requests that
span it, mean / max |recorded log-prob - the new weights' dense fp32 recomputation|, kv_at_update=recompute
against keep; for scale, the same figure for the old weights' dense log-probs of those tokens (what they would
record had the update not landed).
"""

import argparse
import copy
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_tiny_model
from topp_rl.ops import sampling_candidates, token_logprobs


def long_tail_run(arm: str, model, prompts, params, rows: int) -> dict:
    with EmbeddedEngine(model, eos_token_id=[], progress=False, max_batch_size=rows, batching=arm) as engine:
        start = time.perf_counter()
        samples = engine.generate(prompts, params, seed=0)
        wall = time.perf_counter() - start
        counts = engine.decode_counts
    tokens = sum(s.response_length for s in samples)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "steps": counts.steps,
            "mean_batch": counts.mean_batch_size}


def throughput(args) -> dict:
    model = build_tiny_model("qwen2", vocab_size=128, seed=0).to(args.device)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (int(torch.randint(8, 33, (1,), generator=generator)),),
                             generator=generator).tolist() for _ in range(args.prompts)]
    params = SamplingParams(top_p=0.95, max_new_tokens=args.max_new_tokens, n=args.n, stop_token_ids=(3, 4))
    runs: dict[str, list[dict]] = {"static": [], "continuous": []}
    long_tail_run("continuous", model, prompts[:4], params, args.rows)  # warm-up (allocator, kernels)
    for _ in range(args.repeats):
        for arm in runs:
            runs[arm].append(long_tail_run(arm, model, prompts, params, args.rows))
    table = {arm: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "mean_batch", "wall_s")}
             for arm, rs in runs.items()}
    return {"table": table, "runs": runs}


def _perturbed(model, scale: float):
    out = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.abs().mean())
    return out


def _update_at(engine, prompts, params, *, at_step: int, named) -> list:
    loop, reached = engine.loop, threading.Event()

    def hold(steps: int) -> None:
        if steps == at_step:
            reached.set()
            with loop.cond:
                loop.cond.wait_for(lambda: loop.pause_requests > 0)

    loop.boundary_hook = hold
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(engine.generate, prompts, params, seed=0)
        reached.wait()
        engine.update_weights_in_flight(named, version=1)
        return future.result()


def _dense(model, sample, params) -> torch.Tensor:
    with torch.no_grad():
        rows = model(input_ids=torch.tensor([sample.prompt_ids + sample.response_ids])).logits[0].float()
    rows = rows[len(sample.prompt_ids) - 1 : -1]
    cands = sampling_candidates(rows, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                min_p=params.min_p)
    return token_logprobs(rows, torch.tensor(sample.response_ids), cands=cands, temperature=params.temperature)


def _post_update_errors(old, new, samples, params) -> tuple[list[float], list[float]]:
    """|recorded - new dense| and |old dense - new dense| over the tokens sampled after the update."""
    errors, stale = [], []
    for s in samples:
        if not s.spans_versions:
            continue
        after = torch.tensor(s.token_versions()) == 1
        dense_new = _dense(new, s, params)[after]
        errors += (torch.tensor(s.rollout_log_probs)[after] - dense_new).abs().tolist()
        stale += (_dense(old, s, params)[after] - dense_new).abs().tolist()
    return errors, stale


def kv_at_update() -> list[dict]:
    old = build_tiny_model("qwen2", vocab_size=96, seed=0, initializer_range=0.2)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 96, (int(torch.randint(2, 12, (1,), generator=generator)),),
                             generator=generator).tolist() for _ in range(32)]
    params = SamplingParams(top_p=0.9, top_k=40, temperature=1.1, max_new_tokens=48)
    rows = []
    for scale in (0.02, 0.1):
        new = _perturbed(old, scale)
        for kv in ("recompute", "keep"):
            with EmbeddedEngine(old, eos_token_id=[], progress=False, max_batch_size=16, batching="continuous",
                                kv_at_update=kv) as engine:
                samples = _update_at(engine, prompts, params, at_step=12, named=new.state_dict().items())
            errors, stale = _post_update_errors(old, new, samples, params)
            rows.append({"update_scale": scale, "kv_at_update": kv, "tokens": len(errors),
                         "mean": statistics.fmean(errors), "max": max(errors),
                         "old_weights_mean": statistics.fmean(stale), "old_weights_max": max(stale)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-kv", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "throughput": throughput(args)}
    print(f"{args.prompts} prompts x n={args.n}, max_new_tokens={args.max_new_tokens}, {args.rows} rows, "
          f"{args.device}, torch threads {torch.get_num_threads()}, medians of {args.repeats}")
    print(f"{'batching':<12}{'tokens/s':>10}{'mean batch':>12}{'wall s':>9}")
    table = out["throughput"]["table"]
    for arm, m in table.items():
        print(f"{arm:<12}{m['tokens_per_s']:>10.0f}{m['mean_batch']:>12.1f}{m['wall_s']:>9.2f}")
    print(f"continuous / static tokens/s: {table['continuous']['tokens_per_s'] / table['static']['tokens_per_s']:.2f}x")
    if not args.skip_kv:
        out["kv_at_update"] = kv_at_update()
        print(f"\n{'update':<8}{'kv_at_update':<14}{'tokens':>7}{'mean |diff|':>13}{'max |diff|':>12}"
              f"{'old weights: mean':>19}{'max':>10}")
        for r in out["kv_at_update"]:
            print(f"{r['update_scale']:<8}{r['kv_at_update']:<14}{r['tokens']:>7}{r['mean']:>13.2e}{r['max']:>12.2e}"
                  f"{r['old_weights_mean']:>19.2e}{r['old_weights_max']:>10.2e}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
