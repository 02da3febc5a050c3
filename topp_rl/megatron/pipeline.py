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

Virtual stages (`layout.vpp_size` > 1): each rank holds vpp model chunks (`chunks`) and `get_forward_backward_func`
gives megatron's interleaved 1F1B (`forward_backward_pipelining_with_interleaving`), which takes the chunk list as
`model` and one data iterator per chunk, and hands `forward_step` the chunk it runs (its `vp_stage`); the loss is on
the last rank's last chunk. megatron-core 0.16 runs the micro-batches in groups of N per chunk
(`microbatch_group_size_per_vp_stage`, default pp: depth first) and refuses N outside [pp, m] and a last group
(m mod N) of fewer than pp micro-batches; `microbatch_group_size` picks the smallest N it accepts for each step's m
(pp when m is a multiple of pp). A step needs m >= pp micro-batches (the data module packs at least that many,
`MegatronStrategy.min_micro_batches`). The group size changes only the order of the chunks' forward and backward
passes, not which micro-batches' gradients add into a weight nor their order (each chunk runs its backward passes in
micro-batch order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor

from topp_rl.data import PackedBatch
from topp_rl.megatron import cpu_shims
from topp_rl.megatron.chunks import model_chunks

# The schedule's per-token loss mode adds each loss_func's token count into a total it hands to a
# `finalize_model_grads_func` (none here): any count will do; it never scales the loss.
_ONE = torch.ones((), dtype=torch.int)

# (micro-batch index, batch, hidden [T_local, H], output weight [V_local, H]) -> (loss, output)
LastStageFn = Callable[[int, PackedBatch, Tensor, Tensor], tuple[Tensor, Any]]


def pipeline_config_fields(pp_size: int, vpp_size: int = 1) -> dict:
    """TransformerConfig fields of a pipelined model (see the module docstring); none at pp = 1."""
    if pp_size == 1:
        return {}
    # The default MoE dispatcher ("allgather") refuses variable_seq_lengths in TransformerConfig's checks even for a
    # dense model, which has no dispatcher: name the one that accepts it.
    fields = dict(pipeline_model_parallel_size=pp_size, variable_seq_lengths=True, calculate_per_token_loss=True,
                  moe_token_dispatcher_type="alltoall")
    if vpp_size > 1:
        fields["virtual_pipeline_model_parallel_size"] = vpp_size
        if pp_size == 2:  # the activations and gradients per direction (`interleaved_shape_exchange`)
            fields["batch_p2p_comm"] = False
    return fields


@contextlib.contextmanager
def interleaved_shape_exchange(vpp_size: int) -> Iterator[None]:
    """megatron-core 0.16's interleaved schedule with variable_seq_lengths (see the module docstring): each
    activation's shape is sent ahead of it without waiting for the send (the receives are waited for), the forward
    direction's shapes before the backward direction's. Without it the schedule deadlocks or crosses shapes:

    - `P2PCommunicator._communicate_shapes` waits for its sends too. At m = pp micro-batches the last rank's first
      1F1B exchange sends a gradient's shape to the first rank, which receives it only in its cool-down, after its
      last warm-up send (an activation) has been received, which the last rank posts only after that shape
      exchange returns: both ranks wait (measured: a hang at pp2 vpp2 with 2 micro-batches, gloo).
    - It posts one batch of [send_prev, recv_prev, send_next, recv_next]; at pp = 2 prev and next are the same
      rank and p2p messages carry no tag, so when both directions are busy the other rank's recv_prev takes this
      rank's send_prev, a gradient's shape (measured: a split_with_sizes error at pp2 vpp2 with 3 and 4
      micro-batches). The order here is the one megatron's `_p2p_ops` (batch_p2p_comm=False, set at pp = 2) gives
      the tensors themselves: forward (send_next / recv_prev) before backward (send_prev / recv_next).

    The sends complete once the other rank posts the matching receive; they are waited for when the schedule has
    run."""
    if vpp_size == 1:
        yield
        return
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    sends: list = []  # (shape tensor, work): kept alive until sent

    def exchange(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        received = {}
        for direction, send, to, receive, source in (("prev", tensor_send_next, self.next_rank, recv_prev,
                                                       self.prev_rank),
                                                      ("next", tensor_send_prev, self.prev_rank, recv_next,
                                                       self.next_rank)):
            if receive:
                shape = torch.empty(3, dtype=torch.int64)
                received[direction] = (shape, dist.irecv(shape, src=source, group=self.pp_group))
            if send is not None:
                shape = torch.tensor(send.size(), dtype=torch.int64)
                sends.append((shape, dist.isend(shape, dst=to, group=self.pp_group)))
        for _, work in received.values():
            work.wait()
        prev, nxt = (received[d][0].tolist() if d in received else [0, 0, 0] for d in ("prev", "next"))
        return prev, nxt

    with mock.patch.object(P2PCommunicator, "_communicate_shapes", exchange):
        yield
    for _, work in sends:
        work.wait()


def microbatch_group_size(num_micro_batches: int, pp_size: int) -> int:
    """The smallest micro-batch group size N per virtual stage that megatron-core 0.16's interleaved schedule runs
    for m micro-batches: pp <= N <= m, and m mod N either 0 or >= pp (see the module docstring)."""
    m = num_micro_batches
    if m < pp_size:
        raise ValueError(
            f"{m} micro-batches at parallel.pp_size={pp_size} with virtual stages: megatron-core's interleaved "
            f"schedule needs at least pp_size micro-batches per step; pack at least {pp_size} (the strategy's data "
            "module does: MegatronStrategy.min_micro_batches), or set parallel.vpp_size=1"
        )
    return next(n for n in range(pp_size, m + 1) if m % n == 0 or m % n >= pp_size)


def run_schedule(backbone, micro_batches: Sequence[PackedBatch], fn: LastStageFn, *, forward_only: bool) -> list:
    """`fn`'s output for every micro-batch, in order, on every stage (computed on the last). Without
    `forward_only` the gradients of the losses `fn` returns are accumulated into every stage's `.grad`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    layout = backbone.layout
    chunks = model_chunks(backbone.model)
    chunk_of = {id(model): v for v, model in enumerate(chunks)}  # the schedule hands forward_step the chunk itself

    def forward_step(data_iterator, model):
        i, batch = next(data_iterator)
        chunk = chunk_of[id(model)]
        output = backbone.stage_output(batch, chunk)  # [T_local, 1, H]
        if not (layout.is_last_stage and chunk == len(chunks) - 1):
            # The next stage receives into a buffer of the config's pipeline_dtype (the model's); under autocast
            # (bf16-mixed) a layer's output may be 16-bit, and gloo would fill the wider buffer with its bytes.
            output = output.to(model.config.pipeline_dtype)

        def loss_func(hidden: Tensor):
            loss, out = fn(i, batch, hidden.squeeze(1), backbone.output_weight())
            return loss, _ONE, out

        return output, loss_func

    if layout.vpp_size > 1:
        group = microbatch_group_size(len(micro_batches), layout.pp_size)
        for model in chunks:  # read from the first chunk's config; kept equal
            model.config.microbatch_group_size_per_vp_stage = group
        data: Any = [iter(enumerate(micro_batches)) for _ in chunks]  # one iterator per chunk: each reads them all
    else:
        data = iter(enumerate(micro_batches))
    schedule = get_forward_backward_func(pp_size=layout.pp_size,
                                         vp_size=layout.vpp_size if layout.vpp_size > 1 else None)
    with cpu_shims.pipeline_on_cpu(), interleaved_shape_exchange(layout.vpp_size):
        outputs = schedule(forward_step_func=forward_step, data_iterator=data,
                           model=chunks, num_microbatches=len(micro_batches),
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
