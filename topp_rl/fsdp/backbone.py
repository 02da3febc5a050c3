"""`FSDPBackbone`: an `HFBackbone` sharded with FSDP2 (`fully_shard`) over all ranks, as a `Backbone`.

Sharding units (torchtitan's layout): every decoder layer, the input embeddings when untied, and the root, which is
the `HFBackbone` itself and keeps the final norm and the output layer (and the embeddings when tied: one parameter,
one unit). The root is called through its `forward`, so FSDP2 gathers its weights and returns the output weight
unsharded to the candidate head, which never forms [T, V] logits; the root does not reshard after forward (it is
needed again at once for the scores and the backward). Its gradient reaches FSDP2 through that returned tensor.

Gradients are SUMMED over ranks (divide factor 1): the losses divide by the whole step's token / sequence counts
over every rank, so the full-batch gradient is the sum of the ranks' gradients, as under `MegatronStrategy`.
`set_gradient_sync(False)` keeps the unsharded gradients of all but the last micro-batch local: one reduce-scatter
per optimizer step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from topp_rl.data import PackedBatch
from topp_rl.parallel import ParallelLayout
from topp_rl.parallel.dtensor import full_tensor
from topp_rl.trainer.backbone import BackboneBase, HFBackbone
from topp_rl.trainer.lora import LoraBackbone, merged_named_tensors


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(
            f"{type(model).__name__}'s decoder has no `layers` ModuleList to shard one by one; FSDP here supports HF "
            "decoder-only models laid out like Qwen2 / Llama (model.layers); use parallel=none for this model"
        )
    return list(layers)


def _tied(model: nn.Module) -> bool:
    return model.get_input_embeddings().weight is model.get_output_embeddings().weight


class FSDPBackbone(BackboneBase):
    """`HFBackbone` sharded in place over `mesh` (see module docstring); `inner` is the sharded HFBackbone. It runs
    `BackboneBase.forward_backward`'s loop, reducing gradients after the last micro-batch's backward only."""

    shards_weights = True

    def __init__(self, inner: HFBackbone, *, mesh: DeviceMesh, cpu_offload: bool = False,
                 mp_policy: MixedPrecisionPolicy | None = None) -> None:
        super().__init__()
        if not isinstance(inner, HFBackbone):
            raise TypeError(f"FSDPBackbone shards an HFBackbone, got a {type(inner).__name__}")
        model = inner.model
        kwargs = {"mesh": mesh} | ({"offload_policy": CPUOffloadPolicy()} if cpu_offload else {})
        if mp_policy is not None:  # gathers in its param_dtype; the shards (and AdamW) stay in their own dtype
            kwargs["mp_policy"] = mp_policy
        units = _decoder_layers(model)
        if not _tied(model):
            units.insert(0, model.get_input_embeddings())
        for unit in units:
            fully_shard(unit, reshard_after_forward=True, **kwargs)
        fully_shard(inner, reshard_after_forward=False, **kwargs)
        self.inner = inner
        self._layout = dataclasses.replace(inner.layout, fsdp_size=mesh.size())
        self.units: list[FSDPModule] = [*units, inner]
        for unit in self.units:  # per unit (not recursive)
            unit.set_gradient_divide_factor(1.0)  # sum, see module docstring
            # A custom factor makes FSDP2 reduce with PREMUL_SUM, which gloo lacks; plain SUM (with a scaling by
            # 1.0, exact) runs on gloo and NCCL alike.
            unit.set_force_sum_reduction_for_comms(True)
        with torch.no_grad():  # FSDP2 picks its root on the first forward: make it `inner`, before any engine runs
            inner(**_probe(inner))
        inner.reshard()

    @property
    def layout(self) -> ParallelLayout:
        return self._layout

    @property
    def hf_config(self):
        return self.inner.hf_config

    @property
    def model(self) -> nn.Module:
        return self.inner.model

    @property
    def routing_replay(self) -> bool:
        return self.inner.routing_replay

    def forward_hidden(self, batch: PackedBatch) -> tuple[Tensor, Tensor]:
        return self.inner.forward_hidden(batch)

    def routing_agreement(self) -> tuple[float, float] | None:
        return self.inner.routing_agreement()

    def set_gradient_sync(self, enabled: bool) -> None:
        """Off for all but the last micro-batch: their unsharded gradients stay local, one reduce-scatter a step."""
        self.inner.set_requires_gradient_sync(enabled)  # recursive: every unit

    def clip_grad_norm_(self, max_norm: float) -> float:
        """torch's clip on the DTensor gradients: each rank's shard squares, summed over ranks (the unsharded
        model's norm), and every shard scaled by the same factor."""
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def hf_named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Full tensors under HF names, one all-gather per parameter: every rank must walk the whole iterator."""
        for name, param in self.inner.model.named_parameters():
            yield name, full_tensor(param.detach())

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """The whole model unsharded for the block (one all-gather per unit, on every rank together) and kept so
        through any number of forwards of the HF model (an engine's decode steps: no collective per step);
        resharded after, so no second copy outlives it."""
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
        for unit in self.units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.units:
                unit.reshard()
                unit.set_reshard_after_forward(unit is not self.inner, recurse=False)
            # The HF model's own forward entered FSDP2 through a layer, which claimed this iteration's forward
            # root; release it so the next training forward runs the root's pre-forward (stream waits on GPU).
            self.inner._get_fsdp_state()._state_ctx.iter_forward_root = None


class FSDPLoraBackbone(FSDPBackbone):
    """A `LoraBackbone` sharded like any HF backbone (`has_frozen_base`): each decoder-layer unit holds its layer's
    frozen base weights and its adapters together (FSDP2 units may mix frozen and trainable parameters), so each
    rank keeps 1/world of both, and the optimizer (built over the parameters that require grad) 1/world of the
    adapters' AdamW state. The KL reference is the sharded base itself, PEFT's adapters disabled around its passes.
    Checkpoints are the strategy's sharded ones: base shards included (not left out as by `LoraBackbone`)."""

    has_frozen_base = True

    def __init__(self, inner: LoraBackbone, **kwargs) -> None:
        if not isinstance(inner, LoraBackbone):
            raise TypeError(f"FSDPLoraBackbone shards a LoraBackbone, got a {type(inner).__name__}")
        super().__init__(inner, **kwargs)

    def base_weights(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.base_weights()

    def hf_named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The MERGED full weights under plain HF names: each base weight and its A / B gathered whole, then
        W + B @ A * alpha / rank (`merged_named_tensors`); every rank must walk the whole iterator."""
        return merged_named_tensors(self.inner.model, full_tensor)


def shard_backbone(inner: HFBackbone, **kwargs) -> FSDPBackbone:
    """`FSDPLoraBackbone` for a `LoraBackbone`, else `FSDPBackbone` (keyword arguments: `FSDPBackbone`'s)."""
    return (FSDPLoraBackbone if isinstance(inner, LoraBackbone) else FSDPBackbone)(inner, **kwargs)


def _probe(inner: HFBackbone) -> dict[str, Tensor]:
    device = next(p for p in inner.parameters()).to_local().device
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.zeros_like(ids)}
