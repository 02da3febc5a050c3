"""`ToppLogProb` against the dense masked reference: values and gradients on a packed batch (CP 1 here, CP 2 over
gloo in one spawn, with PolicyModule's CP gather), the mask switch, empty (unrestricted) candidate rows, and the logits / entropy paths."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from topp_rl.data import PackedBatch
from topp_rl.ops import Candidates
from topp_rl.parallel import ParallelLayout, cp_local_positions, gather_tokens
from topp_rl.trainer.hook import ToppLogProb

V, H, TEMP = 40, 12, 0.7
R = 10  # response tokens in make_batch()


def make_batch(seed: int = 0) -> PackedBatch:
    """Three samples; sample 1 has no candidate data (empty rows), sample 2 has an empty (non-trainable) row."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor([6, 5, 9])
    resp = torch.tensor([4, 2, 4])
    tokens = torch.randint(0, V, (int(seq.sum()),), generator=g)
    ends = torch.cumsum(seq, 0)
    response_tokens = torch.cat([tokens[e - r : e] for e, r in zip(ends, resp, strict=True)])
    rows: list[list[int]] = []
    for i, tok in enumerate(response_tokens.tolist()):
        if i in (4, 5, 8):  # sample 1 has no candidates; token 8 is a non-trainable placeholder
            rows.append([])
            continue
        extra = torch.randperm(V, generator=g)[: 1 + i % 4].tolist()
        rows.append(sorted(set(extra) | ({tok} if i % 2 == 0 else set())))  # odd rows: token added by the rule
    assert int(resp.sum()) == R
    cu = torch.zeros(4, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq, 0)
    return PackedBatch(
        tokens=tokens, cu_seqlens=cu, seq_lengths=seq, response_lengths=resp,
        position_ids=torch.cat([torch.arange(int(n)) for n in seq]),
        loss_mask=torch.ones(R), advantages=torch.zeros(R), rollout_log_probs=torch.zeros(R),
        response_tokens=response_tokens, candidates=Candidates.from_lists(rows),
        rewards=torch.zeros(3), group_index=torch.zeros(3, dtype=torch.long), sample_index=torch.arange(3),
        num_loss_tokens_global=float(R), num_sequences_global=3,
    )


def dense_reference(batch: PackedBatch, hidden, weight, *, use_mask=True, temperature=TEMP):
    """log_softmax over cands(i) U {token_i} (full vocab for empty rows) of (hidden @ weight.T / T)[row_i]."""
    logits = hidden @ weight.T / temperature
    out, entropy = [], []
    cands = batch.candidates.to_lists()
    ends = torch.cumsum(batch.seq_lengths, 0)
    i = 0
    for end, r in zip(ends.tolist(), batch.response_lengths.tolist(), strict=True):
        for j in range(r):
            z = logits[end - r - 1 + j]
            tok = int(batch.response_tokens[i])
            entropy.append(-(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum())
            if use_mask and cands[i]:
                keep = torch.zeros(V, dtype=torch.bool)
                keep[cands[i] + [tok]] = True
                z = z.masked_fill(~keep, float("-inf"))
            out.append(torch.log_softmax(z, -1)[tok])
            i += 1
    return torch.stack(out), torch.stack(entropy)


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    batch = make_batch()
    T = int(batch.seq_lengths.sum())
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    return batch, hidden, weight


@pytest.mark.parametrize("use_mask", [True, False])
@pytest.mark.parametrize("path", ["head", "logits", "entropy"])
def test_values_and_grads_match_dense_reference(use_mask, path):
    batch, hidden, weight = _inputs()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    hook = ToppLogProb(use_mask=use_mask, temperature=TEMP)
    layout = ParallelLayout.single(V)
    if path == "logits":
        out = hook(batch, layout=layout, logits=h1 @ w1.T)
    else:
        out = hook(batch, layout=layout, hidden=h1, weight=w1, return_entropy=path == "entropy")
    ref, ref_entropy = dense_reference(batch, h2, w2, use_mask=use_mask)
    assert torch.equal(out.token_index, torch.arange(R))
    torch.testing.assert_close(out.logprobs, ref, rtol=1e-10, atol=1e-10)
    if path == "entropy":
        torch.testing.assert_close(out.entropy, ref_entropy.detach(), rtol=1e-10, atol=1e-10)
    w = torch.linspace(-1, 2, R, dtype=torch.float64)  # distinct weights so a permuted gradient fails
    (out.logprobs * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-9, atol=1e-10)


def test_empty_rows_are_unrestricted_and_support_sizes_reported():
    batch, hidden, weight = _inputs()
    out = ToppLogProb(temperature=TEMP)(batch, layout=ParallelLayout.single(V), hidden=hidden, weight=weight)
    sizes = torch.tensor([len(r) for r in batch.candidates.to_lists()])
    assert torch.equal(out.support_size, sizes)
    unmasked, _ = dense_reference(batch, hidden, weight, use_mask=False)
    empty = sizes == 0
    torch.testing.assert_close(out.logprobs[empty], unmasked[empty])
    assert bool((out.logprobs[~empty] > unmasked[~empty]).all())  # restricting can only raise the log-prob


@pytest.mark.parametrize("chunk_rows", [2048, 3])  # one block, and many blocks splitting candidate rows
def test_onpolicy_returns_masked_unmasked_and_entropy_without_grad(chunk_rows):
    batch, hidden, weight = _inputs()
    hidden.requires_grad_()
    _, out = ToppLogProb(use_mask=False, temperature=TEMP).onpolicy(
        batch, layout=ParallelLayout.single(V), hidden=hidden, weight=weight, chunk_rows=chunk_rows
    )
    masked, entropy = dense_reference(batch, hidden.detach(), weight)
    unmasked, _ = dense_reference(batch, hidden.detach(), weight, use_mask=False)
    torch.testing.assert_close(out.logprobs, masked)
    torch.testing.assert_close(out.logprobs_unmasked, unmasked)
    torch.testing.assert_close(out.entropy, entropy)
    assert not out.logprobs.requires_grad


def test_bad_arguments_raise_naming_the_fix():
    batch, hidden, weight = _inputs()
    layout = ParallelLayout.single(V)
    with pytest.raises(ValueError, match="exactly one"):
        ToppLogProb()(batch, layout=layout, hidden=hidden)
    with pytest.raises(ValueError, match="temperature=0"):
        ToppLogProb(temperature=0)


def _cp_worker(rank: int) -> dict:
    """Both CP modes on one rank of a CP=2 group: this rank's values, token indices, and hidden gradient."""
    world = dist.get_world_size()
    batch, hidden, weight = _inputs()
    results = {}
    for mode in ("zigzag", "allgather"):
        positions = cp_local_positions(batch.seq_lengths, cp_size=world, cp_rank=rank, mode=mode)
        local_hidden = hidden[positions.clamp(min=0)].clone().requires_grad_()
        layout = ParallelLayout(vocab_size=V, cp_size=world, cp_rank=rank, cp_mode=mode, cp_group=dist.group.WORLD)
        out = ToppLogProb(temperature=TEMP)(batch, layout=layout, hidden=local_hidden, weight=weight)
        # PolicyModule's CP gather: every rank sees all R values; gradient flows only into its own tokens.
        full = gather_tokens(out.logprobs, out.token_index, num_tokens=R, group=dist.group.WORLD)
        (full * torch.linspace(-1, 2, R, dtype=torch.float64)).sum().backward()
        real = (positions >= 0)[:, None]
        grad = torch.zeros_like(hidden).index_add_(0, positions.clamp(min=0), local_hidden.grad * real)
        results[mode] = (out.token_index, out.logprobs.detach(), grad, full.detach())
    return results


@pytest.mark.distributed
def test_cp2_ranks_together_equal_the_reference():
    batch, hidden, weight = _inputs()
    h = hidden.clone().requires_grad_()
    ref, _ = dense_reference(batch, h, weight)
    (ref * torch.linspace(-1, 2, R, dtype=torch.float64)).sum().backward()
    results = run_distributed(_cp_worker, 2)
    for mode in ("zigzag", "allgather"):
        index = torch.cat([r[mode][0] for r in results])
        values = torch.cat([r[mode][1] for r in results])
        assert torch.equal(index.sort().values, torch.arange(R)), mode  # every token exactly once
        assert all(r[mode][0].numel() > 0 for r in results), mode  # both ranks hold response tokens
        torch.testing.assert_close(values, ref.detach()[index], rtol=1e-10, atol=1e-10)
        for r in results:
            torch.testing.assert_close(r[mode][3], ref.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(results[0][mode][2] + results[1][mode][2], h.grad, rtol=1e-9, atol=1e-10)
