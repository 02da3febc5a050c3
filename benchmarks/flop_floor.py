"""The compute floor of one RL step (bench_vs_trl's step, at SmolLM2-135M or the tiny scale): how fast could any
exact fp32 trainer be here?

    .venv/bin/python benchmarks/flop_floor.py [--scale smollm2|tiny] [--threads N] [--reps 5] [--prompt-tokens 5]
                                              [--new-tokens N] [--train-new-tokens N]

Counts the matmul FLOPs of one bench_vs_trl step (8 prompts x 4 samples) from the model's shapes, for topp_rl
(candidate head: no full-vocabulary matmul in the loss; one forward of the full head for the per-token entropy
and unmasked log-prob it logs) and for a full-vocabulary trainer such as TRL (the lm head over every response
token, forward and backward), and divides by this machine's measured fp32 GEMM rate at the model's own layer
shapes (median of --reps). Generation decodes `new` steps for the whole batch (every engine runs the batch until
its longest response ends); the training pass covers `train_new` response tokens per sample on average (packed:
no padding), `new` unless given, so that the floor stays a lower bound when responses end early.

Two floors:
- "cache-hot" (the first version of this script): the rate of one layer's seven matrices multiplied over and
  over, so they stay in the CPU's cache, and the optimizer left out.
- "streamed" (what a step must do): a forward reads every layer's own weights (540 MB at SmolLM2, far beyond the
  cache) once per decode step, so the rate is measured over all layers' distinct matrices (and the head's),
  in model order; and AdamW must read the weights, gradients and both moments and write back three of them
  (7 x 4 bytes per parameter), at the machine's measured streaming bandwidth (a large `copy_`).
Attention scores, norms, activations, the sampler and the embedding gradient are left out of both, so each is a
lower bound.
"""

import argparse
import math
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


def step_flops(cfg, *, batch: int, prompt: int, new: int, train_new: float | None = None) -> dict[str, float]:
    """FLOPs of generation (`new` decode steps for all `batch` rows) and of each trainer's training pass over
    `train_new` response tokens per sample (default `new`)."""
    train_new = new if train_new is None else train_new
    per_token = 2 * cfg.num_hidden_layers * sum(a * b for a, b in layer_shapes(cfg))  # forward, no head
    head = 2 * cfg.hidden_size * cfg.vocab_size  # one row of full-vocabulary logits
    generate = batch * (prompt + new - 1) * per_token + batch * new * head
    train = 3 * batch * (prompt + train_new) * per_token  # forward + backward (inputs and weights)
    # topp_rl's on-policy record (train/entropy, the unmasked log-prob of the mismatch metrics) is one forward of
    # the full-vocabulary head over the response tokens, without gradient; its loss uses the candidate head only
    record = batch * train_new * head
    return {"generate": generate, "train topp_rl": train + record,
            "train full vocab": train + 3 * batch * train_new * head}


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


def rates(cfg, *, batch: int, train_rows: int, reps: int) -> dict[str, dict[str, float]]:
    """This machine's measured rates, per kind ("cache-hot" | "streamed"): fp32 GEMM FLOP/s at `batch` rows
    (decode) and at `train_rows` rows (training), and the copy bandwidth in bytes/s (streamed only)."""
    out = {}
    for kind, streamed in (("cache-hot", False), ("streamed", True)):
        decode, train = (gemm_rate(cfg, rows=r, reps=reps, streamed=streamed) for r in (batch, train_rows))
        bandwidth = stream_bandwidth(numel=1 << 26, reps=reps) if streamed else math.inf
        out[kind] = {"decode": decode, "train": train, "bandwidth": bandwidth}
    return out


def floor_seconds(cfg, measured: dict[str, dict[str, float]], *, batch: int, prompt: int, new: int,
                  train_new: float | None = None) -> dict[str, dict[str, float]]:
    """Seconds per step from `rates`: {kind: {"generate", "train <trainer>", "optimizer", "<trainer>"}} for
    trainer in ("topp_rl", "full vocab"); the "<trainer>" entry is the sum of its parts."""
    flops = step_flops(cfg, batch=batch, prompt=prompt, new=new, train_new=train_new)
    out = {}
    for kind, r in measured.items():
        optimizer = ADAMW_BYTES_PER_PARAM * num_parameters(cfg) / r["bandwidth"]
        parts = {"generate": flops["generate"] / r["decode"], "optimizer": optimizer,
                 "decode GFLOP/s": r["decode"] / 1e9, "train GFLOP/s": r["train"] / 1e9}
        for name in ("topp_rl", "full vocab"):
            parts[f"train {name}"] = flops[f"train {name}"] / r["train"]
            parts[name] = parts["generate"] + parts[f"train {name}"] + optimizer
        out[kind] = parts
    return out


def floors(cfg, *, batch: int, prompt: int, new: int, reps: int, train_new: float | None = None) -> dict:
    """`floor_seconds` from rates measured now."""
    measured = rates(cfg, batch=batch, train_rows=batch * (prompt + new), reps=reps)
    return floor_seconds(cfg, measured, batch=batch, prompt=prompt, new=new, train_new=train_new)


def smollm2_config():
    from pathlib import Path

    from topp_rl.models import load_smollm2

    load_smollm2()  # the converted config lives in the cache
    return AutoConfig.from_pretrained(Path.home() / ".cache" / "topp_rl" / "smollm2-135m-instruct")


def tiny_config():
    """The config of bench_vs_trl's tiny model (TRL's CPU test model: Qwen2, 2 layers, hidden 128, vocab 128)."""
    from topp_rl.models import build_tiny_model

    return build_tiny_model(vocab_size=128, hidden=128, layers=2, seed=0).config


CONFIGS = {"smollm2": smollm2_config, "tiny": tiny_config}
DEFAULTS = {"smollm2": dict(threads=2, new=16), "tiny": dict(threads=1, new=32)}  # bench_vs_trl's scales


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=sorted(CONFIGS), default="smollm2")
    ap.add_argument("--threads", type=int, help="default: bench_vs_trl's (smollm2 2, tiny 1)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=5,
                    help="tokens of bench_vs_trl's prompts: <|im_start|> then 3+4= (SmolLM2), <bos>3+4= (tiny)")
    ap.add_argument("--new-tokens", type=int, help="decode steps; default: bench_vs_trl's cap (16 / 32)")
    ap.add_argument("--train-new-tokens", type=float, help="mean response tokens trained on (default: the cap)")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    defaults = DEFAULTS[args.scale]
    args.threads = args.threads or defaults["threads"]
    args.new_tokens = args.new_tokens or defaults["new"]
    torch.set_num_threads(args.threads)
    cfg = CONFIGS[args.scale]()
    kw = dict(batch=args.batch, prompt=args.prompt_tokens, new=args.new_tokens, train_new=args.train_new_tokens)
    flops = step_flops(cfg, **kw)
    result = floors(cfg, reps=args.reps, **kw)
    rows = args.batch * (args.prompt_tokens + args.new_tokens)
    print(f"threads={args.threads}, {num_parameters(cfg) / 1e6:.1f}M parameters")
    for kind, f in result.items():
        print(f"{kind}: fp32 GEMM {f['decode GFLOP/s']:.1f} GFLOP/s at {args.batch} rows (decode), "
              f"{f['train GFLOP/s']:.1f} GFLOP/s at {rows} rows (training); AdamW {f['optimizer']:.2f} s")
        for name in ("topp_rl", "full vocab"):
            print(f"  train {name:>10}: {flops['generate'] / 1e9:7.1f} + {flops['train ' + name] / 1e9:7.1f} GFLOP"
                  f" -> floor {f['generate']:5.2f} + {f['train ' + name]:5.2f} + {f['optimizer']:4.2f}"
                  f" = {f[name]:5.2f} s per step")


if __name__ == "__main__":
    main()
