"""Export a Megatron backbone's weights under HF names: as a lazy iterator, to disk, or as a state dict.

Every TP rank all-gathers each parameter's shards over the TP group (a collective: ALL ranks of the group must
call these functions, also those that hold no engine), then `convert.megatron_to_hf` maps them back to HF names.
The result is bit-exact (pure indexing). Engines receive it as `Backbone.hf_named_tensors()`, which `WeightSync`
hands to their `update_weights` (the embedded engine copies in memory; the SGLang engine writes safetensors for
`/update_weights_from_disk`).
Pipeline stages (pp > 1): each stage exports its own layers (every model chunk's with virtual stages, renumbered
to the model's global indices) and its
embedding or head, and every stage receives every other stage's share over the pipeline group, one stage at a time
(a collective over the pipeline group too), so every rank sees the whole model, as at pp = 1. A tied embedding's
second copy on the last stage is not exported (the first stage's embedding is the weight).
Layers are exported one at a time (`hf_named_tensors`), so peak extra memory is one layer's full weights plus
the embeddings, not a second copy of the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from topp_rl.megatron.convert import MG_LAYER, layer_to_hf, outer_to_hf


def _gather(t: Tensor, group: dist.ProcessGroup | None) -> list[Tensor]:
    """This tensor from every rank of `group` (rank order); [t] without a group."""
    if group is None or dist.get_world_size(group) == 1:
        return [t.detach()]
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return parts


def _gathered_shards(named: dict[str, Tensor], group) -> list[dict[str, Tensor]]:
    """{name: tensor} of this rank -> one {name: tensor} per TP rank."""
    per_rank: list[dict[str, Tensor]] | None = None
    for name, tensor in named.items():
        parts = _gather(tensor, group)
        per_rank = per_rank or [{} for _ in parts]
        for shard, part in zip(per_rank, parts, strict=True):
            shard[name] = part
    return per_rank or []


def _te_names(model: torch.nn.Module) -> bool:
    return any(n.endswith("layer_norm_weight") for n, _ in model.named_parameters())


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def hf_named_tensors(backbone, *, tp_group: dist.ProcessGroup | None = None,
                     grads: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) for every HF parameter, layer by layer; `grads=True` exports `.grad` instead.

    Collective over `tp_group` (default: the backbone layout's TP group), and for MoE experts over the layout's
    EP group too. Tied models yield `lm_head.weight` only when the HF config unties it (HF ties it to
    `model.embed_tokens.weight` itself).
    """
    layout = backbone.layout
    tp_group = tp_group if tp_group is not None else layout.tp_group
    if layout.pp_size == 1:
        yield from _stage_named_tensors(backbone, tp_group=tp_group, grads=grads)
        return
    for stage in range(layout.pp_size):
        mine = dict(_stage_named_tensors(backbone, tp_group=tp_group, grads=grads)) if stage == layout.pp_rank else None
        box = [mine]
        dist.broadcast_object_list(box, src=dist.get_global_rank(layout.pp_group, stage), group=layout.pp_group)
        yield from box[0].items()


def _stage_named_tensors(backbone, *, tp_group, grads: bool) -> Iterator[tuple[str, Tensor]]:
    """`hf_named_tensors` of this pipeline stage's own weights (all of them at pp = 1; every model chunk's, under
    its global layer indices, with virtual stages)."""
    hf_config = backbone.hf_config
    ep_group = backbone.layout.ep_group
    te = _te_names(backbone.model)

    def value(p: torch.nn.Parameter) -> Tensor:
        if not grads:
            return p.detach()
        return p.grad.detach() if p.grad is not None else torch.zeros_like(p)

    params = {_global_name(n, place.layers.start): value(p)
              for model, place in zip(backbone.chunks, backbone.places, strict=True)
              for n, p in model.named_parameters()}
    if backbone.layout.pp_size > 1 and hf_config.tie_word_embeddings:
        params.pop("output_layer.weight", None)  # the tied embedding's second copy (last stage)
    by_layer: dict[int, dict[str, Tensor]] = {}
    for name, tensor in params.items():
        layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else -1
        by_layer.setdefault(layer, {})[name] = tensor
    for layer in sorted(i for i in by_layer if i >= 0):
        named = by_layer[layer]
        shards = _gathered_shards({n: t for n, t in named.items() if not _is_expert(n)}, tp_group)
        experts = {n: t for n, t in named.items() if _is_expert(n)}
        expert_shards = None
        if experts:  # per EP rank (gathered over EP), then per TP rank; the router rides along from `shards`
            by_ep = _gathered_shards(experts, ep_group)
            expert_shards = [[{**s, **e} for s, e in zip(shards, _gathered_shards(ep_part, tp_group), strict=True)]
                             for ep_part in by_ep]
        yield from layer_to_hf(shards, hf_config, layer=layer, te_names=te, expert_shards=expert_shards).items()
    outer = _gathered_shards(by_layer.get(-1, {}), tp_group)
    if backbone.layout.pp_size > 1:
        yield from _outer_stage_to_hf(outer, hf_config).items()
        return
    for name, tensor in outer_to_hf(outer, hf_config).items():
        if name == "lm_head.weight" and hf_config.tie_word_embeddings:
            continue  # HF ties it to model.embed_tokens.weight
        yield name, tensor


def _global_name(name: str, offset: int) -> str:
    """A stage's `decoder.layers.{local}.*` under the model's global layer index."""
    if not offset or not name.startswith("decoder.layers."):
        return name
    index, rest = name[len("decoder.layers."):].split(".", 1)
    return MG_LAYER.format(i=int(index) + offset) + rest


def _outer_stage_to_hf(shards: list[dict[str, Tensor]], hf_config) -> dict[str, Tensor]:
    """The embedding (first stage), final norm and untied output layer (last stage) a stage holds, under HF names."""
    vocab, out = hf_config.vocab_size, {}
    if not shards:
        return out
    if "embedding.word_embeddings.weight" in shards[0]:
        out["model.embed_tokens.weight"] = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])[:vocab]
    if "decoder.final_layernorm.weight" in shards[0]:
        out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
    if "output_layer.weight" in shards[0]:
        out["lm_head.weight"] = torch.cat([s["output_layer.weight"] for s in shards])[:vocab]
    return out


def hf_state_dict(backbone, *, tp_group=None, grads: bool = False) -> dict[str, Tensor]:
    """The full HF state dict (collective over TP); `lm_head.weight` included only for untied models."""
    return dict(hf_named_tensors(backbone, tp_group=tp_group, grads=grads))


def save_hf_checkpoint(backbone, path: str | os.PathLike, *, tp_group=None, write: bool = True) -> Path | None:
    """Write an HF checkpoint directory (config.json + model.safetensors) of the gathered weights.

    Collective over TP; only ranks with `write=True` write (pass `write=(global rank == 0)`). The file is
    written to a temporary name and renamed, so a reader never sees a half-written checkpoint.
    """
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf_named_tensors(backbone, tp_group=tp_group)}
    if not write:
        return None
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    backbone.hf_config.to_json_file(str(path / "config.json"))
    tmp = path / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / "model.safetensors")
    (path / "topp_rl_export.json").write_text(json.dumps({"tp_size": backbone.tp_size}))
    return path
