"""Pipeline parallelism for the Megatron backbone: megatron-core's 1F1B schedule behind `Backbone.forward_backward`.

Each pipeline stage holds a contiguous, equal share of the decoder layers (`ParallelPlan.stage_layers`); the first
also holds the embedding, the last the final norm and the output layer, so only the last stage has final hidden
states and scores tokens. `run_schedule` hands megatron-core's schedule (`get_forward_backward_func`: the
non-interleaved 1F1B `forward_backward_pipelining_without_interleaving` at pp > 1) one forward step per
micro-batch: every stage runs its layers (`MegatronBackbone.stage_output`), and on the last stage the schedule calls
the step's function on the hidden states (megatron's `loss_func`), whose loss it backpropagates back through the
stages. The step function's outputs exist on the last stage only; they are sent to the other stages over the
pipeline group (`broadcast_from_last_stage`), so every rank logs the same keys and values.

Packed, variable-length micro-batches: the activations between stages are [T_local, 1, H] with T_local the
micro-batch's own (CP-local) token count, which differs between micro-batches. megatron-core's
`variable_seq_lengths=True` (set on the model's config at pp > 1) sends each activation's shape ahead of it, so
no micro-batch is padded to the longest. `calculate_per_token_loss=True` keeps the schedule from rescaling the
loss (it would divide by the number of micro-batches, and multiply by the CP size): topp_rl's losses already divide
by the step's global counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from topp_rl.data import PackedBatch
from topp_rl.megatron import cpu_shims

# The schedule's per-token loss mode adds each loss_func's token count into a total it hands to a
# `finalize_model_grads_func` (none here): any count will do; it never scales the loss.
_ONE = torch.ones((), dtype=torch.int)

# (micro-batch index, batch, hidden [T_local, H], output weight [V_local, H]) -> (loss, output)
LastStageFn = Callable[[int, PackedBatch, Tensor, Tensor], tuple[Tensor, Any]]


def pipeline_config_fields(pp_size: int) -> dict:
    """TransformerConfig fields of a pipelined model (see the module docstring); none at pp = 1."""
    if pp_size == 1:
        return {}
    # The default MoE dispatcher ("allgather") refuses variable_seq_lengths in TransformerConfig's checks even for a
    # dense model, which has no dispatcher: name the one that accepts it.
    return dict(pipeline_model_parallel_size=pp_size, variable_seq_lengths=True, calculate_per_token_loss=True,
                moe_token_dispatcher_type="alltoall")


def run_schedule(backbone, micro_batches: Sequence[PackedBatch], fn: LastStageFn, *, forward_only: bool) -> list:
    """`fn`'s output for every micro-batch, in order, on every stage (computed on the last). Without
    `forward_only` the gradients of the losses `fn` returns are accumulated into every stage's `.grad`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    layout = backbone.layout

    def forward_step(data_iterator, model):
        i, batch = next(data_iterator)
        output = backbone.stage_output(batch)  # [T_local, 1, H]
        if not layout.is_last_stage:
            # The next stage receives into a buffer of the config's pipeline_dtype (the model's); under autocast
            # (bf16-mixed) a layer's output may be 16-bit, and gloo would fill the wider buffer with its bytes.
            output = output.to(backbone.model.config.pipeline_dtype)

        def loss_func(hidden: Tensor):
            loss, out = fn(i, batch, hidden.squeeze(1), backbone.output_weight())
            return loss, _ONE, out

        return output, loss_func

    schedule = get_forward_backward_func(pp_size=layout.pp_size)
    with cpu_shims.pipeline_on_cpu():
        outputs = schedule(forward_step_func=forward_step, data_iterator=iter(enumerate(micro_batches)),
                           model=[backbone.model], num_microbatches=len(micro_batches),
                           seq_length=1,  # a placeholder: variable_seq_lengths sends every activation's shape
                           micro_batch_size=1, forward_only=forward_only)
    return broadcast_from_last_stage(list(outputs) if layout.is_last_stage else None, layout)


def broadcast_from_last_stage(value, layout):
    """The last pipeline stage's `value` on every stage of its pipeline group (a pickled broadcast)."""
    if layout.pp_size == 1:
        return value
    src = dist.get_global_rank(layout.pp_group, layout.pp_size - 1)
    box = [value]
    dist.broadcast_object_list(box, src=src, group=layout.pp_group)
    return box[0]
