"""Metric reduction: (sum, count) pairs reduced across ranks once per step.

Averaging per-rank means is wrong whenever ranks hold different token counts, so every metric travels as a
(sum, count) pair and the mean is taken after one all_reduce of all pairs stacked into a single tensor.
"""

from collections.abc import Mapping

import torch
import torch.distributed as dist

SumCount = tuple[float, float]


def add_sums(into: dict[str, SumCount], new: Mapping[str, SumCount]) -> dict[str, SumCount]:
    """Accumulate (sum, count) pairs in place and return `into`."""
    for name, (s, c) in new.items():
        s0, c0 = into.get(name, (0.0, 0.0))
        into[name] = (s0 + float(s), c0 + float(c))
    return into


def distributed(trainer) -> bool:
    return trainer is not None and trainer.world_size > 1 and dist.is_available() and dist.is_initialized()


def reduce_tensor(trainer, values: torch.Tensor, *, op: str) -> torch.Tensor:
    """all_reduce `values` with op "sum" or "max" (identity on one rank); returns a CPU tensor."""
    if not distributed(trainer):
        return values.cpu()
    return trainer.strategy.reduce(values.to(trainer.strategy.root_device), reduce_op=op).cpu()


def reduce_sums(trainer, sums: Mapping[str, SumCount]) -> dict[str, float]:
    """Means of (sum, count) pairs over all ranks: one all_reduce of a stacked [N, 2] tensor.

    Identity reduction (mean = sum / count on this rank) when not distributed. Metrics whose global count is
    0 are left out rather than logged as a made-up value. Every rank must pass the same names in the same order.
    """
    names = list(sums)
    if not names:
        return {}
    pairs = reduce_tensor(trainer, torch.tensor([sums[n] for n in names], dtype=torch.float64), op="sum")
    return {n: float(s / c) for n, (s, c) in zip(names, pairs.tolist(), strict=True) if c > 0}
