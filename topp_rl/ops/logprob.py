"""`token_logprobs`: log-probs of sampled tokens over their recorded candidate sets, from (TP-sharded) logits.

Dense computation it equals (values and gradients w.r.t. logits): L = the TP shards concatenated [T, V];
z = L / temperature; for each row i with candidates, z[i, v] = -inf for v outside cands(i) U {tokens[i]};
return log_softmax(z)[i, tokens[i]] (and, with `return_entropy`, the entropy of softmax(L / temperature) with no
restriction). Rows without candidates are unrestricted.

How it departs from the dense path (slime's: full bool mask, masked_fill, log_softmax, gather): rows with
candidates read only their candidate logits (one gather of the distinct (row, id) pairs), rows without are
reduced in bounded row chunks, and the backward is written out analytically (a custom autograd Function), so no
[T, V] temporary is formed besides the gradient itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from topp_rl.ops._checks import (
    check_cands_rows,
    check_finite_rows,
    check_logits_tokens,
    check_temperature,
    check_vocab,
)
from topp_rl.ops._restrict import (
    Plan,
    local_target,
    make_plan,
    reduce_over_tp,
    row_chunks,
    segment_lse,
    take_rows,
)
from topp_rl.ops.candidates import Candidates


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    cands: Candidates | None = None,
    rows: torch.Tensor | None = None,
    temperature: float = 1.0,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [T] (float32, or float64 for float64 logits) of `tokens` under `logits` [T, V_local].

    Equals log_softmax(z)[i, tokens[i]] with z = L / temperature and z[i, v] = -inf outside
    cands(i) U {tokens[i]} for candidate rows (L = all TP shards side by side); see the module docstring.

    `rows` [cands.num_rows] maps candidate row j to local logits row rows[j] (None: identity). Every candidate
    row must be non-empty; rows not listed are unrestricted. With `return_entropy`, returns (logprobs, entropy).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; pass a 2-D [T, V_local] tensor")
    num_rows, vocab_local = logits.shape
    temperature = check_temperature(temperature)
    tokens = check_logits_tokens(num_rows, tokens.to(logits.device), what="logits")
    if tp_group is None and vocab_start != 0:
        raise ValueError(f"vocab_start={vocab_start} without a tp_group; a shard offset needs the TP group")
    restricted = check_cands_rows(cands, rows, num_rows=num_rows, device=logits.device)
    if tp_group is None:  # with TP the global vocab size is learnt in the first all-reduce
        check_vocab(cands=restricted[0] if restricted else None, tokens=tokens, vocab_size=vocab_local)
    plan = make_plan(tokens, restricted, num_rows=num_rows, vocab_local=vocab_local, vocab_start=vocab_start)
    if restricted is not None:
        check_finite_rows(logits, plan.cand_rows)
    ctx = _Context(
        plan=plan,
        temperature=temperature,
        group=tp_group,
        entropy=return_entropy,
        cands=restricted[0] if restricted else None,
    )
    logp, entropy = _TokenLogProb.apply(logits, ctx)
    return (logp, entropy) if return_entropy else logp


@dataclass(frozen=True)
class _Context:
    plan: Plan
    temperature: float
    group: dist.ProcessGroup | None
    entropy: bool
    cands: Candidates | None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _full_pass_rows(c: _Context) -> torch.Tensor | None:
    """Rows needing the full-vocab softmax: all with entropy, else those without candidates (None = all)."""
    return None if c.entropy else c.plan.free_rows


class _TokenLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, c: _Context):
        num_rows, plan, t = logits.shape[0], c.plan, c.temperature
        cdt = _compute_dtype(logits.dtype)
        full_lse = torch.full((num_rows,), float("-inf"), dtype=cdt, device=logits.device)
        mean_z = torch.zeros(num_rows, dtype=cdt, device=logits.device)  # sum_v p(v) z_v, for the entropy
        for chunk in row_chunks(_full_pass_rows(c), num_rows, plan.vocab_local):
            z = take_rows(logits, chunk).to(cdt) / t
            lse = torch.logsumexp(z, dim=-1)
            full_lse[chunk] = lse
            if c.entropy:
                mean_z[chunk] = (torch.exp(z - lse[:, None]) * z).sum(dim=-1)
        here, col = local_target(plan)
        target = torch.zeros(num_rows, dtype=cdt, device=logits.device)
        target[here] = logits[here, col].to(cdt) / t
        m = plan.cand_rows.numel()
        pair_z = None
        cand_lse = full_lse.new_zeros(0)
        if plan.pairs is not None:
            pair_z = logits[plan.pairs.row, plan.pairs.col].to(cdt) / t
            cand_lse = segment_lse(pair_z, plan.pairs.crow, m)
        red = reduce_over_tp(
            torch.cat([full_lse, cand_lse]),
            weighted=[torch.cat([mean_z, mean_z.new_zeros(m)])],
            plain=[torch.cat([target, target.new_zeros(m)])],
            vocab_end=plan.vocab_start + plan.vocab_local,
            group=c.group,
        )
        if c.group is not None:
            check_vocab(cands=c.cands, tokens=plan.tokens, vocab_size=red.vocab_size)
        lse_all, target = red.lse[:num_rows], red.plain[0][:num_rows]
        lse_c = red.lse[num_rows:]
        norm = lse_all.clone()
        norm[plan.cand_rows] = lse_c
        logp = target - norm
        entropy = lse_all - red.weighted[0][:num_rows] if c.entropy else logp.new_zeros(0)
        ctx.c = c
        ctx.save_for_backward(logits, lse_all, red.weighted[0][:num_rows], lse_c, pair_z)
        if not c.entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor, g_entropy: torch.Tensor | None):
        logits, lse_all, mean_z, lse_c, pair_z = ctx.saved_tensors
        c: _Context = ctx.c
        plan, t, num_rows = c.plan, c.temperature, logits.shape[0]
        cdt = lse_all.dtype
        g_logp = g_logp.to(cdt)
        g_ent = g_entropy.to(cdt) if c.entropy and g_entropy is not None else None
        full_rows = _full_pass_rows(c)
        fmt = torch.contiguous_format  # the flat scatter below needs a row-major gradient
        grad = (
            torch.empty_like(logits, memory_format=fmt)
            if full_rows is None
            else torch.zeros_like(logits, memory_format=fmt)
        )
        # d logp_i / d z_iv = [v = t_i] - softmax(z_i)_v over the row's support; d H_i / d z_iv = -p_v (z_v - E_i).
        g_free = g_logp.clone()
        g_free[plan.cand_rows] = 0  # candidate rows get their log-prob gradient from the pairs below
        for chunk in row_chunks(full_rows, num_rows, plan.vocab_local):
            z = take_rows(logits, chunk).to(cdt) / t
            p = torch.exp(z - lse_all[chunk][:, None])
            coef = g_free[chunk][:, None]
            if g_ent is not None:
                coef = coef + g_ent[chunk][:, None] * (z - mean_z[chunk][:, None])
            gz = (p * coef).mul_(-1.0 / t)
            if isinstance(chunk, slice):
                grad[chunk] = gz
            else:
                grad.index_copy_(0, chunk, gz.to(grad.dtype))
        # One flat, sorted scatter-add: the free rows' tokens and the candidate rows' (row, id) pairs.
        here, col = local_target(plan)
        flat, vals = here * plan.vocab_local + col, g_free[here] / t
        if plan.pairs is not None:
            pr = plan.pairs
            p = torch.exp(pair_z - lse_c[pr.crow])
            flat = torch.cat([flat, pr.row * plan.vocab_local + pr.col])
            vals = torch.cat([vals, g_logp[pr.row] * (pr.is_target.to(cdt) - p) / t])
        flat, order = torch.sort(flat)
        grad.view(-1).index_add_(0, flat, vals[order].to(grad.dtype))
        return grad, None
