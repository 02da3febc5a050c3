"""Virtual pipeline stages: the model chunks a pipeline rank holds (megatron-core's interleaved schedule).

At vpp = 1 a pipeline rank holds one GPTModel, its stage's contiguous layers. At vpp > 1 the decoder splits into
pp x vpp equal chunks and rank r holds chunks r, r + pp, r + 2 pp, ... as a list of GPTModels (megatron's `model`
list; `vp_stage` v is the v-th of the rank's chunks, its layers `plan.chunk_layers`, megatron's
`get_transformer_layer_offset`). The embedding lives in global chunk 0 (rank 0's chunk 0), the final norm and output
layer in the last (the last rank's chunk vpp - 1). `MegatronBackbone.model` is then a `torch.nn.ModuleList` of the
chunks (so parameters, optimizers and norms see them all); `model_chunks` gives the list either way, and
`ChunkPlace` each chunk's global layers and ends, which loading (`convert.stage_state`) and export (global layer
names) read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from topp_rl.parallel import ParallelLayout
from topp_rl.parallel.plan import chunk_layers


@dataclass(frozen=True)
class ChunkPlace:
    """Where one model chunk sits in the whole model."""

    vp_stage: int | None  # its index in the rank's chunk list; None at vpp = 1 (megatron's non-interleaved model)
    layers: range  # its global decoder layers
    first: bool  # holds the embedding (the model's first chunk)
    last: bool  # holds the final norm and the output layer (the model's last chunk)
    tied: bool  # a tied embedding split over stages: the last chunk holds its own copy as output_layer.weight

    def stage_args(self) -> dict:
        """`convert.stage_state`'s arguments for this chunk's share of a whole model's state."""
        return dict(layers=self.layers, first=self.first, last=self.last, tied=self.tied)


def chunk_places(num_layers: int, layout: ParallelLayout, *, tie_word_embeddings: bool) -> list[ChunkPlace]:
    """This pipeline rank's chunks, in its model-list order (one at vpp = 1); refuses an uneven split."""
    vpp = layout.vpp_size
    ranges = chunk_layers(num_layers, layout.pp_size, vpp, layout.pp_rank)
    tied = bool(tie_word_embeddings) and layout.pp_size > 1
    return [ChunkPlace(vp_stage=v if vpp > 1 else None, layers=layers,
                       first=layout.pp_rank == 0 and v == 0, last=layout.is_last_stage and v == vpp - 1, tied=tied)
            for v, layers in enumerate(ranges)]


def chunk_module(models: list[torch.nn.Module]) -> torch.nn.Module:
    """The backbone's `model`: the GPTModel itself at vpp = 1 (unchanged), else a ModuleList of the chunks."""
    return models[0] if len(models) == 1 else torch.nn.ModuleList(models)


def model_chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The GPTModel chunks of a backbone's `model`, in vp_stage order (the schedule's `model` list)."""
    return list(model) if isinstance(model, torch.nn.ModuleList) else [model]
