"""Rollout routing replay on the Megatron backbone: each MoE layer's router compares its own top-k with the
rollout's recorded experts and, under replay, uses the recorded ones (the HF side is `topp_rl.models.moe`).

megatron-core's `TopKRouter` hands its top-k selection to `router.router_replay.get_replay_topk(scores, topk,
num_groups, group_topk, default_compute_topk)` whenever that slot is set (`moe_enable_routing_replay` puts a
`megatron.core.transformer.moe.router_replay.RouterReplay` there). `MegatronRouterReplay` puts its own `_Slot`
there instead, because megatron's RouterReplay (0.16)
- registers every instance in one process-global list whose targets are set all at once, shared by the policy,
  the reference and every other model in the process;
- forces every row, while rows here may have no route (each sequence's last token, CP padding);
- skips the router's own top-k when replaying, which `routing_agreement` compares with the rollout's.
At the forced ids the math is megatron's replay's: the scores are gathered there and megatron's routing turns
them into weights (softmax over the k gathered logits with HF's norm_topk_prob, the full softmax's values
without it; `spec` maps both). That is HF's `replayed_weights` on the trainer's own logits, so gradients reach
the router; on rows whose recorded ids are the router's own, the values are megatron's unreplayed ones exactly.

Layout: the routers see this rank's rows in the layout's CP order (zigzag shards plus padding), every TP rank
all of them (`moe.TopPMoELayer` routes before it splits rows over TP, and EP dispatch comes after routing), so
the routes given to `using` are `cp_shard(batch routes, layout.local_positions(...), fill=NO_ROUTE)`.

Pipeline stages (pp > 1): a stage holds the routers of its own layers only (`layers`), so it replays and compares
its slice of the recorded routes [rows, MoE layers, k]: the MoE layers among its layers (`stage_slots`). Its
figures of each forward (MoE load and aux loss of its layers, its routing agreement) reach the last stage, where
the loss is computed, through `PipelineFigures`: every earlier stage sends its figures of micro-batch i to the
last stage when it runs i, the last stage receives them when it runs i (after the earlier stages, whose output
it consumes) and combines them with its own, so the last stage's figures are the whole model's, as at pp = 1.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.distributed as dist
from torch import Tensor

from topp_rl.data.routes import MoeRouting, ReplayState, replay_ids
from topp_rl.megatron.hf_config import moe_layers


def megatron_moe_routing(hf_config) -> MoeRouting | None:
    """The routing of an HF config as the Megatron backbone builds it (the HF model's `moe.moe_routing`)."""
    pattern = moe_layers(hf_config)
    if not any(pattern):
        return None
    return MoeRouting(layer_ids=tuple(i for i, sparse in enumerate(pattern) if sparse),
                      top_k=int(hf_config.num_experts_per_tok), num_experts=int(hf_config.num_experts),
                      num_hidden_layers=int(hf_config.num_hidden_layers))


class _Slot:
    """What one router calls for its top-k (megatron's `router_replay` interface; see the module docstring)."""

    def __init__(self, replay: MegatronRouterReplay, slot: int) -> None:
        self.replay, self.slot = replay, slot

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[Tensor, Tensor]:
        values, ids = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return self.replay.apply(self.slot, scores, values, ids)


def stage_slots(routing: MoeRouting, layers: range) -> slice:
    """The route slots (indices into the recorded routes' MoE-layer axis) of the MoE layers among `layers`."""
    slots = [slot for slot, layer in enumerate(routing.layer_ids) if layer in layers]
    return slice(slots[0], slots[-1] + 1) if slots else slice(0, 0)


class MegatronRouterReplay(ReplayState):
    """Installed on every MoE router of a megatron GPTModel (in layer order), the model of pipeline stage
    `layers` (default: the whole model). Inside `using(routes)` (int64 [rows, num_layers, k], every MoE layer of
    the model, over the rows the routers see; NO_ROUTE rows route by themselves) each router's own ids are kept
    for `agreement`, and with `force` it routes every row with a route to the recorded experts. Outside `using`
    the routers run untouched (megatron's own top-k)."""

    def __init__(self, model: torch.nn.Module, routing: MoeRouting, *, force: bool,
                 layers: range | None = None) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        layers = range(routing.num_hidden_layers) if layers is None else layers
        self.slots = stage_slots(routing, layers)
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        expected = self.slots.stop - self.slots.start
        if len(routers) != expected:
            raise ValueError(f"the model has {len(routers)} MoE routers, its config {expected} MoE layers among "
                             f"layers {layers.start}-{layers.stop - 1} ({list(routing.layer_ids)} in all); build "
                             "the model from that config")
        for slot, router in enumerate(routers):
            if router.config.moe_router_fusion or router.routing_type == "sinkhorn":
                # The fused kernel and sinkhorn never call `router_replay`: replay would silently do nothing.
                raise ValueError("routing replay needs megatron's unfused top-k router (moe_router_fusion=False, "
                                 f"no sinkhorn); got fusion={router.config.moe_router_fusion}, "
                                 f"routing_type={router.routing_type!r}")
            router.router_replay = _Slot(self, slot)
        super().__init__(routing, force=force, routers=len(routers))

    @property
    def routers(self) -> int:
        return len(self._own)

    @contextlib.contextmanager
    def using(self, routes: Tensor | None):
        """`ReplayState.using` with this stage's slice of the model's routes."""
        with super().using(None if routes is None else routes[:, self.slots]):
            yield

    def stage_agreement(self) -> tuple[int, int]:
        """`agreement` of the last forward; (0, 0) on a pipeline stage without MoE layers."""
        return self.agreement() if self.routers else (0, 0)

    def apply(self, slot: int, scores: Tensor, values: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(values, ids) of one router's top-k: its own, or the gathered scores at the recorded ids."""
        if self._routes is None:
            return values, ids
        self._own[slot] = ids.detach()
        if not self.force:
            return values, ids
        chosen = replay_ids(self._routes[:, slot].to(ids.device), ids)
        return scores.gather(1, chosen), chosen


# A stage's figures of one forward, as one float64 vector: the MoE aux loss summed over its layers, the busiest
# expert's share (max over its layers), its routing agreement (same, recorded), and whether the forward had routes.
_AUX, _LOAD, _SAME, _RECORDED, _ROUTED = range(5)
_GROUPS: dict[tuple[tuple[int, ...], ...], dict[tuple[int, ...], object]] = {}


def _figures_group(pp_group):
    """A gloo group over `pp_group`'s ranks, for the figures (megatron's schedule owns the pipeline group's p2p
    channel, and on NCCL a second stream of sends there would pair with its activations). Collective over the
    world: every rank creates every pipeline's group, in the same order."""
    ranks = tuple(dist.get_process_group_ranks(pp_group))
    pipelines = [None] * dist.get_world_size()
    dist.all_gather_object(pipelines, ranks)
    key = tuple(sorted(set(pipelines)))
    if key not in _GROUPS:
        _GROUPS[key] = {group: dist.new_group(list(group), backend="gloo") for group in key}
    return _GROUPS[key][ranks], ranks


class PipelineFigures:
    """Brings every stage's figures of a micro-batch's forward to the last stage (see the module docstring).
    `exchange(stats, agreement)` after each forward of this stage: the earlier stages send theirs (never
    blocking: the last stage receives after the schedule has handed it that micro-batch), the last stage
    receives the others' and returns the model's figures (`stats`: `moe.moe_stats`' keys; `agreement` or None);
    the earlier stages return their own."""

    def __init__(self, pp_group) -> None:
        self.group, ranks = _figures_group(pp_group)
        self.rank, self.last = dist.get_rank(), ranks[-1]
        self.earlier = ranks[:-1]
        self._sending: deque = deque()  # (work, buffer) of sends not yet known complete

    def exchange(self, stats: dict[str, Tensor], agreement: tuple[int, int] | None):
        own = torch.zeros(5, dtype=torch.float64)
        if stats:
            own[_AUX], own[_LOAD] = float(stats["moe_aux_loss"]), float(stats["expert_load_max_frac"])
        if agreement is not None:
            own[_SAME], own[_RECORDED], own[_ROUTED] = *agreement, 1.0
        if self.rank != self.last:
            while self._sending and self._sending[0][0].is_completed():
                self._sending.popleft()
            self._sending.append((dist.isend(own, self.last, group=self.group), own))
            return stats, agreement
        figures = [own]
        for src in self.earlier:
            theirs = torch.empty_like(own)
            dist.recv(theirs, src, group=self.group)
            figures.append(theirs)
        every = torch.stack(figures)
        stats = {"moe_aux_loss": every[:, _AUX].sum(), "expert_load_max_frac": every[:, _LOAD].max()}
        agreement = (int(every[:, _SAME].sum()), int(every[:, _RECORDED].sum())) if own[_ROUTED] else None
        return stats, agreement
