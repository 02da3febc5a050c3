"""Gradient reduction and clipping for a TP x CP x DP Megatron model on CPU (Megatron's DDP / optimizer are CUDA-only).

- `GradSync`: sums each backward's NEW gradient over the data-parallel-with-context-parallel group. Sum, not mean:
  CP ranks hold disjoint tokens of the same sequences (each rank's gradient is a partial sum), and the losses
  divide by global token / sequence counts over all DP ranks, so the full-batch gradient is the sum over ranks.
  Syncing only the increment keeps gradient accumulation over micro-batches exact (already-synced gradients
  are not summed twice).
- `clip_grad_norm_`: the global 2-norm over the whole (unsharded) model, as `torch.nn.utils.clip_grad_norm_`
  would compute on the HF model: TP-sharded parameters (Megatron's `tensor_model_parallel` attribute) contribute
  their shard's squares summed over the TP group; replicated ones (norms) count once; MoE experts (split over EP,
  and over TP as expert tensor parallelism = TP) are summed over TP and EP. Same clip rule as torch.
- Pipeline stages hold disjoint layers: their squared norms add up over the pipeline group (`pp_group`); a tied
  embedding's second copy on the last stage is left out (`skip`), so the weight counts once.
- Experts see the tokens of every rank in their TP x EP group (the dispatcher gathers them), so their gradient
  is summed over the expert-data-parallel group instead (the strategy gives them their own `GradSync`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _is_tp_sharded(p: torch.nn.Parameter) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


class GradSync:
    """Snapshot grads before a backward (`before`), sum the increment over `group` after it (`after`)."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup | None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self._prev: list[Tensor | None] | None = None

    def before(self) -> None:
        if self.group is not None:
            self._prev = [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    def after(self) -> None:
        if self.group is None:
            return
        prev = self._prev or [None] * len(self.params)
        deltas = []
        for p, old in zip(self.params, prev, strict=True):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            deltas.append(grad.detach() - old if old is not None else grad.detach())
        flat = torch.cat([d.reshape(-1) for d in deltas])
        dist.all_reduce(flat, group=self.group)  # one collective for the whole model
        offset = 0
        for p, old in zip(self.params, prev, strict=True):
            n = p.numel()
            summed = flat[offset : offset + n].view_as(p)
            p.grad = summed.clone() if old is None else old + summed
            offset += n
        self._prev = None


def is_expert_param(name: str) -> bool:
    """A routed expert's weight (megatron's `mlp.experts.local_experts.*`), split over EP."""
    return ".mlp.experts." in name


def _all_reduce(t: Tensor, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)


def grad_norm(named_params, *, tp_group: dist.ProcessGroup | None, ep_group: dist.ProcessGroup | None = None,
              pp_group: dist.ProcessGroup | None = None, skip: tuple[Tensor, ...] = ()) -> Tensor:
    """Global 2-norm of the full model's gradient from (name, parameter) pairs (see module docstring)."""
    sharded, replicated, experts = (torch.zeros((), dtype=torch.float64) for _ in range(3))
    for name, p in named_params:
        if p.grad is None or any(p is s for s in skip):
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if is_expert_param(name):
            experts += sq
        elif _is_tp_sharded(p):
            sharded += sq
        else:
            replicated += sq
    _all_reduce(experts, ep_group)
    sharded += experts  # experts are split over TP too (expert tensor parallel size = TP)
    _all_reduce(sharded, tp_group)
    total = sharded + replicated
    _all_reduce(total, pp_group)
    return total.sqrt()


def clip_grad_norm_(named_params, max_norm: float, *, tp_group: dist.ProcessGroup | None,
                    ep_group: dist.ProcessGroup | None = None, pp_group: dist.ProcessGroup | None = None,
                    skip: tuple[Tensor, ...] = ()) -> float:
    """Clip in place like `torch.nn.utils.clip_grad_norm_` on the unsharded model; return the norm before clipping."""
    named = [(n, p) for n, p in named_params if p.grad is not None]
    params = [p for _, p in named]
    total = grad_norm(named, tp_group=tp_group, ep_group=ep_group, pp_group=pp_group, skip=skip)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return float(total)
