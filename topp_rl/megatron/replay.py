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
"""

from __future__ import annotations

import torch
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


class MegatronRouterReplay(ReplayState):
    """Installed on every MoE router of a megatron GPTModel (in layer order). Inside `using(routes)` (int64
    [rows, num_layers, k] over the rows the routers see; NO_ROUTE rows route by themselves) each router's own
    ids are kept for `agreement`, and with `force` it routes every row with a route to the recorded experts.
    Outside `using` the routers run untouched (megatron's own top-k)."""

    def __init__(self, model: torch.nn.Module, routing: MoeRouting, *, force: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if len(routers) != routing.num_layers:
            raise ValueError(f"the model has {len(routers)} MoE routers, its config {routing.num_layers} MoE layers "
                             f"({list(routing.layer_ids)}); build the model from that config")
        for slot, router in enumerate(routers):
            if router.config.moe_router_fusion or router.routing_type == "sinkhorn":
                # The fused kernel and sinkhorn never call `router_replay`: replay would silently do nothing.
                raise ValueError("routing replay needs megatron's unfused top-k router (moe_router_fusion=False, "
                                 f"no sinkhorn); got fusion={router.config.moe_router_fusion}, "
                                 f"routing_type={router.routing_type!r}")
            router.router_replay = _Slot(self, slot)
        super().__init__(routing, force=force, routers=len(routers))

    def apply(self, slot: int, scores: Tensor, values: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(values, ids) of one router's top-k: its own, or the gathered scores at the recorded ids."""
        if self._routes is None:
            return values, ids
        self._own[slot] = ids.detach()
        if not self.force:
            return values, ids
        chosen = replay_ids(self._routes[:, slot].to(ids.device), ids)
        return scores.gather(1, chosen), chosen
