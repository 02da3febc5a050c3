"""Megatron-core's MoE layer for the backbone: tensor parallelism without sequence parallelism, load statistics,
an optional load-balancing loss, and the CPU stand-ins for its CUDA-only pieces.

`TopPMoELayer(MoELayer)` keeps megatron's router, token dispatcher and experts (SequentialMLP; expert tensor
parallel size = TP, megatron's default) and changes the layout around them:
- TP without sequence parallelism: every TP rank holds all tokens. Megatron's MoE layer assumes SP (it raises
  in training otherwise) and its dispatchers gather over TP x EP, which would count each token once per TP rank.
  Here the router runs on all tokens (identical on every TP rank, so its weight gradient is complete on each);
  then rows are split evenly over TP (`_SplitRows`: backward all-gathers, the gradient of a replicated
  activation), dispatched in SP layout, and the output is all-gathered back (`_GatherRows`: backward keeps this
  rank's slice, the downstream gradient being identical on all TP ranks).
- Statistics of the last forward (`stats`): tokens routed to each expert, and the switch load-balancing loss
  `E / (k T^2) * sum_e P_e c_e` (P_e: sum over tokens of the full softmax score of expert e, c_e: tokens routed
  to e, T: tokens), with c_e and T counted over the CP group (the sequences split over CP). The loss's gradient is
  attached (megatron's `MoEAuxLossAutoScaler`) when `aux_loss_coeff` > 0; megatron's own aux-loss path is left
  off (`moe_router_load_balancing_type="none"`) because it counts replicated TP tokens as SP shards.
CPU (`cpu=True` in `use_topp_moe_layer`): `CpuTopKRouter` computes the gating as a plain `F.linear` in place
(megatron moves the weight to `torch.cuda.current_device()` and may call a TE GEMM); `CpuAllGatherDispatcher`
gathers / reduce-scatters with plain gloo collectives (megatron's allocate on the current CUDA device).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from topp_rl.megatron.cpu_shims import _AllGatherRows


def _rank_size(group) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


class _SplitRows(torch.autograd.Function):
    """This rank's 1/size of the rows (rows divisible by size). Backward: all-gather of the slices' gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        rank, size = _rank_size(group)
        rows = x.shape[0] // size
        return x[rank * rows : (rank + 1) * rows].clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0. Backward: this rank's slice of the (TP-identical) gradient, no sum."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rank, size = _rank_size(ctx.group)
        rows = grad.shape[0] // size
        return grad[rank * rows : (rank + 1) * rows], None


class _ReduceScatterRows(torch.autograd.Function):
    """Sum over `group`, keep this rank's rows (gloo has no reduce_scatter). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        rank, size = _rank_size(group)
        rows = x.shape[0] // size
        return x[rank * rows : (rank + 1) * rows]

    @staticmethod
    def backward(ctx, grad: Tensor):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """`x` with zero rows appended up to `rows` rows."""
    extra = rows - x.shape[0]
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])]) if extra else x


def _router_cls(cpu: bool):
    from megatron.core.transformer.moe.router import TopKRouter

    if not cpu:
        return TopKRouter

    class CpuTopKRouter(TopKRouter):
        """TopKRouter whose gating is `F.linear(input, weight)` on the weight's own device (HF's gate)."""

        def gating(self, input: Tensor) -> Tensor:
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
            return F.linear(input.to(dtype), self.weight.to(dtype))

    return CpuTopKRouter


def _cpu_dispatcher(num_local_experts: int, local_expert_indices: list[int], *, config, pg_collection):
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class CpuAllGatherDispatcher(MoEAllGatherTokenDispatcher):
        """Megatron's all-gather dispatcher with its TP x EP gather / reduce-scatter as plain collectives."""

        def token_dispatch(self, hidden_states, probs):
            if self.tp_size > 1 or self.ep_size > 1:
                group = self.tp_ep_group
                with torch.no_grad():
                    self.routing_map = _AllGatherRows.apply(self.routing_map.to(torch.uint8), group).bool()
                probs = _AllGatherRows.apply(probs, group)
                hidden_states = _AllGatherRows.apply(hidden_states, group)
            return hidden_states, probs

        def token_combine(self, hidden_states):
            if self.tp_size > 1 or self.ep_size > 1:
                dtype = hidden_states.dtype
                hidden_states = _ReduceScatterRows.apply(hidden_states.to(self.local_probs.dtype),
                                                         self.tp_ep_group).to(dtype)
            return hidden_states

    return CpuAllGatherDispatcher(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)


@functools.cache
def _layer_cls():
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_default_pg_collection

    class TopPMoELayer(MoELayer):
        """See the module docstring. `cpu` and `aux_loss_coeff` are set by `use_topp_moe_layer`."""

        cpu = False
        aux_loss_coeff = 0.0

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
            pg_collection = pg_collection if pg_collection is not None else get_default_pg_collection()
            super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                             pg_collection=pg_collection)
            self.cp_group = pg_collection.cp
            self.stats: dict[str, Tensor] = {}
            if self.cpu:
                self.token_dispatcher = _cpu_dispatcher(self.num_local_experts, self.local_expert_indices,
                                                        config=config, pg_collection=pg_collection)

        def forward(self, hidden_states: Tensor, intermediate_tensors=None, padding_mask=None):
            if intermediate_tensors is not None or padding_mask is not None:
                raise ValueError("TopPMoELayer runs whole forwards only (no CUDA-graph partial capture / padding mask)")
            seq = hidden_states.shape[0]
            probs, routing_map = self.route(hidden_states)  # [S, E] each, identical on every TP rank
            probs = self._attach_aux_loss(hidden_states, probs, routing_map)
            tp_group = self.attn_tp_group
            tp = dist.get_world_size(tp_group) if tp_group is not None else 1
            # The dispatcher gathers equal row counts over TP x EP, whose ranks may hold different batches (EP
            # spans data-parallel ranks): pad with unrouted zero rows to the group's largest count, a multiple of
            # tp. Padding rows reach no expert and are dropped below.
            rows = torch.tensor([seq])
            if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
                dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=self.token_dispatcher.tp_ep_group)
            target = -(-int(rows) // tp) * tp
            x, probs, routing_map = (_pad_rows(t, target) for t in (hidden_states, probs, routing_map))
            if tp > 1:  # SP layout for the dispatcher: each TP rank sends 1/tp of the rows
                x, probs, routing_map = (_SplitRows.apply(t, tp_group) for t in (x, probs, routing_map))
            x, probs = self.preprocess(x, probs, routing_map)
            x, probs = self.dispatch(x, probs)
            out, _ = self.routed_experts_compute(x, probs)
            out = self.postprocess(self.combine(out), None)
            if tp > 1:
                out = _GatherRows.apply(out, tp_group)
            return out[:seq], None

        def _attach_aux_loss(self, hidden: Tensor, probs: Tensor, routing_map: Tensor) -> Tensor:
            """Record load statistics; with aux_loss_coeff > 0, attach the load-balancing loss's gradient."""
            config = self.config
            need_grad = self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled()
            with torch.set_grad_enabled(need_grad):
                logits = self.router.gating(hidden).reshape(-1, config.num_moe_experts)
                scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # over all experts, like HF
                # [E + 1]: tokens per expert, then tokens; summed over CP, no gradient (constants of the loss)
                counts = torch.cat([routing_map.sum(0).to(torch.float32), scores.new_tensor([routing_map.shape[0]])])
                if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
                    dist.all_reduce(counts, group=self.cp_group)
                per_expert, tokens = counts[:-1], counts[-1]
                scale = config.num_moe_experts / (config.moe_router_topk * tokens.clamp(min=1) ** 2)
                local = (scores.sum(0) * per_expert).sum() * scale  # this CP rank's share of the loss
            total = local.detach().clone()
            if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
                dist.all_reduce(total, group=self.cp_group)
            self.stats = {"tokens_per_expert": per_expert, "aux_loss": total}
            if need_grad:
                probs = MoEAuxLossAutoScaler.apply(probs, self.aux_loss_coeff * local)
            return probs

    return TopPMoELayer


_LAYERS: dict[tuple[bool, float], type] = {}


def use_topp_moe_layer(mlp_spec, *, cpu: bool, aux_loss_coeff: float = 0.0) -> None:
    """Point an MoE ModuleSpec at `TopPMoELayer` (and, on CPU, at the CPU router)."""
    key = (cpu, float(aux_loss_coeff))
    if key not in _LAYERS:
        _LAYERS[key] = type("TopPMoELayer", (_layer_cls(),), {"cpu": cpu, "aux_loss_coeff": float(aux_loss_coeff)})
    mlp_spec.module = _LAYERS[key]
    mlp_spec.submodules.router = _router_cls(cpu)


def moe_stats(model: torch.nn.Module) -> dict[str, Tensor]:
    """Summed over this model's MoE layers' last forward: `moe_aux_loss` (the switch loss, no coefficient) and
    `expert_load_max_frac` (share of a layer's routed tokens on its busiest expert, max over layers)."""
    aux, frac = [], []
    for module in model.modules():
        if isinstance(module, _layer_cls()) and module.stats:
            counts = module.stats["tokens_per_expert"]
            aux.append(module.stats["aux_loss"])
            frac.append(counts.max() / counts.sum().clamp(min=1))
    if not aux:
        return {}
    return {"moe_aux_loss": torch.stack(aux).sum(), "expert_load_max_frac": torch.stack(frac).max()}
