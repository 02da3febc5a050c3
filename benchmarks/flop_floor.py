"""The compute floor of one RL step at SmolLM2-135M scale: how fast could any exact fp32 trainer be here?

    .venv/bin/python benchmarks/flop_floor.py [--threads 2] [--reps 5] [--prompt-tokens 4] [--new-tokens 16]

Counts the matmul FLOPs of one bench_vs_trl step (8 prompts x 4 samples, every response at the cap) from the
model's shapes, for topp_rl (candidate head: no full-vocabulary matmul in training) and for a full-vocabulary
trainer such as TRL (the lm head over every response token, forward and backward), and divides by this
machine's measured fp32 GEMM rate at the model's own layer shapes (median of --reps). Attention scores,
norms and the optimizer are left out (a few percent at these lengths), so the floor is a lower bound.
"""

import argparse
import statistics
import time

import torch
from transformers import AutoConfig

from topp_rl.models import load_smollm2


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of every decoder-layer linear."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    return [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]


def step_flops(cfg, *, batch: int, prompt: int, new: int) -> dict[str, float]:
    per_token = 2 * cfg.num_hidden_layers * sum(a * b for a, b in layer_shapes(cfg))  # forward, no head
    head = 2 * cfg.hidden_size * cfg.vocab_size  # one row of full-vocabulary logits
    generate = batch * (prompt + new - 1) * per_token + batch * new * head
    train = 3 * batch * (prompt + new) * per_token  # forward + backward (inputs and weights)
    return {"generate": generate, "train topp_rl": train, "train full vocab": train + 3 * batch * new * head}


def gemm_rate(cfg, *, rows: int, reps: int) -> float:
    """fp32 FLOP/s of x @ W.T over the layer shapes at `rows` tokens (median over reps)."""
    mats = [(torch.randn(rows, a), torch.randn(b, a)) for a, b in layer_shapes(cfg)]
    flops = sum(2 * rows * a * b for a, b in layer_shapes(cfg))
    for x, w in mats:
        torch.nn.functional.linear(x, w)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(4):
            for x, w in mats:
                torch.nn.functional.linear(x, w)
        times.append((time.perf_counter() - start) / 4)
    return flops / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=4, help="SmolLM2 tokens of '3+4=' (bench_vs_trl)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_smollm2()  # the converted config lives in the cache
    from pathlib import Path

    cfg = AutoConfig.from_pretrained(Path.home() / ".cache" / "topp_rl" / "smollm2-135m-instruct")
    flops = step_flops(cfg, batch=args.batch, prompt=args.prompt_tokens, new=args.new_tokens)
    decode_rate = gemm_rate(cfg, rows=args.batch, reps=args.reps)  # a decode step: one row per sample
    train_rate = gemm_rate(cfg, rows=args.batch * (args.prompt_tokens + args.new_tokens), reps=args.reps)
    gen_s = flops["generate"] / decode_rate
    print(f"threads={args.threads}: fp32 GEMM {decode_rate / 1e9:.1f} GFLOP/s at {args.batch} rows (decode), "
          f"{train_rate / 1e9:.1f} GFLOP/s at {args.batch * (args.prompt_tokens + args.new_tokens)} rows (training)")
    for name in ("train topp_rl", "train full vocab"):
        train_s = flops[name] / train_rate
        print(f"{name:>17}: {flops['generate'] / 1e9:6.0f} + {flops[name] / 1e9:6.0f} GFLOP -> floor "
              f"{gen_s:5.2f} + {train_s:5.2f} = {gen_s + train_s:5.2f} s per step")


if __name__ == "__main__":
    main()
