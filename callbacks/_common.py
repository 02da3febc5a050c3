"""Shared pieces of the metric callbacks: cross-rank reductions that stay exact, logging (through the trainer's
`topp_rl.trainer.step_metrics.StepMetrics`), W&B histograms.

Means travel as (sum, count) pairs through `topp_rl.trainer.metrics.reduce_sums` (one all_reduce per callback and
step). Order statistics (max, min, p99, median) are exact: float figures are all-gathered (padded to the
longest rank, then unpadded), integer sizes are reduced as a histogram of counts.
"""

import math

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import WandbLogger

from topp_rl.trainer.metrics import SumCount, distributed, reduce_sums
from topp_rl.trainer.step_metrics import StepMetrics


def gather_columns(trainer, values: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's [K, N_rank] tensor along dim 1, in rank order (identity on one rank)."""
    if not distributed(trainer):
        return values
    device = trainer.strategy.root_device
    sizes = all_gather(torch.tensor([values.shape[1]], device=device)).flatten().tolist()
    if max(sizes) == 0:  # nothing anywhere; skip the empty collective
        return values
    padded = values.new_zeros(values.shape[0], max(sizes))
    padded[:, : values.shape[1]] = values
    parts = all_gather(padded.to(device)).cpu()  # [W, K, max]
    return torch.cat([part[:, :n] for part, n in zip(parts, sizes, strict=True)], dim=1)


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` stacked in rank order, [W, ...], with torch.distributed's own all_gather. Not
    Lightning's `strategy.all_gather`: it goes through the autograd-aware torch.distributed.nn.functional.all_gather,
    which torch deprecates with a warning at every call (each FSDP step, on every rank); these figures need no
    gradient."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts)


def quantile_from_counts(counts: torch.Tensor, q: float) -> float:
    """`np.quantile(values, q)` (linear interpolation) where counts[v] is how often the integer v occurs."""
    cum = torch.cumsum(counts.to(torch.int64), 0)
    n = int(cum[-1])
    h = (n - 1) * q
    lo, hi = math.floor(h), min(math.ceil(h), n - 1)
    v_lo, v_hi = (int(torch.searchsorted(cum, torch.tensor(k), right=True)) for k in (lo, hi))
    return v_lo + (h - lo) * (v_hi - v_lo)


def log_metrics(trainer, sums: dict[str, SumCount], extra: dict[str, float] | None = None) -> dict:
    """Reduce (sum, count) pairs once across ranks, add exact `extra` figures, log all on this step."""
    values = reduce_sums(trainer, sums) | (extra or {})
    StepMetrics.of(trainer).add(trainer, values)
    return values


def log_histograms(trainer, histograms: dict[str, torch.Tensor]) -> None:
    """Send per-token figures to every W&B logger as histograms (rank 0; the values are already global)."""
    loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
    if not loggers or not trainer.is_global_zero:
        return
    import wandb

    data = {k: wandb.Histogram(np.asarray(v.double().cpu())) for k, v in histograms.items() if v.numel()}
    for logger in loggers:
        logger.log_metrics(data, step=trainer.global_step)
