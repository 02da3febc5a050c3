"""CPU shims for megatron-core 0.16.1: everything that makes GPTModel train on CPU over gloo.

Used only when CUDA is absent (`needs_cpu_shims()`); on GPU the backbone uses transformer-engine and none of
this. Each shim names the CUDA assumption it replaces:

- `CPU_CONFIG_OVERRIDES`: TransformerConfig fields whose defaults assume CUDA kernels or CUDA-side init.
- `seed_rng_tracker`: Megatron's RNG tracker snapshots CUDA RNG states; the inference tracker does not.
- `keep_rotary_on_cpu`: `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()`.
- `TorchCoreAttention`: the stock `DotProductAttention` rejects THD and context parallelism (only
  transformer-engine's attention has them); this pure-torch module does both, exactly, and HF's sliding window
  (`config.window_size`, see `hf_config.attention_window`).
- `cuda_as_cpu`: megatron's gradient buffers and distributed optimizer allocate on `'cuda'` /
  `torch.cuda.current_device()` and check `'torch.cuda.FloatTensor'`-style type names; inside it they allocate
  on CPU and see the CUDA name of the same dtype (the same megatron code runs, on CPU tensors).
- `pipeline_on_cpu`: megatron's pipeline schedules (`pipeline_parallel/schedules.py`,
  `forward_backward_pipelining_without_interleaving` and, for virtual stages, `..._with_interleaving`: each has
  `total_num_tokens = torch.zeros(..., device="cuda")`, its only CUDA-only line) and
  its p2p layer (`p2p_communication.py`, `P2PCommunicator._communicate_shapes` / `_communicate`: shape and receive
  buffers on `torch.cuda.current_device()`, then `torch.cuda.synchronize()` after `batch_isend_irecv`) assume
  CUDA; inside it they allocate on CPU and the synchronize is a no-op (gloo's `wait()` has already completed the
  transfer; the synchronize guards CUDA streams, which CPU tensors do not have). `batch_isend_irecv` itself runs
  on gloo as it is.

Departure from Megatron's CP: Megatron/TE run ring (p2p) attention; here each rank all-gathers K/V over the
CP group (one collective, with a reduce-scatter of the K/V gradients in backward). Same values, simpler, and
the memory cost is irrelevant at CPU test sizes.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor

from topp_rl.parallel import cp_local_positions

# Fields of TransformerConfig that default to CUDA kernels (fusions) or CUDA-side initialisation.
CPU_CONFIG_OVERRIDES: dict[str, object] = {
    "use_cpu_initialization": True,  # default init allocates on torch.cuda.current_device()
    "gradient_accumulation_fusion": False,  # fused wgrad accumulation is a CUDA extension
    "bias_dropout_fusion": False,  # jit-fused CUDA kernel
    "apply_rope_fusion": False,  # TE/apex fused RoPE
    "masked_softmax_fusion": False,  # CUDA softmax kernel
    "bias_activation_fusion": False,  # jit-fused swiglu kernel
    "persist_layer_norm": False,  # apex persistent LayerNorm
}


def needs_cpu_shims() -> bool:
    return not torch.cuda.is_available()


def _is_cuda(device) -> bool:
    return isinstance(device, int) or "cuda" in str(device)  # an int device is a CUDA ordinal


class _CudaAsCpu(torch.overrides.TorchFunctionMode):
    """Factory calls with a CUDA `device=` allocate on CPU; `Tensor.type()` answers with the CUDA type name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device", "cpu")):
            kwargs["device"] = "cpu"
        out = func(*args, **kwargs)
        if getattr(func, "__name__", None) == "type" and len(args) == 1 and not kwargs and isinstance(out, str):
            out = out.replace("torch.", "torch.cuda.", 1)  # megatron's dtype checks: 'torch.cuda.FloatTensor'
        return out


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """Run megatron-core's DDP / distributed-optimizer code on CPU (see module docstring); nothing on GPU."""
    if not needs_cpu_shims():
        yield
        return
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), _CudaAsCpu():
        yield


@contextlib.contextmanager
def pipeline_on_cpu() -> Iterator[None]:
    """Run megatron-core's pipeline schedule and p2p communication on CPU (see module docstring)."""
    if not needs_cpu_shims():
        yield
        return
    with mock.patch.object(torch.cuda, "synchronize", lambda device=None: None), cuda_as_cpu():
        yield


def seed_rng_tracker(seed: int) -> None:
    """Seed Megatron's RNG tracker without CUDA RNG states.

    The training tracker calls `torch.cuda.get_rng_state`; the inference tracker's `fork()` is a no-op, which is
    exact only with dropout 0 (the backbone rejects any other dropout on CPU).
    """
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def keep_rotary_on_cpu(rotary: torch.nn.Module, *, inv_freq: Tensor | None = None) -> None:
    """Make a `RotaryEmbedding` compute on its own (CPU) device; optionally replace its inverse frequencies.

    `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` on first use. Replacing
    `inv_freq` lets the caller use HF's exact RoPE frequencies (e.g. llama3 scaling with non-default factors,
    which Megatron hard-codes).
    """
    if inv_freq is not None:
        rotary.inv_freq = inv_freq.detach().to(torch.float32).clone()

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [S, D/2]
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]  # [S, 1, 1, D]

    rotary.get_emb = types.MethodType(get_emb, rotary)
    rotary.forward.cache_clear()


class _AllGatherRows(torch.autograd.Function):
    """All-gather along dim 0 over `group` (rank order). Backward: reduce-scatter of the gradient.

    Every rank's queries read every rank's K/V, so the gradient of a local K/V row is the sum over ranks of the
    gathered gradient's rows for it. gloo has no reduce_scatter: all-reduce, then keep this rank's slice.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rows = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * rows : (rank + 1) * rows], None


def packed_index_map(cu_seqlens_padded: Tensor, *, cp_size: int, cp_rank: int) -> tuple[Tensor, Tensor]:
    """For each local row of a zigzag CP shard: its index in the padded packed stream and its sequence id.

    `cu_seqlens_padded` [B+1] holds sequence boundaries with every length a multiple of 2 * cp_size (so
    `cp_local_positions` inserts no padding and its positions are indices of the padded stream).
    """
    lengths = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).to(torch.int64)
    mode = "zigzag" if cp_size > 1 else "allgather"
    index = cp_local_positions(lengths, cp_size=cp_size, cp_rank=cp_rank, mode=mode)
    seq = torch.searchsorted(cu_seqlens_padded.to(torch.int64), index, right=True) - 1
    return index, seq


class TorchCoreAttention(torch.nn.Module):
    """Pure-torch core attention for packed (THD) batches, with optional zigzag context parallelism.

    Equals, per sequence, `softmax(q k^T * scale + causal_mask) v` with GQA heads repeated; sequences in a pack
    never see each other (computed per sequence block, not as one masked [T, T] product). With CP the local rows
    are this rank's zigzag chunks of every sequence; K/V are all-gathered over the CP group and the causal mask
    compares indices in the padded packed stream (padding sits at each sequence's end, so real queries never
    see padding keys).
    Signature matches megatron-core's core-attention ModuleSpec contract.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, attention_dropout=None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        head_dim = config.kv_channels
        # HF's sliding window W: a query at position q sees keys at positions > q - W (TE's window (W - 1, 0)).
        self.window = None if config.window_size is None else config.window_size[0] + 1
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout != 0.0:
            raise ValueError(
                f"attention_dropout={dropout}: the CPU attention shim supports only 0.0; set it to 0.0 "
                "(RL log-prob training needs deterministic forwards)"
            )

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> Tensor:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError(
                "TorchCoreAttention needs packed_seq_params with qkv_format='thd'; pass PackedSeqParams "
                "(the backbone builds them from the packed batch)"
            )
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        cu = cu.to(torch.int64)
        cp_size = self.cp_group.size() if self.cp_group is not None else 1
        cp_rank = self.cp_group.rank() if self.cp_group is not None else 0
        q_index, q_seq = packed_index_map(cu, cp_size=cp_size, cp_rank=cp_rank)
        if cp_size > 1:
            # Each rank's queries need the whole sequence's keys/values.
            key = _AllGatherRows.apply(key, self.cp_group)
            value = _AllGatherRows.apply(value, self.cp_group)
            maps = [packed_index_map(cu, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]
            k_index, k_seq = torch.cat([m[0] for m in maps]), torch.cat([m[1] for m in maps])
        else:
            k_index, k_seq = q_index, q_seq
        out = _per_sequence_attention(query, key, value, q_index=q_index, q_seq=q_seq, k_index=k_index,
                                      k_seq=k_seq, cu=cu, scale=self.scale, rep=self.heads // self.groups,
                                      window=self.window)
        return out.reshape(out.shape[0], -1)


def _per_sequence_attention(query: Tensor, key: Tensor, value: Tensor, *, q_index: Tensor, q_seq: Tensor,
                            k_index: Tensor, k_seq: Tensor, cu: Tensor, scale: float, rep: int, window: int | None = None) -> Tensor:
    """Causal attention of each sequence's local queries [Tq, h, d] over its keys/values [Tk, g, d]; with
    `window`, a query at position q sees only keys at positions > q - window (HF's sliding window).

    Rows are scattered into [B, L] per-sequence blocks (one index_put each), so the cost is sum of L_q * L_k per
    sequence rather than T_q * T_k over the whole pack; the causal mask compares padded-stream indices.
    """
    num_seqs = cu.numel() - 1
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    counts = torch.bincount(q_seq, minlength=num_seqs)
    q_slot = torch.arange(q_seq.numel(), device=q_seq.device) - (torch.cumsum(counts, 0) - counts)[q_seq]  # rank within sequence
    k_slot = k_index - starts[k_seq]  # every padded position of a sequence is one key
    len_q, len_k = int(counts.max()), int(lengths.max())
    qb = query.new_zeros(num_seqs, len_q, *query.shape[1:]).index_put((q_seq, q_slot), query)
    kb = key.new_zeros(num_seqs, len_k, *key.shape[1:]).index_put((k_seq, k_slot), key)
    vb = value.new_zeros(num_seqs, len_k, *value.shape[1:]).index_put((k_seq, k_slot), value)
    q_pos = torch.full((num_seqs, len_q), -1, dtype=torch.int64, device=q_seq.device).index_put((q_seq, q_slot), q_index - starts[q_seq])
    k_pos = torch.arange(len_k, device=q_seq.device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, :] < lengths[:, None])[:, None, :]
    if window is not None:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - window
    allowed[:, :, 0] |= q_pos < 0  # empty query slots: attend to one key so softmax stays finite (discarded)
    if rep > 1:
        kb, vb = kb.repeat_interleave(rep, dim=2), vb.repeat_interleave(rep, dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(
        qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), attn_mask=allowed[:, None], scale=scale
    )  # [B, h, Lq, d]
    return out.transpose(1, 2)[q_seq, q_slot]  # [Tq, h, d]
