"""Context-parallel (CP) layouts of a packed (THD) stream, encoded once as an index map of positions.

`cp_local_positions` gives, for every row of this rank's local stream, its position in the unsharded packed
stream (sequences back to back, no padding) or -1 for padding. Everything else derives from that map:
`cp_shard` gathers any packed tensor into the local layout, `response_rows` finds the local logit rows that
predict response tokens, `cp_padded_lengths` / `cp_local_lengths` give the sequence lengths THD attention needs.

Layouts (c = cp_size, rank r):
- "zigzag" (Megatron / transformer-engine's load-balanced causal CP): each sequence is padded at its end to a
  multiple of 2c and cut into 2c equal chunks; rank r holds chunk r, then chunk 2c-1-r; the pieces of
  successive sequences are concatenated.
- "allgather": the packed stream is padded at its end to a multiple of c; rank r holds the r-th contiguous slice.
- c = 1: the packed stream itself, unpadded, in either mode.

Departure from slime: slime re-derives the zigzag / all-gather / no-CP split in each of its loss helpers; here
one vectorised index map (no Python loop over tokens or sequences) serves every consumer.
"""

from __future__ import annotations

from typing import Literal

import torch

CPMode = Literal["zigzag", "allgather"]
CP_MODES: tuple[str, ...] = ("zigzag", "allgather")


def cp_local_positions(seq_lengths: torch.Tensor, *, cp_size: int, cp_rank: int, mode: str) -> torch.Tensor:
    """int64 [T_local]: packed-stream position of each row of this CP rank's local stream, -1 for padding.

    Example, lengths [5, 3], cp_size=2, zigzag (chunk sizes 2 and 1; '-' = padding):
    rank 0 -> [0, 1, -, -, 5, -], rank 1 -> [2, 3, 4, -, 6, 7].
    """
    lengths = _check_lengths(seq_lengths)
    _check_cp(cp_size, cp_rank, mode)
    total = int(lengths.sum())
    device = lengths.device
    if cp_size == 1:
        return torch.arange(total, device=device)
    if mode == "allgather":
        per_rank = -(-total // cp_size)
        pos = torch.arange(cp_rank * per_rank, (cp_rank + 1) * per_rank, device=device)
        return torch.where(pos < total, pos, -1)
    chunk = -(-lengths // (2 * cp_size))  # [B] rows per chunk
    starts = torch.cumsum(lengths, 0) - lengths
    local_len = 2 * chunk
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), local_len)  # [T_local]
    k = torch.arange(seq.numel(), device=device) - (torch.cumsum(local_len, 0) - local_len)[seq]
    c = chunk[seq]
    # First half of each local piece is chunk r, second half chunk 2c-1-r.
    in_seq = torch.where(k < c, cp_rank * c + k, (2 * cp_size - 1 - cp_rank) * c + (k - c))
    return torch.where(in_seq < lengths[seq], starts[seq] + in_seq, -1)


def cp_padded_lengths(seq_lengths: torch.Tensor, *, cp_size: int, mode: str) -> torch.Tensor:
    """int64 [B]: each sequence's length in the CP-padded global stream.

    zigzag (cp_size > 1): rounded up to a multiple of 2 * cp_size (what Megatron's `cu_seqlens_q_padded` holds).
    allgather or cp_size = 1: unchanged; allgather pads only the stream's tail, outside every sequence.
    """
    lengths = _check_lengths(seq_lengths)
    _check_cp(cp_size, 0, mode)
    if cp_size == 1 or mode == "allgather":
        return lengths.clone()
    return -(-lengths // (2 * cp_size)) * (2 * cp_size)


def cp_local_lengths(seq_lengths: torch.Tensor, *, cp_size: int, cp_rank: int, mode: str) -> torch.Tensor:
    """int64 [B]: rows of each sequence in this rank's local stream, which holds them in sequence order.

    zigzag: padded length / cp_size (padding rows included; they belong to their sequence).
    allgather: the overlap of the sequence with this rank's slice (often 0); the stream-tail padding is not
    counted, it follows the last piece. cp_size = 1: the lengths themselves.
    """
    lengths = _check_lengths(seq_lengths)
    _check_cp(cp_size, cp_rank, mode)
    if cp_size == 1:
        return lengths.clone()
    if mode == "zigzag":
        return cp_padded_lengths(lengths, cp_size=cp_size, mode=mode) // cp_size
    per_rank = -(-int(lengths.sum()) // cp_size)
    ends = torch.cumsum(lengths, 0)
    lo = (ends - lengths).clamp(min=cp_rank * per_rank)
    hi = ends.clamp(max=(cp_rank + 1) * per_rank)
    return (hi - lo).clamp(min=0)


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [B+1]: exclusive prefix sums of `lengths` (the THD attention boundary format)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def cp_shard(tensor: torch.Tensor, positions: torch.Tensor, *, fill: float | int = 0) -> torch.Tensor:
    """Rows of a packed tensor [T, ...] in the local layout [T_local, ...]; padding rows (-1) hold `fill`.

    Differentiable: the gradient of each packed row is the local gradient of the row that copied it (padding
    rows pass none back).
    """
    _check_positions(positions)
    if positions.numel() and int(positions.max()) >= tensor.shape[0]:
        raise ValueError(
            f"cp_shard: positions reach {int(positions.max())} but the packed tensor has {tensor.shape[0]} "
            "rows; build positions from the same seq_lengths as the tensor"
        )
    positions = positions.to(tensor.device)
    out = tensor.index_select(0, positions.clamp(min=0))
    pad = (positions < 0).view(-1, *([1] * (tensor.dim() - 1)))
    return out.masked_fill(pad, fill)


def _check_lengths(seq_lengths: torch.Tensor) -> torch.Tensor:
    if not isinstance(seq_lengths, torch.Tensor) or seq_lengths.dim() != 1 or seq_lengths.is_floating_point():
        raise ValueError(
            f"seq_lengths must be a 1-D integer tensor [B], got {type(seq_lengths).__name__} "
            f"{tuple(getattr(seq_lengths, 'shape', ()))}; pass the packed batch's seq_lengths"
        )
    lengths = seq_lengths.to(torch.int64)
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"seq_lengths must be >= 0, got minimum {int(lengths.min())}; pass real lengths")
    return lengths


def _check_cp(cp_size: int, cp_rank: int, mode: str) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be an int >= 1; use 1 for no context parallelism")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank!r} must be an int in [0, cp_size={cp_size}); pass this rank's CP index")
    if mode not in CP_MODES:
        raise ValueError(f"mode={mode!r} must be one of {CP_MODES}")


def _check_positions(positions: torch.Tensor) -> None:
    if positions.dim() != 1 or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be int64 [T_local], got {positions.dtype} {tuple(positions.shape)}; "
            "pass the output of cp_local_positions"
        )
    if positions.numel() and int(positions.min()) < -1:
        raise ValueError(f"positions must be >= -1 (-1 = padding), got {int(positions.min())}")
