"""One decode step of the tiny model, eager against `torch.compile`: does compiling pay on this CPU?

"eager" is the embedded engine's fused decode forward (`topp_rl.engines.fused_decode.StaticCacheForward`, one
token per call after the prefill). "compiled" is the same step written for static shapes (it attends over the
cache's whole capacity, the unfilled slots masked by an additive bias, and writes the new keys and values in
place with `index_copy_`), compiled by inductor with `fullgraph=True, dynamic=False`: the form a compiled decode
step would ship in, one graph for every step of a batch. Both arms decode the same prompts from the same cache;
their logits must agree to float32 rounding (the script exits non-zero otherwise). Arms alternate within each
repetition; per-step medians are printed, with the compile time of the first call.

    .venv/bin/python benchmarks/bench_compiled_decode.py [--reps 7] [--threads 1]
"""

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from topp_rl.engines.fused_decode import FusedDecoder, StaticCacheForward, _linear, _rms_norm, _rope
from topp_rl.models import build_tiny_model


def static_step(fwd: StaticCacheForward, ids: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
    """Logits [B, V] of one token per row: `fwd`'s step over the whole capacity (`bias` [B, 1, 1, capacity]
    masks the unfilled slots), its keys and values written at `slot` [1]."""
    dec, batch = fwd.decoder, ids.shape[0]
    cos, sin = fwd.cos[positions][:, None], fwd.sin[positions][:, None]
    h = F.embedding(ids, fwd.model.model.embed_tokens.weight)
    group = dec.heads // dec.kv_heads
    for i, layer in enumerate(fwd.layers):
        fused = fwd.fused[i]
        q, k, v = F.linear(_rms_norm(h, layer.attn_norm, dec.eps), fused.qkv, fused.qkv_bias).split(fused.qkv_split, -1)
        q = _rope(q.view(batch, 1, dec.heads, dec.head_dim).transpose(1, 2), cos, sin)
        k = _rope(k.view(batch, 1, dec.kv_heads, dec.head_dim).transpose(1, 2), cos, sin)
        fwd.keys[i].index_copy_(2, slot, k)
        fwd.values[i].index_copy_(2, slot, v.view(batch, 1, dec.kv_heads, dec.head_dim).transpose(1, 2))
        scores = torch.bmm(q.reshape(batch * dec.kv_heads, group, dec.head_dim), fwd.keys_flat[i].transpose(1, 2))
        scores = (scores * dec.head_dim**-0.5).view(batch, dec.kv_heads, group, -1) + bias
        weights = scores.view(batch * dec.kv_heads, group, -1).softmax(-1, dtype=torch.float32)
        h = h + _linear(torch.bmm(weights, fwd.values_flat[i]).view(batch, 1, -1), layer.o)
        gate, up = F.linear(_rms_norm(h, layer.mlp_norm, dec.eps), fused.gate_up).split(fused.gate_up_split, -1)
        h = h + _linear(layer.act(gate) * up, layer.down)
    return _linear(_rms_norm(h, fwd.model.model.norm, dec.eps), fwd.model.get_output_embeddings())[:, -1]


def decode(model, prompts: torch.Tensor, new_tokens: int, step) -> tuple[float, torch.Tensor]:
    """(seconds for the one-token steps, their logits [steps, B, V]): the prefill, then greedy tokens fed back."""
    batch, width = prompts.shape
    capacity = width + new_tokens
    fwd = FusedDecoder(model).start(batch, capacity, None)
    fwd.keys.zero_(), fwd.values.zero_()  # the static step reads every slot (masked): no uninitialised NaN
    positions = torch.arange(width).expand(batch, width)
    ids = fwd(prompts, positions).argmax(-1, keepdim=True)
    positions = positions[:, -1:]
    slots = torch.arange(capacity)
    # row f: the additive bias of the step that fills slot f (slots after it masked), built before the clock
    biases = torch.where(slots[None, :] <= slots[:, None], 0.0, torch.finfo(torch.float32).min)
    out = []
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        positions = positions + 1
        if step is None:
            logits = fwd(ids, positions)
        else:
            f = fwd.filled
            logits = step(fwd, ids, positions, slots[f : f + 1], biases[f : f + 1, None, None])
            fwd.filled += 1
        out.append(logits)
        ids = logits.argmax(-1, keepdim=True)
    return time.perf_counter() - start, torch.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_tiny_model(vocab_size=128, hidden=128, layers=2, seed=0).eval()
    prompts = torch.randint(0, 128, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(static_step, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        _, ref = decode(model, prompts, args.new_tokens, None)
        start = time.perf_counter()
        _, got = decode(model, prompts, args.new_tokens, compiled)
        compile_s = time.perf_counter() - start
        diff = float((got - ref).abs().max())
        times = {"eager": [], "compiled": []}
        for _ in range(args.reps):
            times["eager"].append(decode(model, prompts, args.new_tokens, None)[0])
            times["compiled"].append(decode(model, prompts, args.new_tokens, compiled)[0])
    steps = args.new_tokens - 1
    per_step = {arm: statistics.median(t) / steps * 1e3 for arm, t in times.items()}
    print(f"batch {args.batch}, prompt {args.prompt_len}, {steps} one-token steps, {args.threads} thread(s), "
          f"torch {torch.__version__}; logits max |compiled - eager| {diff:.2e}")
    print(f"first compiled decode (compilation included): {compile_s:.1f} s")
    for arm, ms in per_step.items():
        print(f"{arm:9s} {ms:.3f} ms per step (median of {args.reps})")
    print(f"compiled / eager: {per_step['compiled'] / per_step['eager']:.2f}")
    if not diff <= 1e-5:
        sys.exit(f"the compiled step's logits differ from the eager step's by {diff:.2e} (> 1e-5)")


if __name__ == "__main__":
    main()
