"""MoE routes on HF models: read them while an engine samples (`RouteRecorder`), replay them while the trainer
scores (`RouterReplay`: rollout routing replay, "R3").

Supported routers: transformers 5.x's `Qwen3MoeTopKRouter` and `Qwen2MoeTopKRouter` (the same code): logits =
h @ W.T, probs = softmax(logits) in float32, (values, ids) = topk(probs, k), values / values.sum() when
`norm_topk_prob`, cast to the logits' dtype; the experts block weights expert ids[j]'s output by values[j].
Both read the router's own forward through a forward hook, so the module tree, parameter names and the experts
implementation (eager, grouped_mm, ...) stay HF's.

Replay keeps the rollout's ids but recomputes their weights from the trainer's own logits with the router's math
(`replayed_weights`): gradients still reach the router, and where the rollout's ids are the trainer's own the
output is HF's bit for bit. Like megatron-core's `RouterReplay` (whose hook the Megatron backbone uses), but on HF's
router output instead of inside the router, and scoped: routes apply only inside `RouterReplay.using`, so an
engine sampling with the same module (shared weights) routes by itself.
"""

import contextlib
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from topp_rl.data.routes import MoeRouting, ReplayState, replay_ids

ROUTERS = (Qwen3MoeTopKRouter, Qwen2MoeTopKRouter)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router module) of every supported router, by layer."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, ROUTERS):
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"router {name!r} is not inside a numbered decoder layer (`layers.<i>.`)")
            found.append((int(match.group(1)), module))
    return sorted(found, key=lambda pair: pair[0])


def moe_routing(model: nn.Module) -> MoeRouting | None:
    """The routing of an HF model; None for a dense one. An MoE model whose routers topp_rl cannot read fails."""
    routers = find_routers(model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not routers:
        experts = getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0
        if experts:
            raise ValueError(
                f"{type(model).__name__} has {experts} experts per MoE layer but no router topp_rl can record or "
                f"replay (supported: {', '.join(r.__name__ for r in ROUTERS)}); use a Qwen3-MoE / Qwen2-MoE model, "
                "or set rollout.record_routes=false and rollout.routing_replay=false"
            )
        return None
    shapes = {(int(r.top_k), int(r.num_experts)) for _, r in routers}
    if len(shapes) != 1:
        raise ValueError(f"{type(model).__name__}'s routers differ in (top_k, num_experts): {sorted(shapes)}")
    (top_k, num_experts), = shapes
    return MoeRouting(layer_ids=tuple(layer for layer, _ in routers), top_k=top_k, num_experts=num_experts,
                      num_hidden_layers=int(config.num_hidden_layers))


def replayed_weights(logits: Tensor, ids: Tensor, *, norm_topk_prob: bool) -> Tensor:
    """The router's expert weights [N, k] for given ids [N, k]: softmax(logits [N, E]) in float32 gathered at
    ids, renormalised over the k when `norm_topk_prob`, in the logits' dtype (HF's math with ids in place of
    its own top-k; at its own ids the same values)."""
    values = F.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    if norm_topk_prob:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype)


class RouteRecorder:
    """Inside `with`, collects the ids every router of `model` picks; `take()` returns those of the forwards since
    the last call as [rows, num_layers, k] in `routing.dtype` (rows: the batch's tokens, flattened row-major)."""

    def __init__(self, model: nn.Module, routing: MoeRouting) -> None:
        self.routers = [router for _, router in find_routers(model)]
        self.routing = routing
        self._layers: list[Tensor | None] = [None] * len(self.routers)
        self._handles: list = []

    def __enter__(self) -> "RouteRecorder":
        for slot, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(slot)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, slot: int):
        def record(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
            self._layers[slot] = output[2].to(self.routing.dtype)

        return record

    def take(self) -> Tensor:
        if any(layer is None for layer in self._layers):
            raise RuntimeError("RouteRecorder.take: a router did not run since the last take")
        routes = torch.stack(self._layers, dim=1)  # type: ignore[arg-type]
        self._layers = [None] * len(self.routers)
        return routes


class _ReplayHook:
    """A forward hook object (not a closure), so deep copies of the model (the reference) hook their own copy."""

    def __init__(self, replay: "RouterReplay", slot: int) -> None:
        self.replay, self.slot = replay, slot

    def __call__(self, module: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]):
        return self.replay.apply(self.slot, module, output)


class RouterReplay(ReplayState):
    """Permanent hooks on a training model's routers. Inside `using(routes)` (int64 [rows, num_layers, k] over the
    rows the routers see; NO_ROUTE rows route by themselves): each router's own ids are kept for `agreement`, and
    with `force` its output becomes (logits, `replayed_weights`(logits, routes), routes) on the rows with a route.
    Outside `using`, the routers run untouched."""

    def __init__(self, model: nn.Module, routing: MoeRouting, *, force: bool) -> None:
        routers = find_routers(model)
        super().__init__(routing, force=force, routers=len(routers))
        for slot, (_, router) in enumerate(routers):
            router.register_forward_hook(_ReplayHook(self, slot))

    def checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """`context_fn` of torch's non-reentrant checkpoint: a layer recomputed in the backward (gradient
        checkpointing) replays the routes of its forward, whatever `using` block is open by then."""
        return contextlib.nullcontext(), self.using(self._routes)

    def apply(self, slot: int, module: nn.Module, output: tuple[Tensor, Tensor, Tensor]):
        if self._routes is None:
            return None
        logits, weights, ids = output
        self._own[slot] = ids.detach()
        if not self.force:
            return None
        chosen = replay_ids(self._routes[:, slot], ids)  # rows without a route keep the router's own ids
        return logits, replayed_weights(logits, chosen, norm_topk_prob=bool(module.norm_topk_prob)), chosen

