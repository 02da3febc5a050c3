"""`Backbone`: what `PolicyModule` needs from a policy body; `BackboneBase`, the one base class every backbone
derives from; and `HFBackbone`, the backbone of HF causal LMs.

A backbone turns a packed micro-batch into this rank's final hidden states and output-layer weight; the scorer
(`ToppLogProb`) does the rest, so no backbone ever forms [T, V] logits. It also runs the step's micro-batch
schedule (`BackboneBase.forward_backward`), so a pipeline-parallel backbone can run its own. Optional capabilities
(a frozen base, sharded weights, MoE figures) are `BackboneBase` methods and flags with neutral defaults, never
types to probe. Every backbone carries the `ParallelLayout` it was built for (the one owner of a run's layout is
whoever builds the backbone: `HFBackbone` for a single rank, `MegatronStrategy` under TP / CP), so the module reads
its layout from the backbone instead of rebuilding it from globals. Implementations: `HFBackbone` (here),
`topp_rl.trainer.lora.LoraBackbone`, `topp_rl.fsdp.FSDPBackbone` and `topp_rl.megatron.MegatronBackbone`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers.modeling_layers import GradientCheckpointingLayer

from topp_rl.data import PackedBatch
from topp_rl.data.routes import NO_ROUTE, MoeRouting
from topp_rl.models.moe import RouterReplay, moe_routing
from topp_rl.parallel import ParallelLayout

T = TypeVar("T")
# (micro-batch index, batch, hidden [T_local, H], output weight [V_local, H]) -> (loss to backpropagate, output)
StepFn = Callable[[int, PackedBatch, Tensor, Tensor], tuple[Tensor, T]]
ForwardFn = Callable[[PackedBatch, Tensor, Tensor], T]  # (batch, hidden, output weight) -> output


@runtime_checkable
class WeightSource(Protocol):
    """Anything that exports a policy's weights under HF names (`PolicyModule`, every `Backbone`)."""

    def hf_named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(HF parameter name, full tensor) pairs; a collective over the TP group where sharded."""
        ...


@runtime_checkable
class Backbone(WeightSource, Protocol):
    """A policy body (a `BackboneBase`) seen through what training needs from it: the required members below, the
    micro-batch schedule (`forward_backward`, `forward_only`) and `BackboneBase`'s optional capabilities."""

    @property
    def layout(self) -> ParallelLayout:
        """This rank's TP / CP / PP coordinates; `vocab_size` is the model's full vocabulary."""
        ...

    @property
    def hf_config(self):
        """The HF `PretrainedConfig` the body was built from (architecture, vocabulary, export)."""
        ...

    def forward_hidden(self, batch: PackedBatch) -> tuple[Tensor, Tensor]:
        """(final normed hidden states [T_local, H] in `layout`'s CP order, output weight [V_local, H])."""
        ...

    def forward_backward(self, micro_batches: Sequence[PackedBatch], step_fn: StepFn[T], *,
                         backward: Callable[[Tensor], None] = Tensor.backward) -> list[T]:
        """Gradients of every micro-batch's loss accumulated into .grad; `step_fn`'s outputs in micro-batch order."""
        ...

    def forward_only(self, micro_batches: Sequence[PackedBatch], fn: ForwardFn[T]) -> list[T]:
        """`fn(batch, hidden, weight)` of every micro-batch without gradients, in micro-batch order."""
        ...

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip gradients like `torch.nn.utils.clip_grad_norm_` on the unsharded model; the norm before."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def requires_grad_(self, requires_grad: bool = True) -> Backbone: ...

    def eval(self) -> Backbone: ...


class BackboneBase(nn.Module):
    """The one base of every backbone: the micro-batch schedule, and each optional capability as a method or flag
    whose default means "not this kind of backbone", so callers call instead of probing types.

    Schedule: `forward_backward` runs the step's micro-batches one after the other (forward, loss, backward), the
    plain loop every single-stage backbone shares. The seam is megatron-core's `forward_backward_func`: `step_fn`
    plays its `loss_func` on the forward's output, so a pipeline-parallel backbone can override it with the 1F1B
    schedule, calling `step_fn` on its last stage only (`layout.is_last_stage`) and handing every rank the same
    outputs, so that every rank logs the same metric keys.
    """

    has_frozen_base: ClassVar[bool] = False  # adapters on a frozen base: `base_weights()` is the KL reference
    shards_weights: ClassVar[bool] = False  # weights sharded over ranks: whole only inside `gathered()`

    def forward_backward(self, micro_batches: Sequence[PackedBatch], step_fn: StepFn[T], *,
                         backward: Callable[[Tensor], None] = Tensor.backward) -> list[T]:
        """For micro-batch i: `loss, out = step_fn(i, batch, hidden, weight)` on its `forward_hidden`, then
        `backward(loss)` (the module's `manual_backward`, so a strategy's backward hooks run); returns the `out`s.
        Gradient reduction over ranks may wait for the last backward (`set_gradient_sync`)."""
        outputs = []
        for i, batch in enumerate(micro_batches):
            self.set_gradient_sync(i == len(micro_batches) - 1)  # one reduction per step
            hidden, weight = self.forward_hidden(batch)
            loss, out = step_fn(i, batch, hidden, weight)
            backward(loss)
            outputs.append(out)
        return outputs

    @torch.no_grad()
    def forward_only(self, micro_batches: Sequence[PackedBatch], fn: ForwardFn[T]) -> list[T]:
        """`fn(batch, hidden, weight)` of each micro-batch's `forward_hidden`, without gradients (the on-policy and
        reference passes)."""
        return [fn(batch, *self.forward_hidden(batch)) for batch in micro_batches]

    def set_gradient_sync(self, enabled: bool) -> None:
        """Reduce gradients over the data-parallel ranks in the next backward (True) or only accumulate them. No-op
        here: gradients are reduced by the strategy's backward hooks, or not at all (one rank)."""

    def base_weights(self) -> contextlib.AbstractContextManager[None]:
        """Forward passes inside the block use the frozen base weights (the adapters disabled); only where
        `has_frozen_base`."""
        raise TypeError(f"{type(self).__name__} has no frozen base (has_frozen_base is False): ask has_frozen_base "
                        "before entering base_weights()")

    def drop_base(self, state_dict: dict[str, Tensor], *, prefix: str) -> dict | None:
        """Remove the frozen base's entries from a checkpoint's state dict (the run rebuilds it from its config);
        the record `restore_base` checks. None: the checkpoint keeps every weight (the default)."""
        return None

    def restore_base(self, state_dict: dict[str, Tensor], record: dict, *, prefix: str) -> None:
        """Fill the entries `drop_base` left out back in from this backbone, checking `record` (the same base).
        Nothing to do for a backbone that leaves nothing out."""

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        """The whole model unsharded for the block (where `shards_weights`: a collective, every rank enters it
        together); the weights are whole already by default."""
        return contextlib.nullcontext()

    def routing_agreement(self) -> tuple[float, float] | None:
        """MoE: (token-layer routes whose own top-k set equals the recorded one, token-layer routes recorded) of the
        last `forward_hidden`; None when its batch carried no routes, or the model has no routers to compare."""
        return None

    def moe_stats(self) -> dict[str, Tensor]:
        """MoE load figures of the last forward, logged as `train/<name>` (`MegatronBackbone`: `moe_aux_loss`,
        `expert_load_max_frac`); {} for backbones that report none."""
        return {}


# HF config fields that transform the logits after the output layer, with the value that leaves them unchanged.
# The scorer computes hidden @ W.T; a model that rescales or soft-caps its logits samples from another
# distribution, and every log-prob would be wrong by that transform.
LOGIT_TRANSFORMS: dict[str, float | None] = {
    "logits_scaling": 1.0,  # Granite: logits / logits_scaling
    "logit_scale": 1.0,  # Cohere: logits * logit_scale
    "final_logit_softcapping": None,  # Gemma 2 / 3: tanh(logits / cap) * cap
    "output_multiplier_scale": 1.0,  # muP-style output multipliers
}


def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters and gradients), the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def nonfinite_parameters(module: nn.Module) -> list[str]:
    """Names of the parameters holding a NaN or an infinity (one fused check per tensor; this rank's shard of a
    sharded one, so no collective: callers decide over all ranks)."""
    return [n for n, p in module.named_parameters() if not bool(torch.isfinite(local_tensor(p.detach())).all())]


def check_plain_logits(model: nn.Module, *, probe_tokens: int = 8) -> None:
    """Reject models whose logits are not `final hidden @ lm_head.weight.T`: known config fields first, then
    (for architectures nobody listed) one forward of a few tokens comparing the model's own logits with that
    product, so an unknown transform fails at start instead of training on wrong log-probs."""
    config, name = model.config, type(model).__name__
    for field, neutral in LOGIT_TRANSFORMS.items():
        value = getattr(config, field, neutral)
        if value != neutral:
            raise ValueError(
                f"{name} config {field}={value!r} transforms the logits after the output layer (neutral value: "
                f"{neutral!r}); topp_rl scores tokens with hidden @ lm_head.weight.T, so its log-probs would not be "
                "the sampler's: use a model without this transform (Qwen2 / Llama families)"
            )
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError(
            f"{name} has {'no output layer' if head is None else 'an lm_head bias'}; training needs logits = "
            "hidden @ lm_head.weight.T: use a causal LM without an output bias (Qwen2 / Llama families)"
        )
    vocab = head.weight.shape[0]
    ids = torch.arange(probe_tokens, device=head.weight.device)[None] % vocab
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
        product = (hidden @ head.weight.T).float()
    err = float((logits - product).abs().max())
    bound = 1e-5 * max(1.0, float(logits.abs().max()))
    if not err <= bound:  # also catches NaN
        raise ValueError(
            f"{name}'s logits differ from final hidden @ lm_head.weight.T by {err:.3g} (allowed {bound:.3g}) on a "
            f"{probe_tokens}-token probe: the model transforms its logits in a way topp_rl does not replicate, so "
            "its log-probs would be wrong; use a model whose logits are that product (Qwen2 / Llama families)"
        )


class HFBackbone(BackboneBase):
    """An HF causal LM run whole on one rank (no TP / CP), as a `Backbone`.

    HF attention on CPU does not build block-diagonal masks from packed position ids, so each packed batch is
    unpacked into a right-padded [B, L] batch and the final hidden states are re-packed to [T, H] (exact:
    causal attention never looks at the right padding). Requires logits = hidden @ lm_head.weight.T, checked at
    construction (`check_plain_logits`).

    `gradient_checkpointing=True` recomputes each decoder layer's activations in the backward instead of
    storing them (HF's own layer checkpointing, non-reentrant): the same values and gradients, less memory,
    about one more forward of compute.

    MoE models (`topp_rl.models.moe`): a batch carrying routes has each token's own top-k compared with them
    (`routing_agreement`); `routing_replay=True` also forces them (`RouterReplay`), and then every batch must carry
    routes. A dense model refuses `routing_replay=True`.
    """

    def __init__(
        self, model: nn.Module, *, gradient_checkpointing: bool = False, routing_replay: bool = False
    ) -> None:
        super().__init__()
        bad = nonfinite_parameters(model)
        if bad:
            raise ValueError(
                f"{type(model).__name__} has non-finite weights (NaN or inf) in {len(bad)} parameter(s), first "
                f"{bad[0]!r}; training would give NaN log-probs and losses: load a healthy checkpoint"
            )
        check_plain_logits(model)
        head = model.get_output_embeddings()
        self.model = model
        self._layout = ParallelLayout.single(int(head.weight.shape[0]))
        self.routing = moe_routing(model)
        if routing_replay and self.routing is None:
            raise ValueError(
                f"routing_replay=True needs an MoE model; {type(model).__name__} has no MoE layers: turn replay off"
            )
        self.routing_replay = routing_replay
        self.replay = RouterReplay(model, self.routing, force=routing_replay) if self.routing else None
        self._agreement: tuple[float, float] | None = None
        context_fn = self.replay.checkpoint_contexts if self.replay is not None else None
        self._checkpointed = _enable_checkpointing(model, context_fn) if gradient_checkpointing else []

    @property
    def layout(self) -> ParallelLayout:
        return self._layout

    @property
    def hf_config(self):
        return self.model.config

    def output_weight(self) -> Tensor:
        return self.model.get_output_embeddings().weight

    def forward_hidden(self, batch: PackedBatch) -> tuple[Tensor, Tensor]:
        lengths = batch.seq_lengths.to(batch.tokens.device)
        width = int(lengths.max())
        valid = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]  # [B, L]
        input_ids = torch.zeros(valid.shape, dtype=torch.long, device=lengths.device)
        position_ids = torch.zeros_like(input_ids)
        input_ids[valid] = batch.tokens  # row-major boolean indexing == sequences back to back
        position_ids[valid] = batch.position_ids
        for layer in self._checkpointed:
            # HF checkpoints a layer only while it is in training mode. The policy stays in eval mode (no
            # dropout: the scores must match the rollout's), so only the layers themselves are flagged, each
            # call (anything may have called .eval() since); their dropout children stay in eval mode.
            layer.training = True
        routes = self._padded_routes(batch, valid)
        self._agreement = None
        with self.replay.using(routes) if self.replay is not None else contextlib.nullcontext():
            # Through __call__, so a sharding wrapper's hooks (FSDP2's gather of the root's weights) run.
            hidden, weight = self(input_ids=input_ids, attention_mask=valid.long(), position_ids=position_ids)
            if routes is not None:
                self._agreement = tuple(map(float, self.replay.agreement()))
        return hidden[valid], weight

    def forward(self, *, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(final normed hidden states [B, L, H] of the padded batch, output weight [V, H])."""
        out = self.model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return out.last_hidden_state, self.output_weight()

    def _padded_routes(self, batch: PackedBatch, valid: Tensor) -> Tensor | None:
        """The batch's routes [T, L, k] laid out like the padded batch the routers see ([B * W, L, k], int64),
        NO_ROUTE on padding; None when the batch has none (refused under routing replay)."""
        routes = batch_routes(batch, self.routing, replay=self.routing_replay, model=type(self.model).__name__)
        if routes is None:
            return None
        padded = torch.full((*valid.shape, *routes.shape[1:]), NO_ROUTE, dtype=torch.long, device=valid.device)
        padded[valid] = routes.to(device=valid.device, dtype=torch.long)
        return padded.flatten(0, 1)

    def routing_agreement(self) -> tuple[float, float] | None:
        return self._agreement

    def clip_grad_norm_(self, max_norm: float) -> float:
        params = [p for p in self.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def hf_named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, param.detach()


def batch_routes(batch: PackedBatch, routing: MoeRouting | None, *, replay: bool, model: str) -> Tensor | None:
    """The batch's routes [T, L, k] checked against the model's routing (`model` names it in errors); None when
    the batch has none, which routing replay refuses."""
    if batch.routes is None:
        if replay:
            raise ValueError(
                "routing replay is on but this batch carries no routes: the rollout engine recorded none; "
                "record routes (rollout.record_routes=true) or turn replay off (rollout.routing_replay=false)"
            )
        return None
    if routing is None:
        raise ValueError(f"the batch carries routes but {model} has no MoE layers")
    shape = (routing.num_layers, routing.top_k)
    if tuple(batch.routes.shape[1:]) != shape or batch.routes.shape[0] != batch.tokens.numel():
        raise ValueError(
            f"batch routes have shape {tuple(batch.routes.shape)}, expected ({batch.tokens.numel()}, *{shape}) "
            "(tokens, MoE layers, top_k); the rollout came from another model"
        )
    if int(batch.routes.max()) >= routing.num_experts:
        raise ValueError(f"batch routes hold expert id {int(batch.routes.max())}, outside the model's "
                         f"{routing.num_experts} experts; the rollout came from another model")
    return batch.routes


def _enable_checkpointing(model: nn.Module, context_fn=None) -> list[nn.Module]:
    """Turn on HF's per-layer gradient checkpointing (with torch's `context_fn` when given: routing replay
    re-installs a layer's routes for its recompute); returns the checkpointed layers."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing; set "
            "module.gradient_checkpointing=false"
        )
    kwargs = {"use_reentrant": False} | ({"context_fn": context_fn} if context_fn is not None else {})
    if hasattr(model, "activation_checkpointing_enable"):  # its name since transformers 5.2x; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} enabled gradient checkpointing on no layer (no GradientCheckpointingLayer); "
            "set module.gradient_checkpointing=false"
        )
    return layers
