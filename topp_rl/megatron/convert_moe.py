"""HF Qwen3-MoE sparse blocks <-> megatron-core MoELayer weights (SequentialMLP experts, TopKRouter), pure indexing.

HF (transformers 5): `mlp.gate.weight` [E, H]; `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows);
`mlp.experts.down_proj` [E, H, I]. Megatron: `mlp.router.weight` [E, H], replicated on every rank;
`mlp.experts.local_experts.{j}.linear_fc1.weight` [2I / tp, H] (this TP rank's gate slice, then its up slice,
as for a dense MLP) and `...linear_fc2.weight` [H, I / tp], for global expert `ep_rank * E / ep + j`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

HF_MLP = "model.layers.{i}.mlp."
MG_MLP = "decoder.layers.{i}.mlp."
LOCAL = "experts.local_experts.{j}."


def _check(hf_config, *, tp_size: int, ep_size: int) -> None:
    experts, inter = hf_config.num_experts, hf_config.moe_intermediate_size
    if experts % ep_size:
        raise ValueError(f"num_experts={experts} is not divisible by ep_size={ep_size}; choose an EP size dividing it")
    if inter % tp_size:
        raise ValueError(
            f"moe_intermediate_size={inter} is not divisible by tp_size={tp_size}; choose a TP size dividing it"
        )


def experts_to_megatron(hf_state: Mapping[str, Tensor], hf_config, *, layer: int, tp_size: int, tp_rank: int,
                        ep_size: int, ep_rank: int) -> dict[str, Tensor]:
    """One MoE layer's router and this (TP, EP) rank's experts."""
    _check(hf_config, tp_size=tp_size, ep_size=ep_size)
    h, m = HF_MLP.format(i=layer), MG_MLP.format(i=layer)
    per = hf_config.num_experts // ep_size
    inter = hf_config.moe_intermediate_size
    gate_up, down = hf_state[h + "experts.gate_up_proj"], hf_state[h + "experts.down_proj"]
    out = {m + "router.weight": hf_state[h + "gate.weight"].clone()}
    for j in range(per):
        e = ep_rank * per + j
        gate, up = gate_up[e, :inter], gate_up[e, inter:]
        fc1 = torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
        out[m + LOCAL.format(j=j) + "linear_fc1.weight"] = fc1.clone()
        out[m + LOCAL.format(j=j) + "linear_fc2.weight"] = down[e].chunk(tp_size, dim=1)[tp_rank].clone()
    return out


def experts_to_hf(shards: list[list[Mapping[str, Tensor]]], hf_config, *, layer: int) -> dict[str, Tensor]:
    """One MoE layer's HF tensors from `shards[ep_rank][tp_rank]` (each that rank's tensors of the layer)."""
    h, m = HF_MLP.format(i=layer), MG_MLP.format(i=layer)
    ep_size = len(shards)
    per = hf_config.num_experts // ep_size
    gate_up, down = [], []
    for ep_rank in range(ep_size):
        tp_shards = shards[ep_rank]
        for j in range(per):
            name = m + LOCAL.format(j=j)
            halves = [s[name + "linear_fc1.weight"].chunk(2, dim=0) for s in tp_shards]
            gate_up.append(torch.cat([g for g, _ in halves] + [u for _, u in halves]))
            down.append(torch.cat([s[name + "linear_fc2.weight"] for s in tp_shards], dim=1))
    return {
        h + "gate.weight": shards[0][0][m + "router.weight"].clone(),
        h + "experts.gate_up_proj": torch.stack(gate_up),
        h + "experts.down_proj": torch.stack(down),
    }
