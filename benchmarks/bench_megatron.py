"""Step time of the Megatron backbone per (TP, CP) layout against the HF backbone, on CPU.

    .venv/bin/python benchmarks/bench_megatron.py [--layers 4 --hidden 256 --seqs 8 --seq-len 128 --iters 5 --threads 1]

One "step" = forward + backward of the masked log-prob loss (`ToppLogProb`, candidate sets recorded) over one
packed micro-batch: the part of an RL step the backbone changes. HF: `topp_rl.trainer.backbone.HFBackbone` in one
process. Megatron: `tp * cp` gloo processes (spawned per layout), one intra-op thread each. Prints the median
ms per step and the ratio to HF. On a 2-core machine layouts with 4 ranks oversubscribe the cores, so their
times measure overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _model(args):
    from topp_rl.models import build_tiny_model

    return build_tiny_model("qwen2", vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=8,
                            kv_heads=4, seed=0)


def _batch(args):
    from types import SimpleNamespace

    from topp_rl.ops import Candidates

    g = torch.Generator().manual_seed(0)
    lengths = torch.full((args.seqs,), args.seq_len)
    resp = lengths // 2
    tokens = torch.randint(3, args.vocab, (int(lengths.sum()),), generator=g)
    ends = torch.cumsum(lengths, 0)
    response_tokens = torch.cat([tokens[e - r: e] for e, r in zip(ends.tolist(), resp.tolist(), strict=True)])
    sizes = torch.randint(1, 9, (response_tokens.numel(),), generator=g).tolist()
    rows = [torch.randint(0, args.vocab, (k,), generator=g).tolist() for k in sizes]
    return SimpleNamespace(tokens=tokens, seq_lengths=lengths, response_lengths=resp, response_tokens=response_tokens,
                           position_ids=torch.cat([torch.arange(n) for n in lengths.tolist()]),
                           candidates=Candidates.from_lists(rows))


def _time(step, iters: int) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_hf(args) -> float:
    from topp_rl.trainer.backbone import HFBackbone
    from topp_rl.trainer.hook import ToppLogProb

    backbone, batch, hook = HFBackbone(_model(args)), _batch(args), ToppLogProb()

    def step():
        backbone.zero_grad(set_to_none=True)
        hidden, weight = backbone.forward_hidden(batch)
        hook(batch, layout=backbone.layout, hidden=hidden, weight=weight).logprobs.sum().backward()

    return _time(step, args.iters)


def _megatron_rank(rank: int, world: int, tp: int, cp: int, store: str, args, results) -> None:
    from megatron.core import parallel_state as ps

    from topp_rl.megatron import MegatronBackbone
    from topp_rl.parallel import ParallelLayout
    from topp_rl.trainer.hook import ToppLogProb

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    layout = ParallelLayout.from_megatron(args.vocab)
    backbone = MegatronBackbone.from_hf(_model(args), layout=layout)
    batch, hook = _batch(args), ToppLogProb()

    def step():
        backbone.zero_grad(set_to_none=True)
        hidden, weight = backbone.forward_hidden(batch)
        hook(batch, layout=layout, hidden=hidden, weight=weight).logprobs.sum().backward()
        dist.barrier()

    ms = _time(step, args.iters)
    if rank == 0:
        results.put(ms)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _rank_entry(rank, world, tp, cp, store, args, results):
    torch.set_num_threads(args.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    _megatron_rank(rank, world, tp, cp, store, args, results)


def bench_megatron(args, tp: int, cp: int) -> float:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_entry, args=(tp * cp, tp, cp, os.path.join(tmp, "store"), args, results),
                           nprocs=tp * cp, start_method="spawn")
    return results.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("layers", 4), ("hidden", 256), ("vocab", 4096), ("seqs", 8), ("seq-len", 128),
                          ("iters", 5), ("threads", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf = bench_hf(args)
    print(f"model: qwen2 layers={args.layers} hidden={args.hidden} vocab={args.vocab}; batch {args.seqs} x "
          f"{args.seq_len} tokens; {args.threads} thread(s) per process")
    print(f"{'backbone':<22}{'ms/step':>10}{'vs HF':>8}")
    print(f"{'HF (1 process)':<22}{hf:>10.1f}{1.0:>8.2f}")
    for tp, cp in LAYOUTS:
        ms = bench_megatron(args, tp, cp)
        print(f"{f'Megatron tp={tp} cp={cp}':<22}{ms:>10.1f}{ms / hf:>8.2f}")


if __name__ == "__main__":
    main()
