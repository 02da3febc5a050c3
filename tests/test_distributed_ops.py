"""TP x CP on gloo: `token_logprobs` and `candidate_head_logprobs`, assembled over all ranks, equal the dense
single-process reference (full logits, masked log_softmax) in values and gradients, for every split.

One spawn of 4 ranks runs every split: TP in {1, 2, 4} x CP in {1, 2} (world size <= 4), both CP modes. A split
using fewer than 4 ranks runs as independent replicas on sub-groups, and every replica is checked. Ranks return
their local tensors; the parent reassembles them with the CP index map and asserts.
"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from topp_rl.ops import Candidates, candidate_head_logprobs, sampling_candidates, token_logprobs
from topp_rl.parallel import ParallelLayout, cp_local_positions, cp_shard, response_rows

WORLD = 4
VOCAB, HIDDEN = 128, 16
SPLITS = [(1, 1, "zigzag"), (2, 1, "zigzag"), (4, 1, "zigzag"),
          (1, 2, "zigzag"), (1, 2, "allgather"), (2, 2, "zigzag"), (2, 2, "allgather")]  # (tp, cp, cp_mode)
# name, seq_lengths, response_lengths, sampling params (None = no candidate data), samples without candidates
CASES = [
    ("top_p", [13, 7, 19, 11], [6, 3, 9, 5], dict(temperature=1.0, top_p=0.9), []),
    ("top_k_min_p_t0.7", [9, 17, 6, 15], [4, 10, 2, 7], dict(temperature=0.7, top_k=20, min_p=0.05), [2]),
    ("all_t1.3_tiny_sets", [21, 5, 12], [12, 4, 3], dict(temperature=1.3, top_p=0.8, top_k=5, min_p=0.1), [1]),
    ("unrestricted", [10, 14, 8], [5, 6, 3], None, []),
    # allgather CP=2: rank 0 holds no response row; a sample with no response; one that is all response
    ("edges", [30, 4, 6, 7], [2, 3, 0, 6], dict(temperature=0.9, top_p=0.95), []),
]


def make_case(name, seq_lengths, response_lengths, params, no_cands, *, seed):
    """A packed batch: hidden/weight (logits = hidden @ weight.T), next-token targets, response candidates."""
    g = torch.Generator().manual_seed(seed)
    lengths, resp = torch.tensor(seq_lengths), torch.tensor(response_lengths)
    total = int(lengths.sum())
    hidden = torch.randn(total, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.7
    logits = hidden @ weight.T
    tokens = torch.randint(VOCAB, (total,), generator=g)
    rows, _ = response_rows(torch.arange(total), lengths, resp)  # predicting rows, in sample order
    temperature = (params or {}).get("temperature", 1.0)
    cands = None
    if params is not None:
        lists = sampling_candidates(logits[rows], **params).to_lists()
        owner = torch.repeat_interleave(torch.arange(len(seq_lengths)), resp)
        lists = [[] if int(owner[i]) in no_cands else row for i, row in enumerate(lists)]
        cands = Candidates.from_lists(lists)
    # Sample each response token from its candidate set, except every 7th, drawn from outside its set, so
    # the "sampled token is always kept" rule is exercised.
    sets = cands.to_lists() if cands is not None else [[] for _ in range(rows.numel())]
    for i, (row, ids) in enumerate(zip(rows.tolist(), sets, strict=True)):
        probs = torch.softmax(logits[row] / temperature, -1)
        if ids:
            inside = torch.zeros(VOCAB, dtype=torch.bool)
            inside[ids] = True
            probs = torch.where(inside, probs, 0.0) if i % 7 else (~inside).float()
        tokens[row + 1] = torch.multinomial(probs, 1, generator=g)
    targets = torch.cat([tokens[1:], tokens[:1]])  # the row at g predicts tokens[g + 1]
    return dict(name=name, seq_lengths=lengths, response_lengths=resp, hidden=hidden, weight=weight,
                targets=targets, cands=cands, temperature=temperature,
                coef=torch.randn(total, generator=g))  # loss = sum(coef * logprob) for the gradient checks


def dense_reference(case):
    """Full logits, dense keep mask (candidates + target on candidate rows), masked log_softmax, autograd."""
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    logits = (hidden @ weight.T).detach().requires_grad_()
    targets, total = case["targets"], hidden.shape[0]
    keep = torch.ones(total, VOCAB, dtype=torch.bool)
    if case["cands"] is not None:
        rows, _ = response_rows(torch.arange(total), case["seq_lengths"], case["response_lengths"])
        for row, ids in zip(rows.tolist(), case["cands"].to_lists(), strict=True):
            if ids:
                keep[row] = False
                keep[row, ids] = True
                keep[row, targets[row]] = True

    def logprob(lg):
        z = (lg / case["temperature"]).masked_fill(~keep, float("-inf"))
        return torch.log_softmax(z, -1).gather(1, targets[:, None]).squeeze(1)

    lp = logprob(logits)
    (case["coef"] * lp).sum().backward()
    lp_head = logprob(hidden @ weight.T)
    (case["coef"] * lp_head).sum().backward()
    z = logits.detach() / case["temperature"]
    entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    return dict(logprobs=lp.detach(), entropy=entropy, grad_logits=logits.grad, grad_hidden=hidden.grad,
                grad_weight=weight.grad)


def coords(rank, tp, cp):
    """(replica, tp_rank, cp_rank) of a global rank; TP varies fastest, as in Megatron."""
    size = tp * cp
    return rank // size, rank % size % tp, rank % size // tp


def make_groups():
    """Every TP and CP sub-group of every split; all ranks create them in the same order."""
    groups = {}
    for tp, cp in sorted({(tp, cp) for tp, cp, _ in SPLITS}):
        size = tp * cp
        for base in range(0, WORLD, size):
            for c in range(cp):
                if tp > 1:
                    groups["tp", tp, cp, base, c] = dist.new_group([base + c * tp + t for t in range(tp)])
            for t in range(tp):
                if cp > 1:
                    groups["cp", tp, cp, base, t] = dist.new_group([base + c * tp + t for c in range(cp)])
    return groups


def local_run(case, layout):
    """This rank's share: its CP rows of the packed batch, its TP vocab shard; both ops, forward + backward."""
    positions = layout.local_positions(case["seq_lengths"])
    rows, cand_rows = response_rows(positions, case["seq_lengths"], case["response_lengths"])
    start, end = layout.vocab_range()
    targets = cp_shard(case["targets"], positions)
    coef = cp_shard(case["coef"], positions)  # 0 on padding rows
    cands, cand_local_rows = None, None
    if case["cands"] is not None:
        mine = case["cands"].select(cand_rows)
        nonempty = mine.nonempty_rows()
        cands, cand_local_rows = mine.select(nonempty), rows[nonempty]
    common = dict(cands=cands, rows=cand_local_rows, temperature=case["temperature"], vocab_start=start,
                  tp_group=layout.tp_group)

    hidden = cp_shard(case["hidden"], positions).requires_grad_()
    weight = case["weight"][start:end].clone().requires_grad_()
    logits = (hidden @ weight.T).detach().requires_grad_()
    lp = token_logprobs(logits, targets, **common)
    (coef * lp).sum().backward()
    with torch.no_grad():
        lp_again, entropy = token_logprobs(logits, targets, return_entropy=True, **common)
    lp_head = candidate_head_logprobs(hidden, weight, targets, **common)
    (coef * lp_head).sum().backward()
    return dict(logprobs=lp.detach(), logprobs_with_entropy=lp_again, entropy=entropy, grad_logits=logits.grad,
                logprobs_head=lp_head.detach(), grad_hidden=hidden.grad, grad_weight=weight.grad)


def layout_errors():
    """ParallelLayout checks a real group against the declared size and rank."""
    messages = []
    for kwargs in (dict(tp_size=2, tp_rank=0, tp_group=dist.group.WORLD),  # a group of 4, declared as 2
                   dict(cp_size=4, cp_rank=(dist.get_rank() + 1) % 4, cp_group=dist.group.WORLD)):  # wrong rank
        try:
            ParallelLayout(vocab_size=VOCAB, **kwargs)
        except ValueError as err:
            messages.append(str(err))
    return messages


def rank_main(rank, cases):
    groups = make_groups()
    out = {"layout_errors": layout_errors()}
    for tp, cp, mode in SPLITS:
        replica, tp_rank, cp_rank = coords(rank, tp, cp)
        base = replica * tp * cp
        layout = ParallelLayout(
            vocab_size=VOCAB, tp_size=tp, tp_rank=tp_rank, cp_size=cp, cp_rank=cp_rank, cp_mode=mode,
            tp_group=groups.get(("tp", tp, cp, base, cp_rank)), cp_group=groups.get(("cp", tp, cp, base, tp_rank)),
        )
        for case in cases:
            out[case["name"], tp, cp, mode] = local_run(case, layout)
    return out


def assemble(results, case, tp, cp, mode, replica):
    """Full-size tensors from one replica's ranks; checks each entry is written by exactly the expected ranks."""
    total = case["hidden"].shape[0]
    full = dict(logprobs=torch.full((tp, total), torch.nan), entropy=torch.full((tp, total), torch.nan),
                logprobs_head=torch.full((tp, total), torch.nan), grad_hidden=torch.full((tp, total, HIDDEN), torch.nan),
                grad_logits=torch.full((total, VOCAB), torch.nan), grad_weight=torch.zeros(VOCAB, HIDDEN))
    shard = VOCAB // tp
    for cp_rank in range(cp):
        positions = cp_local_positions(case["seq_lengths"], cp_size=cp, cp_rank=cp_rank, mode=mode)
        real = positions >= 0
        for tp_rank in range(tp):
            local = results[replica * tp * cp + cp_rank * tp + tp_rank][case["name"], tp, cp, mode]
            torch.testing.assert_close(local["logprobs_with_entropy"], local["logprobs"], atol=1e-6, rtol=1e-6)
            assert (local["grad_logits"][~real] == 0).all() and (local["grad_hidden"][~real] == 0).all()
            for key in ("logprobs", "entropy", "logprobs_head", "grad_hidden"):
                assert full[key][tp_rank, positions[real]].isnan().all(), "a position is held by two CP ranks"
                full[key][tp_rank, positions[real]] = local[key][real]
            cols = slice(tp_rank * shard, (tp_rank + 1) * shard)
            full["grad_logits"][positions[real], cols] = local["grad_logits"][real]
            full["grad_weight"][cols] += local["grad_weight"]
    return full


@pytest.mark.distributed
def test_tp_cp_splits_equal_the_dense_reference():
    cases = [make_case(*spec, seed=i) for i, spec in enumerate(CASES)]
    assert all(c["cands"] is None or c["cands"].row_lengths().float().mean() > 1.5 for c in cases)
    assert all(c["cands"] is None or _targets_outside_candidates(c) > 0 for c in cases)
    results = run_distributed(rank_main, WORLD, cases)
    for rank, res in enumerate(results):
        size_err, rank_err = res["layout_errors"]
        assert "tp_group has size 4 and this process is its rank" in size_err and "tp_size=2" in size_err
        assert f"cp_group has size 4 and this process is its rank {rank}," in rank_err
    for case in cases:
        ref = dense_reference(case)
        ref["logprobs_head"] = ref["logprobs"]
        single = assemble(results, case, 1, 1, "zigzag", 0)
        single = {k: v[0] if k in PER_TP_RANK else v for k, v in single.items()}
        for tp, cp, mode in SPLITS:
            for replica in range(WORLD // (tp * cp)):
                got = assemble(results, case, tp, cp, mode, replica)
                where = f"{case['name']} tp={tp} cp={cp} {mode} replica={replica}"
                assert_matches(got, ref, tp=tp, where=f"{where} vs dense reference")
                assert_matches(got, single, tp=tp, where=f"{where} vs the tp=1 cp=1 split", atol=1e-5, rtol=1e-5)


PER_TP_RANK = ("logprobs", "logprobs_head", "entropy", "grad_hidden")  # replicated: every TP rank holds all


def assert_matches(got, want, *, tp, where, atol=2e-5, rtol=1e-5):
    for key in PER_TP_RANK:
        for t in range(tp):
            torch.testing.assert_close(got[key][t], want[key], atol=atol, rtol=rtol, msg=f"{where}: {key}")
    for key in ("grad_logits", "grad_weight"):
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=rtol, msg=f"{where}: {key}")


def _targets_outside_candidates(case) -> int:
    if case["cands"] is None:
        return 0
    total = case["hidden"].shape[0]
    rows, _ = response_rows(torch.arange(total), case["seq_lengths"], case["response_lengths"])
    pairs = zip(rows.tolist(), case["cands"].to_lists(), strict=True)
    return sum(1 for row, ids in pairs if ids and int(case["targets"][row]) not in ids)


def _raise_on_rank_one(rank):
    dist.barrier()
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


@pytest.mark.distributed
def test_run_distributed_surfaces_the_failing_ranks_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*ValueError: rank one refuses"):
        run_distributed(_raise_on_rank_one, 2, timeout=60)
