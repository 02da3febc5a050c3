"""`candidate_head_logprobs`: restricted log-probs straight from final hidden states and the output layer.

Dense computation it equals (values and gradients w.r.t. hidden and weight):
`token_logprobs(hidden @ weight.T, tokens, cands=cands, rows=rows, temperature=..., vocab_start=..., tp_group=...)`.

Rows with candidates cost O(|candidates| x H): the weight rows of their distinct candidate ids (in this shard)
are gathered and dotted with the row's hidden state; the [T, V] logits are never formed. Rows without
candidates stream the vocabulary in chunks with an online log-sum-exp (bounded memory), and the backward
recomputes each chunk's logits instead of storing them. Under TP `hidden` is replicated and `weight` holds rows
[vocab_start, vocab_start + V_local); the backward all-reduces the hidden gradient over the TP group, as
Megatron's column-parallel output layer does, so it comes out complete on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from topp_rl.ops._checks import check_cands_rows, check_logits_tokens, check_temperature, check_vocab
from topp_rl.ops._restrict import Plan, local_target, make_plan, reduce_over_tp, segment_lse
from topp_rl.ops.candidates import Candidates

_CHUNK_ELEMENTS = 1 << 21  # [rows, vocab-chunk] logits stay at <= 8 MB (fp32)
_PAIR_ELEMENTS = 1 << 19  # [pairs, H] gathers of 2 MB stay cache-resident; larger ones ran 2-4x slower here
_MAX_ROWS = 4096


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
    plan = make_plan(tokens, restricted, num_rows=num_rows, vocab_local=vocab_local, vocab_start=vocab_start)
    if restricted is not None:
        _check_finite_hidden(hidden, plan.cand_rows)
    c = _Context(
        plan=plan, temperature=temperature, group=tp_group, cands=restricted[0] if restricted else None
    )
    return _CandidateHead.apply(hidden, weight, c)


@dataclass(frozen=True)
class _Context:
    plan: Plan
    temperature: float
    group: dist.ProcessGroup | None
    cands: Candidates | None


def _check_finite_hidden(hidden: torch.Tensor, cand_rows: torch.Tensor) -> None:
    bad = ~torch.isfinite(hidden.index_select(0, cand_rows).sum(dim=-1, dtype=torch.float32))
    if bool(bad.any()):
        row = int(cand_rows[bad.nonzero()[0]])
        raise ValueError(
            f"hidden row {row} has candidates and holds a non-finite value (inf or nan); restricted log-probs "
            "need finite logits there (check the model output)"
        )


def _free_targets(plan: Plan, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows without candidates whose token lies in this shard, and its local column (candidate rows find
    their token among the pairs)."""
    here, col = local_target(plan)
    if plan.pairs is None:
        return here, col
    is_free = torch.ones(num_rows, dtype=torch.bool, device=here.device)
    is_free[plan.cand_rows] = False
    keep = is_free[here]
    return here[keep], col[keep]


def _free_chunks(free_rows: torch.Tensor | None, num_rows: int, width: int):
    """(row index, vocab chunk width) blocks of the rows without candidates."""
    idx = torch.arange(num_rows) if free_rows is None else free_rows
    for a in range(0, idx.numel(), _MAX_ROWS):
        block = idx[a : a + _MAX_ROWS]
        yield block, max(64, _CHUNK_ELEMENTS // max(block.numel(), 1))


def _pair_chunks(num_pairs: int, hidden_size: int):
    step = max(1, _PAIR_ELEMENTS // max(hidden_size, 1))
    for a in range(0, num_pairs, step):
        yield slice(a, min(a + step, num_pairs))


def _online_lse(h: torch.Tensor, weight: torch.Tensor, t: float, width: int) -> torch.Tensor:
    """log-sum-exp over the local vocab of h @ weight.T / t, one vocab chunk at a time."""
    m = torch.full((h.shape[0],), float("-inf"), dtype=h.dtype, device=h.device)
    s = torch.zeros_like(m)
    for a in range(0, weight.shape[0], width):
        logits = (h @ weight[a : a + width].to(h.dtype).T).div_(t)
        new_m = torch.maximum(m, logits.amax(dim=-1))
        s = s * torch.exp(m - new_m) + torch.exp(logits - new_m[:, None]).sum(dim=-1)
        m = new_m
    return m + torch.log(s)


def _pair_logits(hidden, weight, plan: Plan, t: float, cdt: torch.dtype) -> torch.Tensor:
    pr = plan.pairs
    out = torch.empty(pr.row.numel(), dtype=cdt, device=hidden.device)
    for sl in _pair_chunks(pr.row.numel(), hidden.shape[1]):
        h = hidden.index_select(0, pr.row[sl]).to(cdt)
        w = weight.index_select(0, pr.col[sl]).to(cdt)
        out[sl] = (h * w).sum(dim=-1) / t
    return out


def _accumulate(out, dest, coef, *, src, src_index) -> None:
    """out[dest[j]] += coef[j] * src[src_index[j]], in cache-sized chunks, destinations sorted (index_add_ with
    sorted indices ran ~10x faster here than with random ones)."""
    order = torch.argsort(dest, stable=True)
    for sl in _pair_chunks(order.numel(), src.shape[1]):
        o = order[sl]
        out.index_add_(0, dest[o], coef[o][:, None] * src.index_select(0, src_index[o]).to(out.dtype))


class _CandidateHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, c: _Context):
        plan, t, num_rows = c.plan, c.temperature, hidden.shape[0]
        cdt = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        full_lse = torch.full((num_rows,), float("-inf"), dtype=cdt, device=hidden.device)
        for block, width in _free_chunks(plan.free_rows, num_rows, plan.vocab_local):
            block = block.to(hidden.device)
            full_lse[block] = _online_lse(hidden.index_select(0, block).to(cdt), weight, t, width)
        here, col = _free_targets(plan, num_rows)
        target = torch.zeros(num_rows, dtype=cdt, device=hidden.device)
        target[here] = (hidden[here].to(cdt) * weight[col].to(cdt)).sum(dim=-1) / t
        m = plan.cand_rows.numel()
        pair_z, cand_lse = None, full_lse.new_zeros(0)
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
            torch.cat([full_lse, cand_lse]),
            weighted=[],
            plain=[torch.cat([target, target.new_zeros(m)])],
            vocab_end=plan.vocab_start + plan.vocab_local,
            group=c.group,
        )
        if c.group is not None:
            check_vocab(cands=c.cands, tokens=plan.tokens, vocab_size=red.vocab_size)
        norm = red.lse[:num_rows].clone()
        norm[plan.cand_rows] = red.lse[num_rows:]
        ctx.c = c
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
        # Rows without candidates: d logp / d logit_v = [v = token] - softmax_v; recompute each vocab chunk.
        for block, width in _free_chunks(plan.free_rows, num_rows, plan.vocab_local):
            block = block.to(hidden.device)
            h, gb, lse = hidden.index_select(0, block).to(cdt), g[block], norm[block]
            gh = torch.zeros_like(h)
            for a in range(0, weight.shape[0], width):
                w = weight[a : a + width].to(cdt)
                p = torch.exp((h @ w.T).div_(t) - lse[:, None]).mul_(gb[:, None])
                gh -= p @ w
                grad_w[a : a + width] -= p.T @ h
            grad_h.index_add_(0, block, gh)
        # Rows' own tokens (rows without candidates) and the pairs (rows with candidates): one coefficient per
        # (row, column), d logp / d logit = [column = token] - softmax over the row's support.
        here, col = _free_targets(plan, num_rows)
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
