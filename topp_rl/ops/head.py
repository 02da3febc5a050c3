"""`candidate_head_logprobs`: restricted log-probs straight from final hidden states and the output layer.

Dense computation it equals (values and gradients w.r.t. hidden and weight):
`token_logprobs(hidden @ weight.T, tokens, cands=cands, rows=rows, temperature=..., vocab_start=..., tp_group=...)`.

Each restricted row is scored by whichever of two exact paths is cheaper for its set size s (the cost model):
- the candidate gather, O(s x H): each (row, distinct candidate id in this shard) pair is one dot product of
  the row's hidden state with the id's weight row, all pairs in one sampled matmul over their sparse pattern
  (the backward: two sparse x dense matmuls); the [T, V] logits are never formed;
- the dense chunked path, O(V_local x H): the row's logits are formed one vocab chunk at a time by a matmul,
  masked to its set, and reduced with an online log-sum-exp; the backward recomputes each chunk.
A gathered (row, id) pair costs about `_PAIR_COST_RATIO` times a dense (row, vocab entry) on a CPU (sparse
kernels against one BLAS matmul: 18-22x measured, forward + backward at H = 576, V = 49152, sets of 256-6144
random ids, 2 threads), so a row takes the gather iff (s + 1) x ratio <= V_local (the +1: the sampled token
may lie outside the recorded set). Small sets over a real vocabulary gather; near-uniform sets over a small one
go dense, which is never slower than the unrestricted path by more than the mask. Both paths compute the same
sums, so values and gradients agree to rounding. Rows without candidates take the dense path unmasked. Under TP
`hidden` is replicated and `weight` holds rows [vocab_start, vocab_start + V_local); the backward all-reduces the
hidden gradient over the TP group, as Megatron's column-parallel output layer does, so it comes out complete on
every rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from topp_rl.ops._checks import check_cands_rows, check_logits_tokens, check_temperature, check_vocab
from topp_rl.ops._restrict import Plan, local_target, make_plan, reduce_over_tp, segment_lse
from topp_rl.ops.candidates import Candidates

_CHUNK_ELEMENTS = 1 << 21  # [rows, vocab-chunk] logits stay at <= 8 MB (fp32)
_PAIR_ELEMENTS = 1 << 19  # [pairs, H] gathers of 2 MB stay cache-resident; larger ones ran 2-4x slower here
_MAX_ROWS = 4096
_MASK_BYTES = 1 << 26  # a block of dense restricted rows holds its [rows, V_local] keep bias (64 MB: 682 rows at
# V = 49152); the bias of a single block is kept for the backward, more blocks are rebuilt there one at a time
# The keep bias holds only 0 and -inf, both exact in bfloat16: half the bytes of float32, so twice the rows per
# block (a SmolLM2 head's 512-row batch in one block, kept for the backward) and a cheaper fill.
_BIAS_DTYPE = torch.bfloat16
_ID_CHUNK = 1 << 20  # candidate ids turned into mask positions per pass (8 MB of int64 temporaries)
_PAIR_COST_RATIO = 20  # cost of one gathered (row, id) pair / one dense (row, vocab entry); see the module doc


def candidate_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    cands: Candidates | None,
    rows: torch.Tensor | None,
    temperature: float = 1.0,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Log-probs [T] of `tokens` under logits hidden [T, H] @ weight[V_local, H].T / temperature, restricted.

    Equals token_logprobs(hidden @ weight.T, tokens, cands=..., rows=..., ...) in values and in gradients
    w.r.t. hidden and weight; `cands=None` leaves every row unrestricted.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [T, H] and [V_local, H] "
            "with the same H"
        )
    num_rows, vocab_local = hidden.shape[0], weight.shape[0]
    temperature = check_temperature(temperature)
    tokens = check_logits_tokens(num_rows, tokens.to(hidden.device), what="hidden")
    if tp_group is None and vocab_start != 0:
        raise ValueError(f"vocab_start={vocab_start} without a tp_group; a shard offset needs the TP group")
    restricted = check_cands_rows(cands, rows, num_rows=num_rows, device=hidden.device)
    if tp_group is None:
        check_vocab(cands=restricted[0] if restricted else None, tokens=tokens, vocab_size=vocab_local)
    if restricted is not None:
        _check_finite_hidden(hidden, restricted[1])
    gathered, masked = _split_by_cost(restricted, vocab_local=vocab_local)
    plan = make_plan(tokens, gathered, num_rows=num_rows, vocab_local=vocab_local, vocab_start=vocab_start)
    c = _Context(
        plan=plan,
        temperature=temperature,
        group=tp_group,
        cands=restricted[0] if restricted else None,
        open_rows=_open_rows(restricted, num_rows, device=hidden.device),
        masked=masked,
    )
    return _CandidateHead.apply(hidden, weight, c)


@dataclass(frozen=True)
class _Context:
    plan: Plan  # the gathered rows' pairs; plan.free_rows = every row on the dense path
    temperature: float
    group: dist.ProcessGroup | None
    cands: Candidates | None  # all restricted rows (for the vocab check under TP)
    open_rows: torch.Tensor | None  # int64 unrestricted rows; None = all rows
    masked: tuple[Candidates, torch.Tensor] | None  # restricted rows on the dense path: (sets, local rows)


def _split_by_cost(
    restricted: tuple[Candidates, torch.Tensor] | None, *, vocab_local: int
) -> tuple[tuple[Candidates, torch.Tensor] | None, tuple[Candidates, torch.Tensor] | None]:
    """(rows for the candidate gather, rows for the masked dense path) by the cost model of the module doc."""
    if restricted is None:
        return None, None
    cands, rows = restricted
    gather = (cands.row_lengths() + 1) * _PAIR_COST_RATIO <= vocab_local
    if bool(gather.all()):
        return restricted, None
    if not bool(gather.any()):
        return None, restricted
    g, d = gather.nonzero().flatten(), (~gather).nonzero().flatten()
    return (cands.select(g), rows[g]), (cands.select(d), rows[d])


def _open_rows(
    restricted: tuple[Candidates, torch.Tensor] | None, num_rows: int, *, device: torch.device
) -> torch.Tensor | None:
    if restricted is None:
        return None
    free = torch.ones(num_rows, dtype=torch.bool, device=device)
    free[restricted[1]] = False
    return free.nonzero().flatten()


def _check_finite_hidden(hidden: torch.Tensor, cand_rows: torch.Tensor) -> None:
    bad = ~torch.isfinite(hidden.index_select(0, cand_rows).sum(dim=-1, dtype=torch.float32))
    if bool(bad.any()):
        row = int(cand_rows[bad.nonzero()[0]])
        raise ValueError(
            f"hidden row {row} has candidates and holds a non-finite value (inf or nan); restricted log-probs "
            "need finite logits there (check the model output)"
        )


def _dense_targets(plan: Plan, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows on the dense path whose token lies in this shard, and its local column (gathered rows find their
    token among the pairs)."""
    here, col = local_target(plan)
    if plan.pairs is None:
        return here, col
    is_dense = torch.ones(num_rows, dtype=torch.bool, device=here.device)
    is_dense[plan.cand_rows] = False
    keep = is_dense[here]
    return here[keep], col[keep]


@dataclass(frozen=True)
class _Block:
    rows: torch.Tensor  # int64 local rows
    width: int  # vocab chunk width
    bias: torch.Tensor | None  # [rows, V_local] 0 = kept, -inf = dropped; None = unrestricted


def _dense_blocks(c: _Context, num_rows: int, device: torch.device) -> Iterator[_Block]:
    """Row blocks of the dense path: unrestricted rows, then restricted rows with their keep masks."""
    open_rows = torch.arange(num_rows, device=device) if c.open_rows is None else c.open_rows
    for a in range(0, open_rows.numel(), _MAX_ROWS):
        block = open_rows[a : a + _MAX_ROWS]
        yield _Block(block, _chunk_width(block.numel()), None)
    if c.masked is None:
        return
    cands, rows = c.masked
    step = _masked_block_rows(c)
    for a in range(0, rows.numel(), step):
        block = rows[a : a + step]
        bias = _keep_bias(
            cands[a : a + step],
            c.plan.tokens[block],
            vocab_start=c.plan.vocab_start,
            vocab_local=c.plan.vocab_local,
            shard=c.group is not None,
        )
        yield _Block(block, _chunk_width(block.numel()), bias)


def _masked_block_rows(c: _Context) -> int:
    return max(1, min(_MAX_ROWS, _MASK_BYTES // (_BIAS_DTYPE.itemsize * max(c.plan.vocab_local, 1))))


def _forward_blocks(c: _Context, num_rows: int, device: torch.device) -> list[_Block] | None:
    """The dense blocks, kept for the backward when their keep biases fit one block (so the backward does not
    rebuild them); None = the backward rebuilds them block by block."""
    if c.masked is not None and c.masked[1].numel() > _masked_block_rows(c):
        return None
    return list(_dense_blocks(c, num_rows, device))


def _chunk_width(block_rows: int) -> int:
    return max(64, _CHUNK_ELEMENTS // max(block_rows, 1))


def _keep_bias(
    cands: Candidates, tokens: torch.Tensor, *, vocab_start: int, vocab_local: int, shard: bool
) -> torch.Tensor:
    """[n, V_local] in `_BIAS_DTYPE`: 0 where row j keeps the id (cands(j) U {tokens[j]}, inside this shard), -inf
    elsewhere.

    One index_fill_ of flat positions row * (V_local + 1) + column per ~`_ID_CHUNK` ids (sets of tens of thousands
    of ids would otherwise need several [K] int64 temporaries). Ids outside the shard land in a spare last
    column, so no boolean filtering is needed."""
    n, width = cands.num_rows, vocab_local + 1
    device = tokens.device
    bias = torch.full((n, width), float("-inf"), dtype=_BIAS_DTYPE, device=device)
    flat = bias.view(-1)
    step = max(1, _ID_CHUNK * n // max(cands.ids.numel(), 1))  # rows per pass: ~_ID_CHUNK ids on average
    for a in range(0, n, step):
        part = cands[a : a + step]
        cols = _local_columns(part.ids, vocab_start, vocab_local, shard)
        flat.index_fill_(0, _flat_positions(cols, part.row_lengths(), first_row=a, width=width), 0.0)
    rows = torch.arange(n, device=device) * width
    flat.index_fill_(0, rows.add_(_local_columns(tokens, vocab_start, vocab_local, shard)), 0.0)
    return bias[:, :vocab_local]


def _flat_positions(cols: torch.Tensor, lengths: torch.Tensor, *, first_row: int, width: int) -> torch.Tensor:
    """int64 (first_row + r) * width + cols[j] for the ids j of row r. Rows of one length (sets at a top-k cap)
    take a broadcast add; others repeat each row's start in int32 where the positions fit (half the traffic)."""
    n, k = lengths.numel(), cols.numel()
    start = torch.arange(first_row, first_row + n, device=cols.device)
    if n and k % n == 0 and bool((lengths == k // n).all()):
        return cols.view(n, k // n).long().add_(start[:, None] * width).view(-1)
    pos_dtype = torch.int32 if (first_row + n) * width < 2**31 else torch.int64
    pos = torch.repeat_interleave(start.to(pos_dtype) * width, lengths, output_size=k)
    return pos.add_(cols).long()


def _local_columns(ids: torch.Tensor, vocab_start: int, vocab_local: int, shard: bool) -> torch.Tensor:
    """ids - vocab_start (same dtype); under TP, ids outside this shard map to the spare column V_local."""
    col = ids - vocab_start if vocab_start else ids
    if shard:
        col = torch.where((col >= 0) & (col < vocab_local), col, vocab_local)
    return col


def _pair_chunks(num_pairs: int, hidden_size: int):
    step = max(1, _PAIR_ELEMENTS // max(hidden_size, 1))
    for a in range(0, num_pairs, step):
        yield slice(a, min(a + step, num_pairs))


def _chunk_logits(h, weight, a: int, width: int, t: float, out: torch.Tensor) -> torch.Tensor:
    """Logits h @ weight[a : a + width].T / t, written into the front of the flat scratch buffer `out`."""
    w = weight[a : a + width].to(h.dtype)
    z = out[: h.shape[0] * w.shape[0]].view(h.shape[0], w.shape[0])
    return torch.mm(h, w.T, out=z).div_(t)


def _masked_exp_(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """exp(x + bias) in place, for x <= 0 wherever bias is 0: the exp of the unmasked x, then + bias and the
    dropped entries (-inf, or nan where a dropped x overflowed the exp: inf - inf) set to 0. Never exp(-inf),
    which runs 20x slower than a finite exp on a CPU. A nan logit still shows: it makes the row's maximum, so its
    log-sum-exp, nan."""
    if bias is None:
        return x.exp_()
    return x.exp_().add_(bias).nan_to_num_(nan=0.0, neginf=0.0)


def _online_lse(h, weight, t: float, width: int, bias: torch.Tensor | None) -> torch.Tensor:
    """log-sum-exp over the local vocab (or its kept part) of h @ weight.T / t, one vocab chunk at a time;
    -inf for a row that keeps nothing in this shard."""
    m = torch.full((h.shape[0],), float("-inf"), dtype=h.dtype, device=h.device)
    s = torch.zeros_like(m)
    size = h.shape[0] * min(width, weight.shape[0])
    buf = torch.empty(size, dtype=h.dtype, device=h.device)
    masked = None if bias is None else torch.empty(size, dtype=h.dtype, device=h.device)
    for a in range(0, weight.shape[0], width):
        logits = _chunk_logits(h, weight, a, width, t, buf)
        b = None if bias is None else bias[:, a : a + logits.shape[1]]
        if b is None:
            new_m = torch.maximum(m, logits.amax(dim=-1))
            shift = new_m
        else:  # the kept maximum; a row that keeps nothing so far shifts by 0 (all its entries become 0)
            kept = torch.add(logits, b, out=masked[: logits.numel()].view_as(logits))
            new_m = torch.maximum(m, kept.amax(dim=-1))
            shift = torch.where(torch.isfinite(new_m), new_m, 0.0)
        e = _masked_exp_(logits.sub_(shift[:, None]), b)
        s = s * torch.exp(m - shift) + e.sum(dim=-1)
        m = new_m
    return m + torch.log(s)


def _pair_logits(hidden, weight, plan: Plan, t: float, cdt: torch.dtype) -> torch.Tensor:
    """z[j] = hidden[row_j] . weight[col_j] / t for every pair: one sampled matmul (SDDMM) over the pairs' CSR
    pattern, each value one dot product over H as before; in cache-sized gathers where hidden or weight is not
    `cdt` (a bfloat16 model: only the gathered rows are converted)."""
    pr = plan.pairs
    if hidden.dtype == cdt and weight.dtype == cdt:
        pattern, order = _csr(pr.row, pr.col, torch.zeros_like(pr.row, dtype=cdt), (hidden.shape[0], weight.shape[0]))
        out = torch.empty(pr.row.numel(), dtype=cdt, device=hidden.device)
        out[order] = torch.sparse.sampled_addmm(pattern, hidden, weight.T, beta=0.0).values()
        return out.div_(t)
    out = torch.empty(pr.row.numel(), dtype=cdt, device=hidden.device)
    for sl in _pair_chunks(pr.row.numel(), hidden.shape[1]):
        h = hidden.index_select(0, pr.row[sl]).to(cdt)
        w = weight.index_select(0, pr.col[sl]).to(cdt)
        out[sl] = (h * w).sum(dim=-1) / t
    return out


def _accumulate(out, dest, coef, *, src, src_index) -> None:
    """out[dest[j]] += coef[j] * src[src_index[j]] for distinct (dest, src_index) pairs: one sparse x dense
    matmul, out += S @ src with S [out rows, src rows] holding coef in CSR. On SmolLM2's head (~110 k pairs) it
    takes 10 ms against 170-600 ms for the sorted index_add_ of gathered [910, H] blocks it replaces (the
    allocator faulted in fresh pages for those on every call), within float32 rounding of a float64 sum. A `src`
    of another dtype than `out` (a bfloat16 model) still goes through cache-sized gathers, so only the gathered
    rows are converted."""
    if src.dtype == out.dtype:
        out.addmm_(_csr(dest, src_index, coef.to(out.dtype), (out.shape[0], src.shape[0]))[0], src)
        return
    order = torch.argsort(dest, stable=True)  # index_add_ with sorted indices ran ~10x faster than random ones
    for sl in _pair_chunks(order.numel(), src.shape[1]):
        o = order[sl]
        out.index_add_(0, dest[o], coef[o][:, None] * src.index_select(0, src_index[o]).to(out.dtype))


def _csr(rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]):
    """(the sparse matrix holding values[j] at (rows[j], cols[j]) in CSR, the permutation `order` of the pairs it
    stores: entry i is pair order[i], sorted by row, then column). The pairs must be distinct: CSR holds each
    entry once."""
    order = torch.argsort(rows * shape[1] + cols)
    crow = torch.zeros(shape[0] + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(torch.bincount(rows, minlength=shape[0]), 0, out=crow[1:])
    with warnings.catch_warnings():  # torch marks sparse CSR as beta, once per process
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        # built here, sorted and in range: no O(pairs) invariant check
        matrix = torch.sparse_csr_tensor(crow, cols[order], values[order], shape, check_invariants=False)
    return matrix, order


class _CandidateHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, c: _Context):
        plan, t, num_rows = c.plan, c.temperature, hidden.shape[0]
        cdt = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        dense_lse = torch.full((num_rows,), float("-inf"), dtype=cdt, device=hidden.device)
        kept_blocks = _forward_blocks(c, num_rows, hidden.device)
        for b in kept_blocks or _dense_blocks(c, num_rows, hidden.device):
            dense_lse[b.rows] = _online_lse(hidden.index_select(0, b.rows).to(cdt), weight, t, b.width, b.bias)
        here, col = _dense_targets(plan, num_rows)
        target = torch.zeros(num_rows, dtype=cdt, device=hidden.device)
        target[here] = (hidden[here].to(cdt) * weight[col].to(cdt)).sum(dim=-1) / t
        m = plan.cand_rows.numel()
        pair_z, cand_lse = None, dense_lse.new_zeros(0)
        if plan.pairs is not None:
            pr = plan.pairs
            pair_z = _pair_logits(hidden, weight, plan, t, cdt)
            if not bool(torch.isfinite(pair_z).all()):
                row = int(pr.row[~torch.isfinite(pair_z)][0])
                raise ValueError(
                    f"logits row {row} has candidates and a non-finite candidate logit; check the model"
                )
            target[pr.row[pr.is_target]] = pair_z[pr.is_target]
            cand_lse = segment_lse(pair_z, pr.crow, m)
        red = reduce_over_tp(
            torch.cat([dense_lse, cand_lse]),
            weighted=[],
            plain=[torch.cat([target, target.new_zeros(m)])],
            vocab_end=plan.vocab_start + plan.vocab_local,
            group=c.group,
        )
        if c.group is not None:
            check_vocab(cands=c.cands, tokens=plan.tokens, vocab_size=red.vocab_size)
        norm = red.lse[:num_rows].clone()
        norm[plan.cand_rows] = red.lse[num_rows:]
        ctx.c, ctx.blocks = c, kept_blocks
        ctx.save_for_backward(hidden, weight, norm, pair_z)
        return red.plain[0][:num_rows] - norm

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor):
        hidden, weight, norm, pair_z = ctx.saved_tensors
        c: _Context = ctx.c
        plan, t, num_rows = c.plan, c.temperature, hidden.shape[0]
        cdt = norm.dtype
        g = g_logp.to(cdt) / t  # dz/dlogits = 1/t
        grad_h = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device)
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device)
        # Dense rows: d logp / d logit_v = [v = token] - softmax_v over the row's support (masked entries have
        # softmax 0); recompute each vocab chunk.
        blocks = ctx.blocks if ctx.blocks is not None else _dense_blocks(c, num_rows, hidden.device)
        for b in blocks:
            h, gb, lse = hidden.index_select(0, b.rows).to(cdt), g[b.rows], norm[b.rows]
            gh = torch.zeros_like(h)
            buf = torch.empty(h.shape[0] * min(b.width, weight.shape[0]), dtype=cdt, device=h.device)
            for a in range(0, weight.shape[0], b.width):
                w = weight[a : a + b.width].to(cdt)
                z = _chunk_logits(h, weight, a, b.width, t, buf).sub_(lse[:, None])  # <= 0 where kept
                p = _masked_exp_(z, None if b.bias is None else b.bias[:, a : a + b.width]).mul_(gb[:, None])
                gh.addmm_(p, w, alpha=-1)
                grad_w[a : a + b.width].addmm_(p.T, h, alpha=-1)
            grad_h.index_add_(0, b.rows, gh)
        # Dense rows' own tokens and the pairs of gathered rows: one coefficient per (row, column),
        # d logp / d logit = [column = token] - softmax over the row's support.
        here, col = _dense_targets(plan, num_rows)
        rows_all, cols_all, coef = here, col, g[here]
        if plan.pairs is not None:
            pr = plan.pairs
            pair_coef = g[pr.row] * (pr.is_target.to(cdt) - torch.exp(pair_z - norm[pr.row]))
            rows_all, cols_all = torch.cat([here, pr.row]), torch.cat([col, pr.col])
            coef = torch.cat([coef, pair_coef])
        _accumulate(grad_h, rows_all, coef, src=weight, src_index=cols_all)
        _accumulate(grad_w, cols_all, coef, src=hidden, src_index=rows_all)
        if c.group is not None:
            # hidden is replicated over TP; each rank holds its vocab slice's share of d loss / d hidden.
            # The SUM all-reduce makes it complete (and identical) on every rank.
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=c.group)
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), None
