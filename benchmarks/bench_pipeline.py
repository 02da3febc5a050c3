"""Step time of the Megatron backbone at pp = 2 (megatron-core's 1F1B schedule), at pp = 2 with 2 virtual stages
(its interleaved schedule) and at pp = 1, on CPU.

    .venv/bin/python benchmarks/bench_pipeline.py [--layers 8 --hidden 256 --micro 2,4,8 --seq-len 128 --iters 5
                                                   --repeats 3 --uniform]

One "step" = `MegatronBackbone.forward_backward` over m packed micro-batches (m from `--micro`, each count measured
in turn; 4 sequences each, of `seq-len` and `seq-len / 4` tokens alternating between micro-batches, or all
`seq-len` with `--uniform`) with the masked log-prob loss (`ToppLogProb`, candidate sets recorded): the part of an
RL step the pipeline changes. All layouts run in one spawn of 2 gloo processes, one intra-op thread each,
alternating pp1, pp2 and pp2 vpp2 `--repeats` times: at pp = 1 each process holds the whole model and runs every
micro-batch (2 data-parallel replicas, both cores busy), at pp = 2 each holds half the layers (vpp 2: two chunks of
a quarter, rank r holding chunks r and r + 2). Prints the median ms per step of each layout and micro-batch count,
the ratios to pp1, and the load average.

Bubble: the measured idle fraction per stage is the share of the step spent inside megatron's p2p calls
(`P2PCommunicator._communicate`: waiting for the other stage, plus the transfer itself), printed beside the
schedules' ideal bubble as a share of the step. 1F1B at p stages and m equal micro-batches: (p - 1) / (m + p - 1).
Interleaved with v virtual stages: megatron's formula (Narayanan et al. 2021) is a bubble of (p - 1) / (v m) of the
ideal step time, i.e. (p - 1) / (v m + p - 1) of the step. Micro-batches of different lengths (the default) add
idle time the formulas do not count (a stage waits for a longer micro-batch's activations); `--uniform` measures
the formulas' case. Also printed: parameter and AdamW-state bytes per rank at each layout (after one optimizer
step).
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
    for i in range(args.m):
        length = args.seq_len if i % 2 == 0 or args.uniform else args.seq_len // 4
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
            sample_index=torch.arange(4), num_loss_tokens_global=float(r * args.m),
            num_sequences_global=4 * args.m))
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


LAYOUTS = ((1, 1), (2, 1), (2, 2))  # (pp, vpp)


def _name(pp: int, vpp: int) -> str:
    return f"pp{pp}" + (f" vpp{vpp}" if vpp > 1 else "")


def _rank(rank: int, args) -> dict:
    from megatron.core import parallel_state as ps

    from topp_rl.megatron import MegatronBackbone
    from topp_rl.models import build_tiny_model
    from topp_rl.parallel import ParallelLayout
    from topp_rl.trainer.hook import ToppLogProb

    torch.set_num_threads(args.threads)
    hf = build_tiny_model("llama", vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4,
                          tie_embeddings=False, seed=0)
    hook = ToppLogProb()

    def backbone(pp: int, vpp: int):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        layout = ParallelLayout.from_megatron(args.vocab)
        return MegatronBackbone.from_hf(hf, layout=layout), layout

    clock = _P2PClock()

    def time_layout(pp: int, vpp: int, micro, idle: list[float]) -> float:
        model, layout = backbone(pp, vpp)

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
            idle.append(clock.seconds / times[-1])
        return statistics.median(times) * 1e3

    out = {}
    for m in args.micro:
        args.m = m
        micro = _micro(args, args.vocab)
        idle: dict = {layout: [] for layout in LAYOUTS}
        rows = [{layout: time_layout(*layout, micro, idle[layout]) for layout in LAYOUTS} for _ in range(args.repeats)]
        out[m] = {"rows": rows, "idle": {layout: statistics.median(v) for layout, v in idle.items()}}
    out["bytes"] = {layout: _state_bytes(backbone(*layout)[0]) for layout in LAYOUTS}
    return out


def main() -> None:
    from dist_utils import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("layers", 8), ("hidden", 256), ("vocab", 4096), ("seq-len", 128), ("iters", 5),
                          ("repeats", 3), ("threads", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--micro", type=lambda text: [int(m) for m in text.split(",")], default=[2, 4, 8],
                        help="micro-batch counts m, comma-separated (each >= 2: the interleaved schedule's minimum)")
    parser.add_argument("--uniform", action="store_true", help="all micro-batches of seq-len tokens per sequence")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    ranks = run_distributed(_rank, 2, args, timeout=3600,
                            preload=("megatron.core", "megatron.core.models.gpt", "topp_rl.megatron"))
    lengths = f"{args.seq_len} tokens" if args.uniform else f"{args.seq_len} and {args.seq_len // 4} tokens alternating"
    print(f"model: llama layers={args.layers} hidden={args.hidden} vocab={args.vocab}; micro-batches of 4 sequences "
          f"({lengths}); {args.threads} thread(s) per process; {args.repeats} repeats x {args.iters} steps; load "
          f"average before: {load_before:.2f}")
    p, v = 2, 2
    header = "".join(f"{_name(*layout) + ' ms':>13}" for layout in LAYOUTS)
    print(f"{'m':>3}{header}{'pp2/pp1':>9}{'vpp2/pp1':>9}{'vpp2/pp2':>9}   idle per stage (rank 0, rank 1) "
          "against the ideal bubble")
    for m in args.micro:
        med = {layout: statistics.median(r[layout] for r in ranks[0][m]["rows"]) for layout in LAYOUTS}
        pp1, pp2, vpp2 = (med[layout] for layout in LAYOUTS)
        idle = {layout: "/".join(f"{r[m]['idle'][layout]:.2f}" for r in ranks) for layout in LAYOUTS[1:]}
        print(f"{m:>3}" + "".join(f"{med[layout]:>13.1f}" for layout in LAYOUTS)
              + f"{pp2 / pp1:>9.2f}{vpp2 / pp1:>9.2f}{vpp2 / pp2:>9.2f}   "
              f"pp2 {idle[(2, 1)]} vs 1F1B (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.2f}; "
              f"pp2 vpp2 {idle[(2, 2)]} vs (p-1)/(vm+p-1) = {(p - 1) / (v * m + p - 1):.2f} "
              f"[megatron (p-1)/(vm) = {(p - 1) / (v * m):.2f} of the ideal time]")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"{'bytes per rank':<20}{'params':>14}{'AdamW state':>14}")
    for layout in LAYOUTS:
        for rank, r in enumerate(ranks):
            params, state = r["bytes"][layout]
            print(f"{f'{_name(*layout)} rank {rank}':<20}{params:>14,}{state:>14,}")


if __name__ == "__main__":
    main()
