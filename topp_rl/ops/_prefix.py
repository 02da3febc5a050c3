"""The ranks of each row above a probability threshold, ranked, in one pass over a large vocabulary.

`threshold_prefix(probs, ...)` equals, per row, the first `count` ranks of the full stable sort by (p descending,
id ascending), where `count` is the number of entries with p >= t for a row threshold t chosen from a histogram
of p so that the SGLang rule (`topp_rl.ops.sampling`) very likely drops the last of them. The caller checks that
it does (then every later rank is dropped too) and decides the other rows another way: t is a guess, never trusted.

Why: the top-k window of `sampling.py` grows by repeated `torch.topk` over whole rows (each O(V), and the rows
are copied out per growth); here one histogram pass and one compaction replace them, and only the
~(kept set) entries above t are sorted.
"""

from __future__ import annotations

import torch

# Histogram buckets: the top 11 bits of a float32 p >= 0 (sign 0, 8 exponent bits, 3 mantissa bits), so that
# buckets ascend with p, each spans 1/8 of an octave, and a bucket's lower edge is an exact float32 value.
_SHIFT = 20
_BUCKETS = 1 << (31 - _SHIFT)
_BLOCK, _SPARSE = 64, 4  # compaction by blocks of 64 ids where at most 1/4 of the blocks hold an entry above t
_MARGIN = 1e-3  # bucket masses are float32 sums: cross top_p with room (a low guess only costs a larger prefix)

Param = torch.Tensor | float  # per row [n], or one value for every row
IntParam = torch.Tensor | int


def threshold_prefix(
    probs: torch.Tensor, *, top_p: Param, top_k: IntParam, min_p: Param
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(vals [n, w] float32, ids [n, w] int64, count [n] int64): per row the `count` ranks with p >= t in full-sort
    order (p descending, ties by lower id), padded with p = -1 after them. Rows whose prefix would hold half of
    V or more get count 0 (a full sort suits them better); None when every row would."""
    n, vocab = probs.shape
    t, most = _threshold(probs, top_p=top_p, top_k=top_k, min_p=min_p)
    use = None  # rows to compact (None: all)
    if not bool((most * 2 < vocab).all()):  # else no exact count is needed: it comes with the compaction
        use = (probs >= t[:, None]).sum(dim=1, dtype=torch.int32) * 2 < vocab
        if not bool(use.any()):
            return None
    rows, ids = _entries_above(probs, t, use, sparse=float(most.sum()) * _SPARSE * _BLOCK <= probs.numel())
    count = torch.bincount(rows, minlength=n)
    vals = probs[rows, ids]
    # One stable sort of every kept entry: by row, then p descending (p >= 0: its bits ascend with it), ids
    # ascending among equal p (their order before the sort).
    key = (rows << 31) | (0x7FFFFFFF - vals.view(torch.int32).long())
    order = torch.sort(key, stable=True).indices
    start = torch.cumsum(count, 0) - count
    cols = torch.arange(rows.numel(), device=probs.device) - start[rows]  # rows are unchanged by the sort
    width = int(count.max())
    out_vals = torch.full((probs.shape[0], width), -1.0, dtype=probs.dtype, device=probs.device)
    out_ids = torch.zeros((probs.shape[0], width), dtype=torch.int64, device=probs.device)
    out_vals[rows, cols] = vals[order]
    out_ids[rows, cols] = ids[order]
    return out_vals, out_ids, count


def _entries_above(
    probs: torch.Tensor, t: torch.Tensor, use: torch.Tensor | None, *, sparse: bool
) -> tuple[torch.Tensor, ...]:
    """(rows, ids) of the entries with p >= t[row] in rows `use` (None: all), row-major (ids ascending in a row):
    `(probs >= t[:, None]) & use[:, None]` `.nonzero()`. When `sparse` (few entries expected), they are found
    through the blocks of _BLOCK ids whose maximum reaches t (one cheap reduction, then only those are compared)."""
    n, vocab = probs.shape
    if sparse and vocab % _BLOCK == 0:
        blocks = probs.view(n, vocab // _BLOCK, _BLOCK)
        hit = blocks.amax(dim=2) >= t[:, None]
        if use is not None:
            hit &= use[:, None]
        block_rows, block_ids = hit.nonzero().unbind(1)
        if block_rows.numel() * _SPARSE <= hit.numel():
            inside, offset = (blocks[block_rows, block_ids] >= t[block_rows, None]).nonzero().unbind(1)
            return block_rows[inside], block_ids[inside] * _BLOCK + offset
    above = probs >= t[:, None]
    if use is not None:
        above &= use[:, None]
    return above.nonzero().unbind(1)


def _threshold(
    probs: torch.Tensor, *, top_p: Param, top_k: IntParam, min_p: Param
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t [n] float32, most [n] float64: at most how many entries have p >= t, inf when unbounded), where t is
    the lower edge of the highest bucket s such that the entries in buckets >= s include
    one the rule surely drops (0 when none is found: the whole row). Top-p drops every entry below the highest
    bucket whose mass from the top exceeds top_p (the mass before it does); top-k drops rank top_k; min-p drops
    p < min_p x p_max."""
    n, device = probs.shape[0], probs.device
    index_dtype = torch.int32 if n * _BUCKETS < 1 << 31 else torch.int64
    row_base = torch.arange(0, n * _BUCKETS, _BUCKETS, dtype=index_dtype, device=device)
    bucket = (probs.view(torch.int32) >> _SHIFT).add_(row_base[:, None]).flatten()  # row-major [n, _BUCKETS]
    mass = torch.bincount(bucket, weights=probs.flatten(), minlength=n * _BUCKETS).view(n, _BUCKETS)
    edges = torch.arange(_BUCKETS, device=device)
    nonempty = mass > 0
    from_top = mass.double().flip(1).cumsum(1).flip(1)  # mass in buckets >= b
    cross = torch.where(from_top > _column(top_p) + _MARGIN, edges, -1).amax(1)
    start = _highest_nonempty_below(nonempty, edges, cross)
    if isinstance(min_p, torch.Tensor) or min_p > 0:
        floor = min_p * probs.amax(dim=1)  # float32, as the rule computes it
        below = _highest_nonempty_below(nonempty, edges, floor.view(torch.int32).long() >> _SHIFT)
        start = torch.where(torch.as_tensor(min_p, device=device) > 0, torch.maximum(start, below), start)
    if isinstance(top_k, torch.Tensor) or top_k > 0:
        counts = torch.bincount(bucket, minlength=n * _BUCKETS).view(n, _BUCKETS)
        ranks_from_top = counts.flip(1).cumsum(1).flip(1)  # entries in buckets >= b
        holds_rank_k = torch.where(ranks_from_top > _column(top_k), edges, -1).amax(1)  # holds rank top_k
        start = torch.where(torch.as_tensor(top_k, device=device) > 0, torch.maximum(start, holds_rank_k), start)
    # A bucket holds at most mass / (its lower edge) entries (float32 sums: 1% room).
    lower = (edges.int() << _SHIFT).view(torch.float32).double()
    per_bucket = torch.where(mass > 0, mass.double() * 1.01 / lower + 1, 0)
    most = torch.where(edges >= start[:, None], per_bucket, 0).sum(1)
    return (start.int() << _SHIFT).view(torch.float32), most


def _highest_nonempty_below(nonempty: torch.Tensor, edges: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
    """Per row the highest nonempty bucket below `bucket` [n] (0 if none)."""
    return torch.where(nonempty & (edges < bucket[:, None]), edges, 0).amax(1)


def _column(param: Param | IntParam) -> Param | IntParam:
    return param[:, None] if isinstance(param, torch.Tensor) else param
