"""SGLang's routed-experts payload -> a `Sample`'s routes (`topp_rl.data.routes`).

SGLang 0.5.23 captures every MoE layer's top-k ids when the server runs with `--enable-return-routed-experts`
and a `/generate` asks for `return_routed_experts` (`srt/state_capturer/routed_experts.py`). For tokens
`[routed_experts_start_len, seqlen - 1)` of prompt + output (start 0 by default: the prompt and every output token
but the last, which is never fed through the model) the scheduler reads its host buffer, int32 [tokens,
num_hidden_layers, top_k] indexed by KV-cache slot, and `meta_info["routed_experts"]` carries
`base64(tensor.numpy().tobytes())`: row-major int32 in the host's byte order (little-endian on x86 and ARM).
It has a row for EVERY decoder layer; layers without a router are never written (their ids read 0), so only
the MoE layers are kept here. Fused shared experts are not in it (SGLang drops those columns on capture).
"""

import binascii
from collections.abc import Mapping
from typing import Any

import numpy as np
import pybase64
import torch

from topp_rl.data.routes import MoeRouting

ROUTES_KEY = "routed_experts"
SERVER_FLAG = "--enable-return-routed-experts"


def check_capture_device(device: str) -> None:
    """Refuse launching a server that must capture routes on CPU: SGLang 0.5.23's capturer registers CUDA host
    memory in `init_routed_experts_capturer`, so a CPU server with the flag fails at start."""
    if device == "cpu":
        raise ValueError(
            "rollout.record_routes=true with an MoE model and a CPU SGLang server: SGLang 0.5.23 captures routes "
            "only on CUDA (its capturer registers CUDA host memory in init_routed_experts_capturer, and a CPU "
            "server fails at start); set rollout.record_routes=false (and rollout.routing_replay=false), use "
            "rollout=embedded, or a CUDA server (rollout.engine.server_kwargs.device=cuda)"
        )


def encode_routes(ids: torch.Tensor) -> str:
    """SGLang's encoding of an int32 [tokens, num_hidden_layers, top_k] array (tests build payloads with it)."""
    return pybase64.b64encode(ids.to(torch.int32).numpy().astype("<i4").tobytes()).decode("utf-8")


def decode_routes(meta: Mapping[str, Any], routing: MoeRouting, *, tokens: int, name: str) -> torch.Tensor:
    """`meta_info["routed_experts"]` of an answer covering `tokens` fed tokens -> [tokens, MoE layers, top_k] in
    `routing.dtype`; ValueError (naming `name`) when it is missing, of the wrong size, or out of range."""
    payload = meta.get(ROUTES_KEY)
    if payload is None:
        raise ValueError(
            f"{name}: SGLang returned no {ROUTES_KEY!r} although the request asked for it; start the servers with "
            f"{SERVER_FLAG} (launched servers get it when rollout.record_routes=true), or set "
            "rollout.record_routes=false and rollout.routing_replay=false"
        )
    try:
        flat = np.frombuffer(pybase64.b64decode(payload, validate=True), dtype="<i4")
    except (binascii.Error, ValueError, TypeError) as err:
        raise ValueError(f"{name}: {ROUTES_KEY!r} is not base64 of int32 ids ({err})") from None
    per_token = routing.num_hidden_layers * routing.top_k
    if flat.size != tokens * per_token:
        raise ValueError(
            f"{name}: {ROUTES_KEY!r} holds {flat.size} ids, expected {tokens} fed tokens x "
            f"{routing.num_hidden_layers} layers x top_k {routing.top_k} = {tokens * per_token}; the server "
            "serves another model, or was asked for another routed_experts_start_len"
        )
    every_layer = torch.from_numpy(flat.astype(np.int32)).view(tokens, routing.num_hidden_layers, routing.top_k)
    routes = every_layer[:, list(routing.layer_ids)]
    routing.check(routes, tokens=tokens, name=name)
    return routes.to(routing.dtype)


def with_route_capture(server_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`server_kwargs` with SGLang's routed-experts capture flag added to the launch arguments."""
    extra = tuple(server_kwargs.get("extra_args", ()))
    return {**server_kwargs, "extra_args": extra if SERVER_FLAG in extra else (*extra, SERVER_FLAG)}

