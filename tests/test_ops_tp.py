"""TP = 2 on two gloo processes: token_logprobs (with entropy) and candidate_head_logprobs on vocab shards equal
the single-process result, values and gradients. One spawn checks every case (the full TP x CP matrix lives in
tests/test_distributed_ops.py)."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from test_ops_reference import dense_logprobs

import topp_rl.ops.head as head
from topp_rl.ops import Candidates, candidate_head_logprobs, token_logprobs

T, V, H = 9, 20, 5
ROWS = [0, 2, 3, 5, 8]
# row 2: every candidate in shard 1; row 3: token in shard 0, candidates in shard 1; row 8: duplicates
LISTS = [[1, 4, 12], [13, 17], [15, 19], [3], [0, 0, 11, 11, 19]]
RATIOS = (0, 2, 10**9)  # head._PAIR_COST_RATIO: every row gathered, a mix (V_local = 10), every row dense


def _problem(temperature):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (T,), generator=g)
    tokens[3] = 2
    return hidden, weight, tokens, temperature


def _rank_fn(rank):
    group = dist.group.WORLD
    start, end = rank * V // 2, (rank + 1) * V // 2
    cands, rows = Candidates.from_lists(LISTS), torch.tensor(ROWS)
    out = {}
    for temperature in (1.0, 0.6):
        hidden, weight, tokens, t = _problem(temperature)
        logits = (hidden @ weight.T)[:, start:end].clone().requires_grad_()
        logp, ent = token_logprobs(
            logits,
            tokens,
            cands=cands,
            rows=rows,
            temperature=t,
            vocab_start=start,
            tp_group=group,
            return_entropy=True,
        )
        a = torch.linspace(-1, 1, T, dtype=torch.float64)
        (g_logits,) = torch.autograd.grad((a * logp).sum() + (a.flip(0) * ent).sum(), logits)
        out[temperature] = dict(logp=logp.detach(), ent=ent.detach(), g_logits=g_logits)
        for ratio in RATIOS:  # both sides of the head's gather / masked-dense switch, each shard on its own
            head._PAIR_COST_RATIO = ratio
            h, w = hidden.clone().requires_grad_(), weight[start:end].clone().requires_grad_()
            lp = candidate_head_logprobs(
                h, w, tokens, cands=cands, rows=rows, temperature=t, vocab_start=start, tp_group=group
            )
            g_h, g_w = torch.autograd.grad((a * lp).sum(), (h, w))
            out[temperature, ratio] = dict(head=lp.detach(), g_h=g_h, g_w=g_w)
    bad = Candidates.from_lists([[1], [20], [2], [3], [4]])  # id 20 is past the global vocab of 20
    try:
        token_logprobs(
            torch.randn(T, V // 2),
            torch.zeros(T, dtype=torch.long),
            cands=bad,
            rows=torch.tensor(ROWS),
            vocab_start=start,
            tp_group=group,
        )
        out["error"] = None
    except ValueError as err:
        out["error"] = str(err)
    return out


@pytest.mark.distributed
def test_tp2_equals_single_process():
    results = run_distributed(_rank_fn, 2)
    for temperature in (1.0, 0.6):
        hidden, weight, tokens, t = _problem(temperature)
        x = (hidden @ weight.T).requires_grad_()
        ref_logp, ref_ent = dense_logprobs(x, tokens, ROWS, LISTS, t)
        a = torch.linspace(-1, 1, T, dtype=torch.float64)
        (ref_g,) = torch.autograd.grad((a * ref_logp).sum() + (a.flip(0) * ref_ent).sum(), x)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ref_head, _ = dense_logprobs(h @ w.T, tokens, ROWS, LISTS, t)
        ref_gh, ref_gw = torch.autograd.grad((a * ref_head).sum(), (h, w))
        for rank, res in enumerate(results):
            r = res[temperature]
            sl = slice(rank * V // 2, (rank + 1) * V // 2)
            pairs = [(r["logp"], ref_logp), (r["ent"], ref_ent), (r["g_logits"], ref_g[:, sl])]
            for ratio in RATIOS:
                rh = res[temperature, ratio]
                pairs += [(rh["head"], ref_head), (rh["g_h"], ref_gh), (rh["g_w"], ref_gw[sl])]
            for got, want in pairs:
                torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
    for res in results:
        assert (
            res["error"] is not None and "candidate id 20 is outside the vocabulary [0, 20)" in res["error"]
        )
