"""HF <-> megatron-core state-dict conversion (Qwen2 / Llama / Qwen3 / Qwen3-MoE / Mistral) at any TP and EP size.

Layout facts the conversion encodes (megatron-core GPTModel, local or transformer-engine spec):
- `linear_qkv` ([q; k; v] fused, column-parallel): rows are grouped per key-value group, each group holding
  its `heads / groups` query heads, then its key head, then its value head; TP rank r holds groups
  [r * groups / tp, (r + 1) * groups / tp). The QKV bias (Qwen2) follows the same layout.
- `linear_fc1` ([gate; up], column-parallel): each TP rank holds its slice of gate followed by its slice of up
  (not a slice of the concatenation).
- `linear_proj` / `linear_fc2` are row-parallel (split along the input dim); norms are replicated, also
  Qwen3's per-head `q_norm` / `k_norm` (`self_attention.q_layernorm` / `k_layernorm`, [head_dim]).
- MoE layers (`convert_moe`): the router is replicated; experts are split over EP (rank e holds experts
  [e * E / ep, (e + 1) * E / ep) as `local_experts.{j}`) and each expert over TP like a dense MLP.
- Embedding / output rows are vocab-parallel; the vocabulary may be padded with zero rows to
  `padded_vocab_size` (stripped again on export). Tied embeddings have no `output_layer.weight`.
- transformer-engine fuses the norms into the next linear (`linear_qkv.layer_norm_weight`,
  `linear_fc1.layer_norm_weight`); `te_names=True` uses those names.
Conversion is pure indexing, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from topp_rl.megatron.convert_moe import experts_to_hf, experts_to_megatron
from topp_rl.megatron.hf_config import head_dim, moe_layers

HF_LAYER = "model.layers.{i}."
MG_LAYER = "decoder.layers.{i}."


def _norm_names(te_names: bool, *, moe: bool = False) -> tuple[str, str]:
    """Names of the attention and MLP input norms; TE fuses them into the next linear (not before an MoE)."""
    if te_names:
        mlp = "pre_mlp_layernorm.weight" if moe else "mlp.linear_fc1.layer_norm_weight"
        return "self_attention.linear_qkv.layer_norm_weight", mlp
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


QK_NORMS = (("q_norm.weight", "self_attention.q_layernorm.weight"), ("k_norm.weight", "self_attention.k_layernorm.weight"))


def _qkv_sizes(hf_config) -> tuple[int, int, int]:
    return hf_config.num_attention_heads, hf_config.num_key_value_heads, head_dim(hf_config)


def _check_tp(hf_config, tp_size: int) -> None:
    heads, groups, _ = _qkv_sizes(hf_config)
    for name, value in (("num_key_value_heads", groups), ("intermediate_size", hf_config.intermediate_size)):
        if value % tp_size:
            raise ValueError(f"{name}={value} is not divisible by tp_size={tp_size}; choose a TP size dividing it")


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, hf_config, *, tp_size: int, tp_rank: int) -> Tensor:
    """HF q/k/v ([heads*d, ...], [groups*d, ...]) -> this rank's Megatron linear_qkv rows (weight or bias)."""
    heads, groups, d = _qkv_sizes(hf_config)
    rep = heads // groups
    tail = q.shape[1:]
    qg = q.reshape(groups, rep * d, *tail)
    kg, vg = k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)
    fused = torch.cat([qg, kg, vg], dim=1)  # [groups, (rep + 2) * d, ...]
    per = groups // tp_size
    return fused[tp_rank * per : (tp_rank + 1) * per].reshape(-1, *tail).clone()


def split_qkv(shards: list[Tensor], hf_config) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv` over all TP shards (in TP rank order): full HF q, k, v."""
    heads, groups, d = _qkv_sizes(hf_config)
    rep = heads // groups
    fused = torch.cat(shards, dim=0)
    tail = fused.shape[1:]
    fused = fused.reshape(groups, (rep + 2) * d, *tail)
    q, k, v = fused.split([rep * d, d, d], dim=1)
    return q.reshape(heads * d, *tail), k.reshape(groups * d, *tail), v.reshape(groups * d, *tail)


def _chunk(t: Tensor, *, dim: int, tp_size: int, tp_rank: int) -> Tensor:
    return t.chunk(tp_size, dim=dim)[tp_rank].clone()


def _pad_vocab(t: Tensor, padded_vocab_size: int) -> Tensor:
    if padded_vocab_size < t.shape[0]:
        raise ValueError(f"padded_vocab_size={padded_vocab_size} < vocab_size={t.shape[0]}; pass a size >= vocab")
    return torch.cat([t, t.new_zeros(padded_vocab_size - t.shape[0], *t.shape[1:])]) if padded_vocab_size > t.shape[0] else t


def hf_to_megatron(hf_state: Mapping[str, Tensor], hf_config, *, tp_size: int, tp_rank: int, ep_size: int = 1,
                   ep_rank: int = 0, padded_vocab_size: int | None = None, te_names: bool = False) -> dict[str, Tensor]:
    """This (TP, EP) rank's Megatron GPTModel state dict (parameters only) from a full HF state dict."""
    _check_tp(hf_config, tp_size)
    sparse = moe_layers(hf_config)
    vocab = padded_vocab_size or hf_config.vocab_size
    if vocab % tp_size:
        raise ValueError(f"padded vocab {vocab} is not divisible by tp_size={tp_size}; pad it to a multiple of tp_size")
    split = dict(tp_size=tp_size, tp_rank=tp_rank)
    out = {"embedding.word_embeddings.weight": _chunk(_pad_vocab(hf_state["model.embed_tokens.weight"], vocab), dim=0, **split)}
    for i in range(hf_config.num_hidden_layers):
        h, m = HF_LAYER.format(i=i), MG_LAYER.format(i=i)
        att = h + "self_attn."
        in_norm, mlp_norm = _norm_names(te_names, moe=sparse[i])
        for hf_name, mg_name in QK_NORMS:
            if att + hf_name in hf_state:
                out[m + mg_name] = hf_state[att + hf_name].clone()
        out[m + in_norm] = hf_state[h + "input_layernorm.weight"].clone()
        out[m + mlp_norm] = hf_state[h + "post_attention_layernorm.weight"].clone()
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf_state[att + "q_proj.weight"], hf_state[att + "k_proj.weight"], hf_state[att + "v_proj.weight"],
            hf_config, **split)
        if att + "q_proj.bias" in hf_state:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf_state[att + "q_proj.bias"], hf_state[att + "k_proj.bias"], hf_state[att + "v_proj.bias"],
                hf_config, **split)
        out[m + "self_attention.linear_proj.weight"] = _chunk(hf_state[att + "o_proj.weight"], dim=1, **split)
        if sparse[i]:
            out.update(experts_to_megatron(hf_state, hf_config, layer=i, tp_size=tp_size, tp_rank=tp_rank,
                                           ep_size=ep_size, ep_rank=ep_rank))
            continue
        gate = _chunk(hf_state[h + "mlp.gate_proj.weight"], dim=0, **split)
        up = _chunk(hf_state[h + "mlp.up_proj.weight"], dim=0, **split)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[m + "mlp.linear_fc2.weight"] = _chunk(hf_state[h + "mlp.down_proj.weight"], dim=1, **split)
    out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"].clone()
    if not hf_config.tie_word_embeddings:
        out["output_layer.weight"] = _chunk(_pad_vocab(hf_state["lm_head.weight"], vocab), dim=0, **split)
    return out


def megatron_to_hf(shards: list[Mapping[str, Tensor]], hf_config, *, ep_size: int = 1,
                   te_names: bool = False) -> dict[str, Tensor]:
    """Full HF state dict from every rank's Megatron state dict, listed by EP rank then TP rank
    (`shards[ep_rank * tp_size + tp_rank]`); the non-expert weights are read from EP rank 0."""
    if len(shards) % ep_size:
        raise ValueError(f"{len(shards)} shards is not a multiple of ep_size={ep_size}; pass ep_size x tp_size shards")
    tp_size = len(shards) // ep_size
    by_ep = [list(shards[e * tp_size : (e + 1) * tp_size]) for e in range(ep_size)]
    out = outer_to_hf(by_ep[0], hf_config)
    for i in range(hf_config.num_hidden_layers):
        out.update(layer_to_hf(by_ep[0], hf_config, layer=i, te_names=te_names, expert_shards=by_ep))
    return out


def outer_to_hf(shards: list[Mapping[str, Tensor]], hf_config) -> dict[str, Tensor]:
    """Embeddings, final norm and (untied) output layer; tied models get `lm_head.weight` = the embedding."""
    vocab = hf_config.vocab_size
    embed = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])[:vocab].clone()
    out = {"model.embed_tokens.weight": embed, "model.norm.weight": shards[0]["decoder.final_layernorm.weight"].clone()}
    if hf_config.tie_word_embeddings:
        out["lm_head.weight"] = embed
    else:
        out["lm_head.weight"] = torch.cat([s["output_layer.weight"] for s in shards])[:vocab].clone()
    return out


def layer_to_hf(shards: list[Mapping[str, Tensor]], hf_config, *, layer: int, te_names: bool = False,
                expert_shards: list[list[Mapping[str, Tensor]]] | None = None) -> dict[str, Tensor]:
    """One decoder layer's HF tensors from every TP rank's shards of it; an MoE layer's experts come from
    `expert_shards` (per EP rank, the TP ranks' shards; default: `[shards]`, i.e. EP 1)."""
    h, m = HF_LAYER.format(i=layer), MG_LAYER.format(i=layer)
    att = h + "self_attn."
    sparse = moe_layers(hf_config)[layer]
    in_norm, mlp_norm = _norm_names(te_names, moe=sparse)
    out = {
        h + "input_layernorm.weight": shards[0][m + in_norm].clone(),
        h + "post_attention_layernorm.weight": shards[0][m + mlp_norm].clone(),
        att + "o_proj.weight": torch.cat([s[m + "self_attention.linear_proj.weight"] for s in shards], dim=1),
    }
    for hf_name, mg_name in QK_NORMS:
        if m + mg_name in shards[0]:
            out[att + hf_name] = shards[0][m + mg_name].clone()
    for kind in ("weight", "bias"):
        name = m + f"self_attention.linear_qkv.{kind}"
        if name in shards[0]:
            q, k, v = split_qkv([s[name] for s in shards], hf_config)
            out[att + f"q_proj.{kind}"], out[att + f"k_proj.{kind}"], out[att + f"v_proj.{kind}"] = q, k, v
    if sparse:
        out.update(experts_to_hf(expert_shards or [shards], hf_config, layer=layer))
        return out
    out[h + "mlp.down_proj.weight"] = torch.cat([s[m + "mlp.linear_fc2.weight"] for s in shards], dim=1)
    gate_up = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
    out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in gate_up])
    out[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in gate_up])
    return out


def stage_state(state: Mapping[str, Tensor], *, layers: range, first: bool, last: bool,
                tied: bool) -> dict[str, Tensor]:
    """One pipeline stage's share of a whole model's Megatron state dict: its decoder layers renumbered from 0
    (megatron names a stage's layers locally), the embedding on the first stage, the final norm and output layer
    on the last. `tied`: the last stage holds its own copy of the tied embedding as `output_layer.weight`."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers."):].split(".", 1)
            if int(index) in layers:
                out[MG_LAYER.format(i=int(index) - layers.start) + rest] = tensor
        elif name.startswith("embedding."):
            if first:
                out[name] = tensor
        elif last:
            out[name] = tensor
    if tied and last:
        out["output_layer.weight"] = state["embedding.word_embeddings.weight"].clone()
    return out


def load_hf_into(model: torch.nn.Module, hf_state: Mapping[str, Tensor], hf_config, *, tp_size: int,
                 tp_rank: int, ep_size: int = 1, ep_rank: int = 0, stage: dict | None = None) -> None:
    """Copy a full HF state dict into this rank's GPTModel parameters (strict on parameter names); `stage`: this
    pipeline stage's `stage_state` arguments (None: the whole model)."""
    params = dict(model.named_parameters())
    te_names = any(n.endswith("layer_norm_weight") for n in params)
    vocab_rows = params.get("embedding.word_embeddings.weight", params.get("output_layer.weight"))
    # a middle pipeline stage holds neither: its vocabulary size is never used
    vocab = vocab_rows.shape[0] * tp_size if vocab_rows is not None else hf_config.vocab_size
    state = hf_to_megatron(hf_state, hf_config, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size,
                           ep_rank=ep_rank, padded_vocab_size=vocab, te_names=te_names)
    if stage is not None:
        state = stage_state(state, **stage)
    missing, unexpected = set(params) - set(state), set(state) - set(params)
    if missing or unexpected:
        raise ValueError(f"HF -> Megatron name mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    with torch.no_grad():
        for name, tensor in state.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: Megatron shape {tuple(params[name].shape)} != converted {tuple(tensor.shape)}")
            params[name].copy_(tensor)
