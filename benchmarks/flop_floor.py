"""The compute floor of one RL step at SmolLM2-135M scale: how fast could any exact fp32 trainer be here?

    .venv/bin/python benchmarks/flop_floor.py [--threads 2] [--reps 5] [--prompt-tokens 5] [--new-tokens 16]

Counts the matmul FLOPs of one bench_vs_trl step (8 prompts x 4 samples, every response at the cap) from the
model's shapes, for topp_rl (candidate head: no full-vocabulary matmul in the loss; one forward of the full head
for the per-token entropy and unmasked log-prob it logs) and for a full-vocabulary trainer such as TRL (the lm
head over every response token, forward and backward), and divides by this
machine's measured fp32 GEMM rate at the model's own layer shapes (median of --reps).

Two floors:
- "cache-hot" (the first version of this script): the rate of one layer's seven matrices multiplied over and
  over, so they stay in the CPU's cache, and the optimizer left out.
- "streamed" (what a step must do): a forward reads every layer's own weights (540 MB at SmolLM2, far beyond the
  cache) once per decode step, so the rate is measured over all layers' distinct matrices (and the head's),
  in model order; and AdamW must read the weights, gradients and both moments and write back three of them
  (7 x 4 bytes per parameter), at the machine's measured streaming bandwidth (a large `copy_`).
Attention scores, norms, activations and the embedding gradient are left out of both, so each is a lower bound.
"""

import argparse
import statistics
import time

import torch
from transformers import AutoConfig

ADAMW_BYTES_PER_PARAM = 7 * 4  # reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq


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
    # topp_rl's on-policy record (train/entropy, the unmasked log-prob of the mismatch metrics) is one forward of
    # the full-vocabulary head over the response tokens, without gradient; its loss uses the candidate head only
    record = batch * new * head
    return {"generate": generate, "train topp_rl": train + record, "train full vocab": train + 3 * batch * new * head}


def _median_seconds(fn, reps: int) -> float:
    fn()  # warm-up (first-touch page faults)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_rate(cfg, *, rows: int, reps: int, streamed: bool = False) -> float:
    """fp32 FLOP/s of x @ W.T over the layer shapes at `rows` tokens (median over reps). `streamed`: every layer
    gets its own matrices, plus the lm head, visited in model order (weights come from memory, as in a real
    forward); otherwise one layer's matrices are reused (cache-hot)."""
    shapes = layer_shapes(cfg) * (cfg.num_hidden_layers if streamed else 1)
    if streamed:
        shapes.append((cfg.hidden_size, cfg.vocab_size))
    mats = [(torch.randn(rows, a), torch.randn(b, a)) for a, b in shapes]
    flops = sum(2 * rows * a * b for a, b in shapes)
    passes = 1 if streamed else 4

    def run() -> None:
        for _ in range(passes):
            for x, w in mats:
                torch.nn.functional.linear(x, w)

    return passes * flops / _median_seconds(run, reps)


def stream_bandwidth(*, numel: int, reps: int) -> float:
    """Bytes/s read plus written by `dst.copy_(src)` over buffers far larger than the cache (median)."""
    src, dst = torch.randn(numel), torch.empty(numel)
    return 2 * 4 * numel / _median_seconds(lambda: dst.copy_(src), reps)


def num_parameters(cfg) -> int:
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    per_layer = sum(a * b for a, b in layer_shapes(cfg)) + 2 * h  # linears + two RMSNorm weights
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return layers * per_layer + cfg.vocab_size * h + head + h


def floors(cfg, *, batch: int, prompt: int, new: int, reps: int) -> dict[str, dict[str, float]]:
    """Seconds per step: {"cache-hot" | "streamed": {"generate", "train <trainer>", "optimizer", "<trainer>"}}
    for trainer in ("topp_rl", "full vocab"); the "<trainer>" entry is the sum of its parts."""
    flops = step_flops(cfg, batch=batch, prompt=prompt, new=new)
    train_rows = batch * (prompt + new)
    out = {}
    for kind, streamed in (("cache-hot", False), ("streamed", True)):
        decode, train = (gemm_rate(cfg, rows=r, reps=reps, streamed=streamed) for r in (batch, train_rows))
        optimizer = 0.0
        if streamed:
            optimizer = ADAMW_BYTES_PER_PARAM * num_parameters(cfg) / stream_bandwidth(numel=1 << 26, reps=reps)
        parts = {"generate": flops["generate"] / decode, "optimizer": optimizer,
                 "decode GFLOP/s": decode / 1e9, "train GFLOP/s": train / 1e9}
        for name in ("topp_rl", "full vocab"):
            parts[f"train {name}"] = flops[f"train {name}"] / train
            parts[name] = parts["generate"] + parts[f"train {name}"] + optimizer
        out[kind] = parts
    return out


def smollm2_config():
    from pathlib import Path

    from topp_rl.models import load_smollm2

    load_smollm2()  # the converted config lives in the cache
    return AutoConfig.from_pretrained(Path.home() / ".cache" / "topp_rl" / "smollm2-135m-instruct")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=5,
                    help="SmolLM2 tokens of bench_vs_trl's prompts: <|im_start|> then 3+4=")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = smollm2_config()
    flops = step_flops(cfg, batch=args.batch, prompt=args.prompt_tokens, new=args.new_tokens)
    result = floors(cfg, batch=args.batch, prompt=args.prompt_tokens, new=args.new_tokens, reps=args.reps)
    rows = args.batch * (args.prompt_tokens + args.new_tokens)
    print(f"threads={args.threads}, {num_parameters(cfg) / 1e6:.1f}M parameters")
    for kind, f in result.items():
        print(f"{kind}: fp32 GEMM {f['decode GFLOP/s']:.1f} GFLOP/s at {args.batch} rows (decode), "
              f"{f['train GFLOP/s']:.1f} GFLOP/s at {rows} rows (training); AdamW {f['optimizer']:.2f} s")
        for name in ("topp_rl", "full vocab"):
            print(f"  train {name:>10}: {flops['generate'] / 1e9:6.0f} + {flops['train ' + name] / 1e9:6.0f} GFLOP"
                  f" -> floor {f['generate']:5.2f} + {f['train ' + name]:5.2f} + {f['optimizer']:4.2f}"
                  f" = {f[name]:5.2f} s per step")


if __name__ == "__main__":
    main()
