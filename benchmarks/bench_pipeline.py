"""Step time of the Megatron backbone at pp = 2 (megatron-core's 1F1B schedule) against pp = 1, on CPU.

    .venv/bin/python benchmarks/bench_pipeline.py [--layers 8 --hidden 256 --micro 4 --seq-len 128 --iters 5 --repeats 3]

One "step" = `MegatronBackbone.forward_backward` over `--micro` packed micro-batches (lengths alternating
`seq-len` and `seq-len / 4` tokens per sequence, 4 sequences each) with the masked log-prob loss (`ToppLogProb`,
candidate sets recorded): the part of an RL step the pipeline changes. Both layouts run in one spawn of 2 gloo
processes, one intra-op thread each, alternating pp = 1 and pp = 2 `--repeats` times: at pp = 1 each process holds
the whole model and runs every micro-batch (2 data-parallel replicas, both cores busy), at pp = 2 each holds half
the layers. Prints the median ms per step of each layout per repeat and the ratio pp2 / pp1, and the load average.
The schedule's ideal bubble at p = 2 stages and m micro-batches is (p - 1) / (m + p - 1); the measured idle
fraction per stage is the share of the step spent inside megatron's p2p calls (`P2PCommunicator._communicate`:
waiting for the other stage, plus the transfer itself). Also printed: parameter and AdamW-state bytes per rank
at pp1 and pp2 (after one optimizer step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _micro(args, vocab: int):
    from topp_rl.data import PackedBatch
    from topp_rl.ops import Candidates

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(args.micro):
        length = args.seq_len if i % 2 == 0 else args.seq_len // 4
        lengths = torch.full((4,), length)
        resp = lengths // 2
        tokens = torch.randint(3, vocab, (int(lengths.sum()),), generator=g)
        ends = torch.cumsum(lengths, 0)
        response_tokens = torch.cat([tokens[e - r: e] for e, r in zip(ends.tolist(), resp.tolist(), strict=True)])
        rows = [sorted(set(torch.randint(0, vocab, (8,), generator=g).tolist()) | {t})
                for t in response_tokens.tolist()]
        cu = torch.zeros(5, dtype=torch.int32)
        cu[1:] = ends
        r = int(resp.sum())
        out.append(PackedBatch(
            tokens=tokens, cu_seqlens=cu, seq_lengths=lengths, response_lengths=resp,
            position_ids=torch.cat([torch.arange(n) for n in lengths.tolist()]), loss_mask=torch.ones(r),
            advantages=torch.ones(r), rollout_log_probs=torch.zeros(r), response_tokens=response_tokens,
            candidates=Candidates.from_lists(rows), rewards=torch.ones(4), group_index=torch.zeros(4, dtype=torch.long),
            sample_index=torch.arange(4), num_loss_tokens_global=float(r * args.micro),
            num_sequences_global=4 * args.micro))
    return out


class _P2PClock:
    """Seconds spent inside megatron's p2p exchanges (idle + transfer), by wrapping the class method for the run."""

    def __init__(self):
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        self.seconds, original = 0.0, P2PCommunicator._communicate

        def timed(comm, **kwargs):
            start = time.perf_counter()
            try:
                return original(comm, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        P2PCommunicator._communicate = timed


def _state_bytes(model) -> tuple[int, int]:
    """(parameter bytes, AdamW state bytes after one step) of this rank's stage."""
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=0.0)
    opt.step()
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    return sum(p.numel() * p.element_size() for p in params), state


def _rank(rank: int, args) -> dict:
    from megatron.core import parallel_state as ps

    from topp_rl.megatron import MegatronBackbone
    from topp_rl.models import build_tiny_model
    from topp_rl.parallel import ParallelLayout
    from topp_rl.trainer.hook import ToppLogProb

    torch.set_num_threads(args.threads)
    hf = build_tiny_model("llama", vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                          tie_embeddings=False, seed=0)
    micro, hook = _micro(args, args.vocab), ToppLogProb()

    def backbone(pp: int):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
        layout = ParallelLayout.from_megatron(args.vocab)
        return MegatronBackbone.from_hf(hf, layout=layout), layout

    clock = _P2PClock()
    idle: dict[int, list[float]] = {1: [], 2: []}

    def time_layout(pp: int) -> float:
        model, layout = backbone(pp)

        def step_fn(i, mb, hidden, weight):
            out = hook(mb, layout=layout, hidden=hidden, weight=weight)
            return -out.logprobs.sum() / mb.num_loss_tokens_global, float(out.logprobs.detach().sum())

        def step():
            model.zero_grad(set_to_none=True)
            model.forward_backward(micro, step_fn)
            torch.distributed.barrier()

        for _ in range(2):
            step()
        times = []
        for _ in range(args.iters):
            clock.seconds = 0.0
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            idle[pp].append(clock.seconds / times[-1])
        return statistics.median(times) * 1e3

    rows = [(time_layout(1), time_layout(2)) for _ in range(args.repeats)]
    return {"rows": rows, "idle": statistics.median(idle[2]),
            "bytes": {pp: _state_bytes(backbone(pp)[0]) for pp in (1, 2)}}


def main() -> None:
    from dist_utils import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("layers", 8), ("hidden", 256), ("vocab", 4096), ("micro", 4), ("seq-len", 128),
                          ("iters", 5), ("repeats", 3), ("threads", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    ranks = run_distributed(_rank, 2, args, timeout=1800,
                            preload=("megatron.core", "megatron.core.models.gpt", "topp_rl.megatron"))
    rows = ranks[0]["rows"]
    print(f"model: llama layers={args.layers} hidden={args.hidden} vocab={args.vocab}; {args.micro} micro-batches of "
          f"4 sequences ({args.seq_len} and {args.seq_len // 4} tokens alternating); {args.threads} thread(s) per "
          f"process; load average before: {load_before:.2f}")
    print(f"{'repeat':<8}{'pp1 ms':>10}{'pp2 ms':>10}{'pp2/pp1':>10}")
    for i, (pp1, pp2) in enumerate(rows):
        print(f"{i:<8}{pp1:>10.1f}{pp2:>10.1f}{pp2 / pp1:>10.2f}")
    pp1, pp2 = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
    bubble = 1 / (args.micro + 1)
    print(f"{'median':<8}{pp1:>10.1f}{pp2:>10.1f}{pp2 / pp1:>10.2f}   (1F1B ideal bubble at p=2, m={args.micro}: "
          f"{bubble:.2f}); load average after: {os.getloadavg()[0]:.2f}")
    for stage, r in enumerate(ranks):
        print(f"pp2 stage {stage}: idle (inside p2p) {r['idle']:.2f} of the step (median over steps)")
    print(f"{'bytes per rank':<16}{'params':>14}{'AdamW state':>14}")
    for pp in (1, 2):
        for rank, r in enumerate(ranks):
            params, state = r["bytes"][pp]
            print(f"{f'pp{pp} rank {rank}':<16}{params:>14,}{state:>14,}")


if __name__ == "__main__":
    main()
