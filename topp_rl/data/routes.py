"""`MoeRouting`: the shape of an MoE model's routing, and the rules a recorded route array obeys.

A route array holds, for every token an engine fed through the model (the prompt and every response token but
the last, whose successor is never sampled: SGLang's `[0, seqlen - 1)` rows), the top-k expert ids each MoE
layer picked: integer [tokens, moe_layers, k], in the router's own top-k order. Ids are stored in the smallest
dtype that holds them (uint8 up to 256 experts, else int16): `moe_layers * k` bytes per token with uint8
(Qwen3-30B-A3B: 48 layers x top-8 = 384 B). Pure data: no model code here (`topp_rl.models.moe` reads HF routers).
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# Packed batches mark a token without a recorded route (each sequence's last token) with this id.
NO_ROUTE = -1


@dataclass(frozen=True, kw_only=True)
class MoeRouting:
    """Which decoder layers route (`layer_ids`, ascending), how many experts each token gets (`top_k`) out of
    `num_experts`, and the decoder's depth (`num_hidden_layers`: SGLang returns a row for every layer)."""

    layer_ids: tuple[int, ...]
    top_k: int
    num_experts: int
    num_hidden_layers: int

    def __post_init__(self) -> None:
        if not self.layer_ids or list(self.layer_ids) != sorted(set(self.layer_ids)):
            raise ValueError(f"MoeRouting layer_ids {self.layer_ids} must be a non-empty ascending list")
        if not 0 < self.top_k <= self.num_experts <= torch.iinfo(torch.int16).max:
            raise ValueError(
                f"MoeRouting top_k={self.top_k}, num_experts={self.num_experts}: need 0 < top_k <= num_experts "
                f"<= {torch.iinfo(torch.int16).max}"
            )
        if self.layer_ids[-1] >= self.num_hidden_layers:
            raise ValueError(
                f"MoeRouting layer id {self.layer_ids[-1]} is outside the decoder's {self.num_hidden_layers} layers"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.num_experts <= 256 else torch.int16

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.top_k * self.dtype.itemsize

    def check(self, routes: torch.Tensor, *, tokens: int, name: str) -> None:
        """Raise ValueError (naming `name`, the layer and the token) unless `routes` is [tokens, num_layers,
        top_k] of integer ids in [0, num_experts)."""
        want = (tokens, self.num_layers, self.top_k)
        if routes.dtype.is_floating_point or routes.dtype.is_complex or routes.dtype == torch.bool:
            raise ValueError(f"{name}: routes have dtype {routes.dtype}; expert ids are integers ({self.dtype})")
        if tuple(routes.shape) != want:
            raise ValueError(
                f"{name}: routes have shape {tuple(routes.shape)}, expected {want} (tokens fed through the model = "
                f"prompt + response - 1, MoE layers {list(self.layer_ids)}, top_k {self.top_k}); record routes "
                "with the model that is trained"
            )
        bad = (routes.long() < 0) | (routes.long() >= self.num_experts)
        if bool(bad.any()):
            token, layer, slot = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name}: MoE layer {layer} (decoder layer {self.layer_ids[layer]}) routes token {token} to expert "
                f"{int(routes[token, layer, slot])}, outside [0, {self.num_experts}); the routes come from another "
                "model or were decoded wrongly"
            )


def replay_ids(want: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The expert ids [rows, k] a replaying router uses: the recorded ones `want` [rows, k], or on rows without a
    route (NO_ROUTE in column 0: each sequence's last token, CP padding) the router's own `own` [rows, k]."""
    if want.shape != own.shape:
        raise ValueError(f"replayed routes of an MoE layer have shape {tuple(want.shape)}, the router produced "
                         f"{tuple(own.shape)}; pass one route row per token the model sees")
    return torch.where(want[:, :1] != NO_ROUTE, want.to(own.dtype), own)


def route_agreement(want: torch.Tensor, own: torch.Tensor) -> tuple[int, int]:
    """(token-layer routes whose own top-k set equals the recorded one, token-layer routes recorded), of recorded
    routes `want` [rows, L, k] (NO_ROUTE rows are not counted) and the routers' own ids `own` [L, rows, k]."""
    want = want.transpose(0, 1)  # [L, rows, k]
    recorded = want[..., 0] != NO_ROUTE
    same = (own.sort(dim=-1).values == want.to(own.dtype).sort(dim=-1).values).all(dim=-1) & recorded
    return int(same.sum()), int(recorded.sum())


class ReplayState:
    """What a backbone's route replay keeps between its routers' calls (HF: `topp_rl.models.moe.RouterReplay`; Megatron:
    `topp_rl.megatron.replay.MegatronRouterReplay`): the routes of the forward inside `using(routes)` (int64
    [rows, num_layers, k]; NO_ROUTE rows route by themselves), whether to `force` them, and each router's own
    top-k ids of that forward for `agreement`. Outside `using`, the routers run untouched."""

    def __init__(self, routing: MoeRouting, *, force: bool, routers: int) -> None:
        self.routing, self.force = routing, force
        self._routes: torch.Tensor | None = None
        self._own: list[torch.Tensor | None] = [None] * routers

    @contextlib.contextmanager
    def using(self, routes: torch.Tensor | None) -> Iterator[None]:
        previous, self._routes = self._routes, routes
        self._own = [None] * len(self._own)
        try:
            yield
        finally:
            self._routes = previous

    def agreement(self) -> tuple[int, int]:
        """(token-layer routes whose own top-k set equals the recorded one, token-layer routes recorded) over the
        rows of the last forward inside `using`."""
        if self._routes is None or any(own is None for own in self._own):
            raise RuntimeError(f"{type(self).__name__}.agreement: no forward ran inside `using` with routes")
        return route_agreement(self._routes, torch.stack(self._own))  # type: ignore[arg-type]
