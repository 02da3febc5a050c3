"""Optimizer state across pipeline sizes: a checkpoint's per-stage AdamW state regrouped for another pp_size.

A torch optimizer's state dict numbers its parameters in the order the optimizer holds them; at pp > 1 every stage
numbers its own, and its layer names are local (stage 1 of 2 calls layer 2 `decoder.layers.0`). Saved beside each
state, `global_param_names` names every number with the layer's global index, so the states of all saved stages
can be merged by name and split again along the stages of another pipeline size (`restage`). The TP and EP sizes
must be the saved ones: a parameter's shard, and so its moments, are the same at any pp only at the same TP / EP.

A tied embedding is one parameter at pp = 1 and two copies at pp > 1 (the first stage's embedding, the last
stage's `output_layer.weight`), whose gradients are summed after each step, so both copies hold the embedding's
moments: the copy takes the embedding's state when the saved run had none of its own.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

_LAYER = re.compile(r"^model\.decoder\.layers\.(\d+)\.")
_TIED_COPY, _EMBEDDING = "model.output_layer.weight", "model.embedding.word_embeddings.weight"


def global_param_names(backbone: nn.Module) -> list[str]:
    """The names of a `MegatronBackbone`'s trainable parameters in optimizer order (`PolicyModule.configure_optimizers`
    hands it `parameters()` that require grad), each model chunk's decoder layers numbered from its first global
    layer (`backbone.places`; with virtual stages a rank holds several chunks, named as at pp = 1, so the state also
    restores at another vpp_size)."""

    def renumber(name: str, first: int) -> str:
        return _LAYER.sub(lambda m: f"model.decoder.layers.{int(m[1]) + first}.", f"model.{name}")

    # named by the GPTModel chunks: the backbone also holds a tied copy as its own attribute (`tied_copy`), which
    # would name the first stage's embedding and the last stage's output layer alike
    chunks = zip(backbone.chunks, backbone.places, strict=True)
    names = {id(p): renumber(n, place.layers.start) for chunk, place in chunks for n, p in chunk.named_parameters()}
    return [names[id(p)] for p in backbone.parameters() if p.requires_grad]


def restage(saved: list[tuple[list[str], dict[str, Any]]], names: list[str]) -> dict[str, Any]:
    """The optimizer state dict for parameters `names` (this stage's `global_param_names`), from the saved stages'
    (names, state dict) pairs of the same TP / EP rank. Parameters that never had state (no gradient yet) stay
    without; hyper-parameters (lr, betas, ...) are the saved ones, equal on every stage."""
    by_name: dict[str, Any] = {}
    known: set[str] = set()
    groups = []
    for saved_names, state in saved:
        (group,) = _one_group(state)
        if len(group["params"]) != len(saved_names):
            raise ValueError(f"a saved optimizer stage has {len(group['params'])} parameters and "
                             f"{len(saved_names)} names: the checkpoint is inconsistent")
        groups.append({k: v for k, v in group.items() if k != "params"})
        known.update(saved_names)
        for index, name in zip(group["params"], saved_names, strict=True):
            if index in state["state"]:
                by_name[name] = state["state"][index]
    if any(g != groups[0] for g in groups):
        raise ValueError(f"the saved stages' optimizer hyper-parameters differ ({groups}); they restore only at "
                         "the saved pipeline size")
    state = {}
    for index, name in enumerate(names):
        source = name if name in known else _EMBEDDING if name == _TIED_COPY else None
        if source is None or source not in known:
            raise ValueError(f"parameter {name} of this pipeline stage is in none of the saved stages' optimizer "
                             f"states; the checkpoint is of another model or TP / EP size")
        if source in by_name:
            state[index] = by_name[source]
    return {"state": state, "param_groups": [{**groups[0], "params": list(range(len(names)))}]}


def _one_group(state: dict[str, Any]) -> list[dict[str, Any]]:
    groups = state["param_groups"]
    if len(groups) != 1:
        raise ValueError(f"the saved optimizer state has {len(groups)} parameter groups; the state of one group "
                         "(PolicyModule's) restores at another pipeline size")
    return groups
