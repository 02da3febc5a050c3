"""Shared pieces of the restricted log-prob ops: candidate (row, id) pairs, row chunks, and the TP reduction.

Every row's log-sum-exp is first taken over this rank's part of its support (the local vocab slice, or the
candidate ids inside it) and then combined over the TP group with two all-reduces (a MAX of the local lse, a
SUM of the rescaled partial sums and of the target logit). Logits are never gathered.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from topp_rl.ops.candidates import Candidates

_ID_BITS = 32
_CHUNK_ELEMENTS = 1 << 21  # temporaries of at most 8 MB (fp32): reused by the allocator instead of re-faulted


@dataclass(frozen=True)
class Pairs:
    """The distinct (candidate row, id) pairs of cands(i) U {token_i} that fall in this rank's vocab slice."""

    crow: torch.Tensor  # int64 [P] candidate row
    row: torch.Tensor  # int64 [P] local logits row
    col: torch.Tensor  # int64 [P] local vocab column (id - vocab_start)
    is_target: torch.Tensor  # bool [P] id == the row's sampled token


def restricted_pairs(
    cands: Candidates, rows: torch.Tensor, cand_tokens: torch.Tensor, *, vocab_start: int, vocab_local: int
) -> Pairs:
    """One sort of K + M int64 keys (row << 32 | id) dedupes the ids and adds each row's token."""
    m = cands.num_rows
    keys = torch.cat(
        [
            (cands.row_of_ids() << _ID_BITS) | cands.ids.long(),
            (torch.arange(m, device=rows.device) << _ID_BITS) | cand_tokens,
        ]
    )
    keys = torch.unique(keys)
    crow, gid = keys >> _ID_BITS, keys & ((1 << _ID_BITS) - 1)
    local = (gid >= vocab_start) & (gid < vocab_start + vocab_local)
    crow, gid = crow[local], gid[local]
    return Pairs(crow=crow, row=rows[crow], col=gid - vocab_start, is_target=gid == cand_tokens[crow])


def segment_lse(values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """log(sum(exp(values))) per segment; -inf for a segment with no values on this rank."""
    m = torch.full((num_segments,), float("-inf"), dtype=values.dtype, device=values.device)
    m.scatter_reduce_(0, segment, values, reduce="amax", include_self=True)
    s = torch.zeros_like(m).index_add_(0, segment, torch.exp(values - m[segment]))
    return torch.where(s > 0, m + torch.log(s), torch.full_like(m, float("-inf")))


def row_chunks(sel: torch.Tensor | None, num_rows: int, width: int) -> Iterator[torch.Tensor | slice]:
    """Chunks of the rows `sel` (None = all rows, yielded as slices so no gather copy is made)."""
    step = max(1, _CHUNK_ELEMENTS // max(width, 1))
    if sel is None:
        for a in range(0, num_rows, step):
            yield slice(a, min(a + step, num_rows))
    else:
        for a in range(0, sel.numel(), step):
            yield sel[a : a + step]


def take_rows(x: torch.Tensor, chunk: torch.Tensor | slice) -> torch.Tensor:
    return x[chunk] if isinstance(chunk, slice) else x.index_select(0, chunk)


@dataclass(frozen=True)
class Reduced:
    lse: torch.Tensor  # [R] global log-sum-exp
    weighted: list[torch.Tensor]  # [R] each: global softmax-weighted mean of a local softmax-weighted mean
    plain: list[torch.Tensor]  # [R] each: plain sum over ranks
    vocab_size: int


def reduce_over_tp(
    local_lse: torch.Tensor,
    *,
    weighted: list[torch.Tensor],
    plain: list[torch.Tensor],
    vocab_end: int,
    group: dist.ProcessGroup | None,
) -> Reduced:
    """Combine per-rank partial statistics of each row over the TP group (identity without a group).

    `weighted[j]` is a mean under this rank's local softmax (e.g. sum_v p_local(v) z_v); it is combined with the
    weights exp(local_lse - lse). No autograd runs through these collectives: the ops' backward formulas use the
    reduced values as constants, and every rank computes the gradient of its own vocab slice.
    """
    if group is None:
        return Reduced(lse=local_lse, weighted=weighted, plain=plain, vocab_size=vocab_end)
    # MAX all-reduce: the largest local lse per row, a shift for stability; the global vocab size rides along.
    shift = torch.cat([local_lse, local_lse.new_tensor([float(vocab_end)])])
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    vocab_size = int(shift[-1].item())
    shift = shift[:-1]
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    w = torch.exp(local_lse - shift)  # 0 where this rank holds none of the row's support
    sums = torch.stack([w, *(w * x for x in weighted), *plain])
    # SUM all-reduce: partition function pieces and the target logit (held by exactly one rank).
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    total = sums[0]
    lse = shift + torch.log(total)
    k = len(weighted)
    return Reduced(
        lse=lse,
        weighted=[sums[1 + j] / total for j in range(k)],
        plain=list(sums[1 + k :]),
        vocab_size=vocab_size,
    )


@dataclass(frozen=True)
class Plan:
    """Which rows are restricted (and their pairs) and which stream the full vocabulary, for one call."""

    tokens: torch.Tensor  # int64 [T] global ids
    vocab_start: int
    vocab_local: int
    cand_rows: torch.Tensor  # int64 [M] local rows with candidates
    pairs: Pairs | None
    free_rows: torch.Tensor | None  # int64 rows without candidates; None = all rows


def make_plan(
    tokens: torch.Tensor,
    restricted: tuple[Candidates, torch.Tensor] | None,
    *,
    num_rows: int,
    vocab_local: int,
    vocab_start: int,
) -> Plan:
    if restricted is None:
        empty = torch.zeros(0, dtype=torch.int64, device=tokens.device)
        return Plan(tokens, vocab_start, vocab_local, cand_rows=empty, pairs=None, free_rows=None)
    cands, rows = restricted
    pairs = restricted_pairs(cands, rows, tokens[rows], vocab_start=vocab_start, vocab_local=vocab_local)
    free = torch.ones(num_rows, dtype=torch.bool, device=tokens.device)
    free[rows] = False
    return Plan(
        tokens, vocab_start, vocab_local, cand_rows=rows, pairs=pairs, free_rows=free.nonzero().flatten()
    )


def local_target(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose token lies in this rank's vocab slice, and its local column."""
    col = plan.tokens - plan.vocab_start
    here = ((col >= 0) & (col < plan.vocab_local)).nonzero().flatten()
    return here, col[here]
