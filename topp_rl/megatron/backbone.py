"""A megatron-core GPTModel backbone for HF Qwen2 / Llama / Qwen3 / Qwen3-MoE / Mistral configs (`spec` maps each
family), returning final hidden states, not logits.

A `topp_rl.trainer.backbone.Backbone`: `MegatronBackbone.forward_hidden(batch)` runs one packed (THD) micro-batch and
returns this rank's final hidden states (after the final norm) [T_local, H] in the layout's CP order
(`layout.local_positions(seq_lengths)` gives each row's position in the unsharded packed stream, -1 = CP
padding) and the output-layer weight shard [V_local, H]. The loss side feeds these straight into
`ToppLogProb` / `candidate_head_logprobs`, so no [T, V] logits exist for rows with candidates. The backbone is
built for one `ParallelLayout` (the strategy's, built once from its process groups) and keeps it.

TP gradient contract: the hidden-state gradient is summed over TP exactly once, inside
`candidate_head_logprobs` (its backward all-reduces d hidden over `tp_group`). We never call Megatron's
`output_layer`, whose `copy_to_tensor_model_parallel_region` would all-reduce it a second time.

CP: sequences are split zigzag (`cp_local_positions(mode="zigzag")`: each sequence padded to a multiple of
2 * cp_size, rank r holds chunks r and 2 * cp_size - 1 - r), which is also the layout Megatron's THD RoPE
expects from `cu_seqlens_q_padded`. The all-gather layout (contiguous slices of the packed stream) is not
supported: Megatron's THD RoPE and transformer-engine's CP attention both assume the load-balanced zigzag
split, so a layout with cp_mode="allgather" and cp_size > 1 is rejected.

Vocabulary: Megatron shards the vocabulary evenly over TP. Padding it (Megatron's
`make_vocab_size_divisible_by`) would put extra logits into every unrestricted softmax and break exactness
against HF, so the backbone requires `vocab_size % tp_size == 0` (true for Qwen2, Llama 3, SmolLM2 at TP <= 8).

Pipeline parallelism (`pipeline`): at pp_size > 1 this rank builds only its stage's layers (the embedding on the
first stage, the final norm and output layer on the last) and `forward_backward` / `forward_only` run
megatron-core's 1F1B schedule; only the last stage scores, and its outputs reach every stage. A tied embedding
becomes two copies at pp > 1 (the first stage's embedding, the last stage's `output_layer.weight`), loaded equal and
kept equal: their gradients are summed over megatron's embedding group after each schedule (`_tied_sync`; with the
distributed optimizer, in its buffers: `dist_opt.TiedCopy`), as megatron's own `finalize_model_grads` does; the
norm counts the weight once. MoE models pipeline too: each stage replays and compares its own MoE layers' slice
of the routes, and the last stage's `moe_stats` / `routing_agreement` combine every stage's
(`replay.PipelineFigures`). With virtual stages (`layout.vpp_size` > 1, megatron's interleaved schedule) `model` is
a ModuleList of this rank's chunks (`chunks`: the embedding in rank 0's first chunk, the head in the last rank's last
chunk); MoE models run without virtual stages (the figures' exchange is one per stage and micro-batch).

MoE routes (`replay.MegatronRouterReplay`): a batch carrying routes has every router's own top-k compared with
them (`routing_agreement`, a `topp_rl.trainer.backbone.BackboneBase` capability); `routing_replay=True` also forces them. The
routes follow the tokens through the CP layout (`cp_shard`, CP padding rows without a route).
"""

from __future__ import annotations

import torch
from torch import Tensor

from topp_rl.data import PackedBatch
from topp_rl.data.routes import NO_ROUTE
from topp_rl.megatron import cpu_shims
from topp_rl.megatron.chunks import ChunkPlace, chunk_module, chunk_places, model_chunks
from topp_rl.megatron.convert import load_hf_into
from topp_rl.megatron.export import hf_named_tensors
from topp_rl.megatron.grads import GradSync, clip_grad_norm_
from topp_rl.megatron.hf_config import hf_inv_freq, is_moe
from topp_rl.megatron.moe import moe_stats
from topp_rl.megatron.pipeline import run_schedule
from topp_rl.megatron.replay import MegatronRouterReplay, PipelineFigures, megatron_moe_routing
from topp_rl.megatron.spec import layer_specs, transformer_config
from topp_rl.parallel import ParallelLayout, cp_padded_lengths, cp_shard, cu_seqlens
from topp_rl.parallel.plan import chunk_layers, stage_layers
from topp_rl.trainer.backbone import BackboneBase, ForwardFn, StepFn, T, batch_routes

# The context-parallel splits the Megatron backbone runs: Megatron's THD RoPE and transformer-engine's CP attention
# assume the zigzag split (all-gather CP exists in the ops and the HF scorer only).
CP_MODES = ("zigzag",)


def cp_mode_refusal(mode: str) -> str:
    return (f"parallel.cp_mode={mode!r}: the Megatron backbone splits sequences zigzag only (Megatron's THD RoPE "
            "and transformer-engine's CP attention assume it); use parallel.cp_mode=zigzag")


def check_layout(hf_config, layout: ParallelLayout) -> None:
    """The layout must describe this model's vocabulary and a CP split the backbone can run."""
    if layout.vocab_size != hf_config.vocab_size:
        raise ValueError(
            f"layout vocab_size={layout.vocab_size} != model vocab_size={hf_config.vocab_size}; build the "
            "layout with ParallelLayout.from_megatron(model.config.vocab_size)"
        )
    if layout.vpp_size > 1 and is_moe(hf_config):
        raise ValueError(
            f"parallel.vpp_size={layout.vpp_size} with model_type={hf_config.model_type!r}: MoE models pipeline "
            "without virtual stages (each stage sends its MoE figures once per micro-batch, and a rank with several "
            "chunks would send several); use parallel.vpp_size=1 for this model"
        )
    chunk_layers(hf_config.num_hidden_layers, layout.pp_size, layout.vpp_size, layout.pp_rank)  # refuses uneven
    if layout.cp_size > 1 and layout.cp_mode not in CP_MODES:
        raise ValueError(cp_mode_refusal(layout.cp_mode))


def build_gpt_model(hf_config, *, tp_size: int, cp_size: int, ep_size: int = 1, pp_size: int = 1, pp_rank: int = 0,
                    seed: int = 0, dtype: torch.dtype = torch.float32, moe_aux_loss_coeff: float = 0.0,
                    place: ChunkPlace | None = None, vpp_size: int = 1):
    """A GPTModel for `hf_config` on this rank (parallel_state must be initialised with these sizes): at
    pp_size > 1 only stage `pp_rank`'s layers, the embedding on the first stage, the head on the last; with virtual
    stages (`vpp_size` > 1), the chunk at `place` (`chunks.chunk_places`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if cpu_shims.needs_cpu_shims():
        cpu_shims.seed_rng_tracker(seed)
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = transformer_config(hf_config, tp_size=tp_size, cp_size=cp_size, ep_size=ep_size, pp_size=pp_size,
                                vpp_size=vpp_size, dtype=dtype)
    specs = layer_specs(config, dtype, moe_aux_loss_coeff=moe_aux_loss_coeff)
    if place is None:
        place = ChunkPlace(vp_stage=None, layers=stage_layers(config.num_layers, pp_size, pp_rank),
                           first=pp_rank == 0, last=pp_rank == pp_size - 1, tied=False)
    layers = place.layers
    specs = TransformerBlockSubmodules(layer_specs=specs.layer_specs[layers.start:layers.stop],
                                       layer_norm=specs.layer_norm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=specs,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        # At pp > 1 a tied embedding is two copies (see the module docstring): megatron's own tied setup
        # all-reduces the copies at construction with a `.cuda()` call.
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings) and pp_size == 1,
        position_embedding_type="rope",  # inv_freq is replaced by HF's own below (exact llama3 scaling)
        pre_process=place.first,
        post_process=place.last,
        vp_stage=place.vp_stage,  # the layer offset megatron numbers the chunk's layers from
    )
    if cpu_shims.needs_cpu_shims():
        cpu_shims.keep_rotary_on_cpu(model.rotary_pos_emb, inv_freq=hf_inv_freq(hf_config))
    else:
        model.rotary_pos_emb.inv_freq = hf_inv_freq(hf_config).to(torch.cuda.current_device())
    return model


def sum_qk_norm_grads_over_tp(model: torch.nn.Module, tp_group) -> None:
    """Qwen3's q / k norms are replicated over TP but each TP rank applies them to its own heads only, so its
    gradient is a partial sum: a hook sums each backward's gradient over TP before it is accumulated (megatron
    does this in its DDP's finalize step, which this backbone does not use)."""
    if tp_group is None or torch.distributed.get_world_size(tp_group) == 1:
        return

    def hook(grad: Tensor) -> Tensor:
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=tp_group)
        return grad

    for name, p in model.named_parameters():
        if name.endswith(("q_layernorm.weight", "k_layernorm.weight")) and p.requires_grad:
            p.register_hook(hook)


def packed_seq_params(seq_lengths: Tensor, *, cp_size: int, cp_group=None):
    """PackedSeqParams for THD: real and (zigzag CP) 2*cp-padded cumulative sequence lengths."""
    from megatron.core.packed_seq_params import PackedSeqParams

    mode = "zigzag"
    padded = cp_padded_lengths(seq_lengths, cp_size=cp_size, mode=mode)
    cu, cu_padded = cu_seqlens(seq_lengths.to(torch.int64)), cu_seqlens(padded)
    max_len = int(padded.max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max_len, max_seqlen_kv=max_len, cp_group=cp_group,
    )


class MegatronBackbone(BackboneBase):
    """The policy body as a megatron-core GPTModel; see the module docstring for the gradient contract. At pp = 1 it
    runs `BackboneBase.forward_backward`'s loop (the strategy's backward hooks reduce the gradients); at pp > 1
    megatron-core's pipeline schedule (`pipeline`)."""

    def __init__(self, hf_config, *, layout: ParallelLayout, seed: int = 0,
                 dtype: torch.dtype = torch.float32, moe_aux_loss_coeff: float = 0.0,
                 routing_replay: bool = False) -> None:
        super().__init__()
        check_layout(hf_config, layout)
        if moe_aux_loss_coeff and not is_moe(hf_config):
            raise ValueError(
                f"module.moe_aux_loss_coeff={moe_aux_loss_coeff} needs a mixture-of-experts model, and "
                f"model_type={hf_config.model_type!r} has no MoE layers; set module.moe_aux_loss_coeff=0"
            )
        self.hf_config = hf_config
        self._layout = layout
        # this rank's model chunks (one at vpp = 1: its stage), see `chunks`
        self.places = chunk_places(hf_config.num_hidden_layers, layout, tie_word_embeddings=hf_config.tie_word_embeddings)
        self.model = chunk_module([
            build_gpt_model(hf_config, tp_size=layout.tp_size, cp_size=layout.cp_size, ep_size=layout.ep_size,
                            pp_size=layout.pp_size, pp_rank=layout.pp_rank, seed=seed, dtype=dtype,
                            moe_aux_loss_coeff=moe_aux_loss_coeff, place=place, vpp_size=layout.vpp_size)
            for place in self.places])
        self.chunks = model_chunks(self.model)
        # a tied embedding split over stages: this stage's copy, summed with the other's after each schedule
        self.tied_copy = None
        if hf_config.tie_word_embeddings and layout.pp_size > 1 and self.places[0].first:
            self.tied_copy = self.chunks[0].embedding.word_embeddings.weight
        elif hf_config.tie_word_embeddings and layout.pp_size > 1 and self.places[-1].last:
            self.tied_copy = self.chunks[-1].output_layer.weight
        # the stage's layers and `convert.stage_state` arguments: one stage's, so None with virtual stages (`places`)
        self.stage_layers = self.places[0].layers if layout.vpp_size == 1 else None
        self.stage = self.places[0].stage_args() if layout.vpp_size == 1 else None
        self._grad_syncs: list[GradSync] = []  # the strategy's data-parallel sums, run around the pipeline schedule
        sum_qk_norm_grads_over_tp(self.model, layout.tp_group)
        self.routing = megatron_moe_routing(hf_config)
        if routing_replay and self.routing is None:
            raise ValueError(f"routing_replay=True needs an MoE model; model_type={hf_config.model_type!r} has no "
                             "MoE layers: turn replay off (rollout.routing_replay=false)")
        self.routing_replay = routing_replay
        self._grad_owner = None  # a dist_opt.ShardedOptimizer, which holds the reduced gradients (use_grad_owner)
        self.replay = (MegatronRouterReplay(self.model, self.routing, force=routing_replay, layers=self.stage_layers)
                       if self.routing is not None else None)
        self._agreement: tuple[float, float] | None = None
        # pp > 1: the last stage's figures of its last forward, combined over the stages (None: this stage's own)
        self._figures = PipelineFigures(layout.pp_group) if self.routing is not None and layout.pp_size > 1 else None
        self._stats: dict[str, Tensor] | None = None

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module, *, layout: ParallelLayout, seed: int = 0,
                moe_aux_loss_coeff: float = 0.0, routing_replay: bool = False) -> MegatronBackbone:
        """This rank's backbone holding the HF model's weights (parallel_state must be initialised)."""

        dtype = next(hf_model.parameters()).dtype
        backbone = cls(hf_model.config, layout=layout, seed=seed, dtype=dtype, moe_aux_loss_coeff=moe_aux_loss_coeff,
                       routing_replay=routing_replay)
        backbone.load_hf_state(hf_model.state_dict())
        backbone.train(hf_model.training)
        return backbone

    def load_hf_state(self, hf_state) -> None:
        """Copy a full HF state dict into this rank's model chunks (each takes its own layers and ends)."""
        layout = self._layout
        for model, place in zip(self.chunks, self.places, strict=True):
            load_hf_into(model, hf_state, self.hf_config, tp_size=layout.tp_size, tp_rank=layout.tp_rank,
                         ep_size=layout.ep_size, ep_rank=layout.ep_rank, stage=place.stage_args())

    @property
    def layout(self) -> ParallelLayout:
        return self._layout

    @property
    def tp_size(self) -> int:
        return self._layout.tp_size

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def hf_named_tensors(self):
        """(HF name, full tensor) pairs, layer by layer; a collective over the TP group (see `export`)."""

        return hf_named_tensors(self)

    def use_grad_owner(self, owner) -> None:
        """Hand gradient clipping to `owner` (`dist_opt.ShardedOptimizer`): megatron's DDP accumulates the gradients
        in its buffers (`.grad` stays empty) and only the optimizer holds them reduced."""
        self._grad_owner = owner

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip like `torch.nn.utils.clip_grad_norm_` on the unsharded model; the norm before clipping."""

        if self._grad_owner is not None:
            return self._grad_owner.clip_grad_norm_(max_norm)
        return clip_grad_norm_(self.model.named_parameters(), max_norm, tp_group=self._layout.tp_group,
                               ep_group=self._layout.ep_group, pp_group=self._layout.pp_group,
                               skip=self._norm_skips())

    def _norm_skips(self) -> tuple[Tensor, ...]:
        """The tied embedding's second copy (last stage at pp > 1): the norm counts the weight once."""
        last_copy = self.tied_copy is not None and self._layout.is_last_stage and self._layout.pp_rank > 0
        return (self.tied_copy,) if last_copy else ()

    # ---- the pipeline schedule (pp > 1) ---------------------------------------------------------------------
    def use_grad_syncs(self, syncs: list[GradSync]) -> None:
        """The strategy's gradient sums over data-parallel ranks; at pp > 1 they run around the whole schedule
        (megatron's schedule runs the backward passes itself, not through the module's `manual_backward`)."""
        self._grad_syncs = list(syncs)

    def use_loss_scale(self, scale) -> None:
        """An fp16 loss scale (`LossScaledFP16`'s `GradScaler.scale`) for the pipeline schedule, which multiplies
        the last stage's loss by it before its backward (megatron's `grad_scale_func`); at pp = 1 the module's
        `manual_backward` scales the loss instead."""
        for chunk in self.chunks:  # the schedule reads the first chunk's config; kept equal
            chunk.config.grad_scale_func = scale

    def forward_backward(self, micro_batches, step_fn: StepFn[T], *, backward=Tensor.backward) -> list[T]:
        """pp = 1: `BackboneBase`'s loop. pp > 1: megatron-core's 1F1B schedule (`pipeline.run_schedule`),
        `step_fn` on the last stage; then the tied embedding's copies and the data-parallel ranks sum their
        gradients. Every stage returns the last stage's outputs."""
        if self._layout.pp_size == 1:
            return super().forward_backward(micro_batches, step_fn, backward=backward)
        # with megatron's DDP (the distributed optimizer) the gradients live in its buffers: it sums them itself
        syncs = self._grad_syncs + (self._tied_sync() if self._grad_owner is None else [])
        for sync in syncs:
            sync.before()
        outputs = run_schedule(self, micro_batches, step_fn, forward_only=False)
        for sync in syncs:
            sync.after()
        return outputs

    def forward_only(self, micro_batches, fn: ForwardFn[T]) -> list[T]:
        if self._layout.pp_size == 1:
            return super().forward_only(micro_batches, fn)

        def last_stage(i: int, batch: PackedBatch, hidden: Tensor, weight: Tensor):
            return hidden.new_zeros(()), fn(batch, hidden, weight)

        with torch.no_grad():
            return run_schedule(self, micro_batches, last_stage, forward_only=True)

    def _tied_sync(self) -> list[GradSync]:
        """Sums the tied embedding's two copies' gradients over megatron's embedding group (first + last stage)."""
        if self.tied_copy is None:
            return []
        from megatron.core import parallel_state as ps

        return [GradSync([self.tied_copy], ps.get_embedding_group())]

    def moe_stats(self) -> dict[str, Tensor]:
        """MoE load statistics of the last forward (`moe.moe_stats`); empty for dense models. At pp > 1 on the last
        stage: of the whole model (every stage's layers, see `stage_output`)."""

        return moe_stats(self.model) if self._stats is None else self._stats

    def output_weight(self) -> Tensor:
        """This rank's output-layer weight shard [V / tp, H] (the embedding when tied); the last chunk's."""
        model = self.chunks[-1]
        if model.share_embeddings_and_output_weights:
            return model.shared_embedding_or_output_weight()
        return model.output_layer.weight

    def forward_hidden(self, batch: PackedBatch) -> tuple[Tensor, Tensor]:
        """(hidden [T_local, H], weight shard [V_local, H]) for a `PackedBatch`; rows in the layout's CP order.
        Whole models only (pp = 1): a pipeline stage's output is `stage_output`, run by the schedule."""
        layout = self._layout
        if layout.pp_size > 1:
            raise ValueError(
                f"forward_hidden needs the whole model on this rank, and this backbone is pipeline stage "
                f"{layout.pp_rank} of {layout.pp_size}; run micro-batches through forward_backward / forward_only, "
                "which run the pipeline schedule"
            )
        positions = layout.local_positions(batch.seq_lengths)
        tokens = cp_shard(batch.tokens, positions)  # padding rows hold token 0; they are never scored
        params = packed_seq_params(batch.seq_lengths, cp_size=layout.cp_size, cp_group=layout.cp_group)
        routes = batch_routes(batch, self.routing, replay=self.routing_replay, model=self.hf_config.model_type)
        self._agreement = None
        if routes is None or self.replay is None:
            return self.hidden_states(tokens, params).squeeze(1), self.output_weight()  # exactly the vocab_range()
        with self.replay.using(cp_shard(routes.long(), positions, fill=NO_ROUTE)):  # rows as the routers see them
            hidden = self.hidden_states(tokens, params).squeeze(1)
            self._agreement = tuple(map(float, self.replay.agreement()))
        return hidden, self.output_weight()

    def routing_agreement(self) -> tuple[float, float] | None:
        """(same, recorded) token-layer routes of the last forward over this rank's CP shard (at pp > 1 on the last
        stage: every stage's layers, see `stage_output`): summed over
        all ranks with the other metrics, the ratio is the single-process one (TP ranks repeat their CP shard's
        counts, which leaves the ratio unchanged; CP and data-parallel ranks hold disjoint tokens)."""
        return self._agreement

    def stage_output(self, batch: PackedBatch, chunk: int = 0) -> Tensor:
        """This pipeline stage's (its model chunk `chunk`'s, with virtual stages) output [T_local, 1, H] for a
        micro-batch (its input comes from the previous stage through megatron's `set_input_tensor`, which the
        schedule calls); the last stage's is the final-norm hidden states."""
        layout = self._layout
        positions = layout.local_positions(batch.seq_lengths)
        params = packed_seq_params(batch.seq_lengths, cp_size=layout.cp_size, cp_group=layout.cp_group)
        tokens = cp_shard(batch.tokens, positions)
        if self._figures is None:
            return self.hidden_states(tokens, params, chunk=chunk)
        routes = batch_routes(batch, self.routing, replay=self.routing_replay, model=self.hf_config.model_type)
        agreement = None
        with self.replay.using(None if routes is None else cp_shard(routes.long(), positions, fill=NO_ROUTE)):
            output = self.hidden_states(tokens, params, chunk=chunk)
            if routes is not None:
                agreement = tuple(map(float, self.replay.stage_agreement()))
        self._stats, self._agreement = self._figures.exchange(moe_stats(self.model), agreement)
        return output

    def hidden_states(self, tokens: Tensor, params, chunk: int = 0) -> Tensor:
        """This stage's (model chunk's) output [T_local, 1, H] of local packed tokens [T_local]: the final-norm hidden
        states on the last stage (pp = 1: the whole model)."""
        model = self.chunks[chunk]
        position_ids = torch.zeros_like(tokens)[None]  # unused by RoPE models; RoPE reads cu_seqlens
        decoder_input, rotary_pos_emb, *_ = model._preprocess(
            input_ids=tokens[None], position_ids=position_ids, packed_seq_params=params
        )
        pad = getattr(self.hf_config, "pad_token_id", None)
        if pad is not None and decoder_input is not None and decoder_input.requires_grad:
            # HF embeds with nn.Embedding(padding_idx=pad_token_id): the pad row gets no gradient from the lookup
            # (only from a tied head). Mirror it so training matches the HF backbone step for step.
            is_pad = (tokens == pad)[:, None, None]  # [T_local, 1, 1] like decoder_input [T_local, 1, H]
            decoder_input.register_hook(lambda grad: grad.masked_fill(is_pad, 0.0))
        return model.decoder(  # decoder_input is None after the first stage: the decoder reads its input tensor
            hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=params,
        )
