"""token_logprobs and keep_mask against the dense reference: values and gradients, every row kind."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops_reference import dense_logprobs

import topp_rl.ops._restrict as restrict
from topp_rl.ops import Candidates, keep_mask, token_logprobs


@st.composite
def batches(draw, max_rows=10, max_vocab=40):
    num_rows = draw(st.integers(1, max_rows))
    vocab = draw(st.integers(2, max_vocab))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    logits = torch.randn(num_rows, vocab, generator=g, dtype=torch.float64) * draw(
        st.sampled_from([0.5, 3.0])
    )
    tokens = torch.randint(0, vocab, (num_rows,), generator=g)
    rows = draw(st.lists(st.integers(0, num_rows - 1), unique=True, max_size=num_rows))
    cand_lists = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6)) for _ in rows]
    # usually the recorded set contains the sampled token; sometimes not (it is kept anyway)
    cand_lists = [
        ids + [int(tokens[r])] if draw(st.booleans()) else ids
        for r, ids in zip(rows, cand_lists, strict=True)
    ]
    temperature = draw(st.sampled_from([0.5, 1.0, 1.7]))
    return logits, tokens, rows, cand_lists, temperature


def _weights(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)


@settings(max_examples=40, deadline=None)
@given(batch=batches(), small_chunks=st.booleans())
def test_values_and_gradients_match_dense(batch, small_chunks):
    logits, tokens, rows, cand_lists, temperature = batch
    cands = Candidates.from_lists(cand_lists) if rows else None
    row_t = torch.tensor(rows, dtype=torch.int64) if rows else None
    old = restrict._CHUNK_ELEMENTS
    restrict._CHUNK_ELEMENTS = 7 if small_chunks else old  # many row chunks, gathered and sliced
    try:
        x = logits.clone().requires_grad_()
        logp, ent = token_logprobs(
            x, tokens, cands=cands, rows=row_t, temperature=temperature, return_entropy=True
        )
        y = logits.clone().requires_grad_()
        ref_logp, ref_ent = dense_logprobs(y, tokens, rows, cand_lists, temperature)
        torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
        a, b = _weights(logits.shape[0])
        (gx,) = torch.autograd.grad((a * logp).sum() + (b * ent).sum(), x)
        (gy,) = torch.autograd.grad((a * ref_logp).sum() + (b * ref_ent).sum(), y, retain_graph=True)
        torch.testing.assert_close(gx, gy, rtol=0, atol=1e-12)
        # without entropy: the log-prob-only path (candidate rows never read beyond their ids)
        x2 = logits.clone().requires_grad_()
        logp2 = token_logprobs(x2, tokens, cands=cands, rows=row_t, temperature=temperature)
        (gx2,) = torch.autograd.grad((a * logp2).sum(), x2)
        (gy2,) = torch.autograd.grad((a * ref_logp).sum(), y)
        torch.testing.assert_close(logp2, ref_logp, rtol=0, atol=1e-12)
        torch.testing.assert_close(gx2, gy2, rtol=0, atol=1e-12)
    finally:
        restrict._CHUNK_ELEMENTS = old


def test_float32_and_bf16_logits():
    """16-bit logits are computed in float32: against the dense float64 reference on the logits as given (already
    rounded to their dtype), the values carry float32 round-off only, on any CPU; the gradient, returned in the
    logits' dtype, one more rounding to it (a relative unit round-off, eps / 2)."""
    g = torch.Generator().manual_seed(0)
    num_rows, vocab = 64, 3000
    logits = torch.randn(num_rows, vocab, generator=g) * 4
    tokens = torch.randint(0, vocab, (num_rows,), generator=g)
    rows = list(range(0, num_rows, 2))
    cand_lists = [torch.randint(0, vocab, (5,), generator=g).tolist() for _ in rows]
    cands, row_t = Candidates.from_lists(cand_lists), torch.tensor(rows)
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype).requires_grad_()
        y = x.detach().double().requires_grad_()  # the same values, exactly
        ref, _ = dense_logprobs(y, tokens, rows, cand_lists, 0.9)
        (ref_grad,) = torch.autograd.grad(ref.sum(), y)
        out = token_logprobs(x, tokens, cands=cands, rows=row_t, temperature=0.9)
        assert out.dtype == torch.float32
        # float32 arithmetic over |logits| < 25 / 0.9, a log-sum-exp of up to 3000 terms: ~1e-6
        torch.testing.assert_close(out.double(), ref.detach(), rtol=0, atol=1e-5)
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert grad.dtype == dtype
        torch.testing.assert_close(grad.double(), ref_grad, rtol=torch.finfo(dtype).eps / 2, atol=1e-6)


def test_no_candidates_is_full_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 17, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 17, (5,), generator=g)
    full = torch.log_softmax(logits / 1.3, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    for cands, rows in ((None, None), (Candidates.empty(0), torch.zeros(0, dtype=torch.int64))):
        out = token_logprobs(logits, tokens, cands=cands, rows=rows, temperature=1.3)
        torch.testing.assert_close(out, full, rtol=0, atol=1e-14)


def test_rules_by_example():
    # temperature first, then the mask: candidates {0, 1} with logits [2, 0], T = 2 -> 1 - log(e + 1)
    logits = torch.tensor([[2.0, 0.0, 5.0]], dtype=torch.float64)
    cands = Candidates.from_lists([[0, 1]])
    out = token_logprobs(logits, torch.tensor([0]), cands=cands, rows=torch.tensor([0]), temperature=2.0)
    expected = 1.0 - torch.log(torch.tensor(torch.e + 1.0, dtype=torch.float64))
    torch.testing.assert_close(out, expected[None], rtol=0, atol=1e-14)
    # the sampled token is always kept, even when the recorded set misses it
    out = token_logprobs(
        logits, torch.tensor([2]), cands=Candidates.from_lists([[0]]), rows=torch.tensor([0])
    )
    torch.testing.assert_close(out, torch.log_softmax(torch.tensor([2.0, 5.0], dtype=torch.float64), 0)[1:])
    # duplicated ids count once; a one-token set gives log-prob 0
    dup = token_logprobs(
        logits, torch.tensor([1]), cands=Candidates.from_lists([[1, 1, 0, 0]]), rows=torch.tensor([0])
    )
    torch.testing.assert_close(dup, torch.log_softmax(torch.tensor([2.0, 0.0], dtype=torch.float64), 0)[1:])
    one = token_logprobs(
        logits, torch.tensor([1]), cands=Candidates.from_lists([[1]]), rows=torch.tensor([0])
    )
    assert one.item() == 0.0


def _loop_mask(cand_lists, rows, num_rows, vocab, tokens):
    mask = torch.ones(num_rows, vocab, dtype=torch.bool)
    for r, ids in zip(rows, cand_lists, strict=True):
        mask[r] = False
        mask[r, ids] = True
        if tokens is not None:
            mask[r, int(tokens[r])] = True
    return mask


@settings(max_examples=40, deadline=None)
@given(batch=batches(max_rows=12, max_vocab=30), with_tokens=st.booleans(), data=st.data())
def test_keep_mask_matches_loop_on_every_shard(batch, with_tokens, data):
    logits, tokens, rows, cand_lists, _ = batch
    num_rows, vocab = logits.shape
    if not rows:
        return
    cands, row_t = Candidates.from_lists(cand_lists), torch.tensor(rows)
    want = _loop_mask(cand_lists, rows, num_rows, vocab, tokens if with_tokens else None)
    start = data.draw(st.integers(0, vocab - 1))
    end = data.draw(st.integers(start + 1, vocab))
    got = keep_mask(
        cands,
        row_t,
        num_rows=num_rows,
        vocab_start=start,
        vocab_end=end,
        tokens=tokens if with_tokens else None,
    )
    assert got.shape == (num_rows, end - start)
    assert torch.equal(got, want[:, start:end])


def test_keep_mask_unlisted_rows_stay_true():
    m = keep_mask(Candidates.from_lists([[1]]), torch.tensor([2]), num_rows=4, vocab_start=0, vocab_end=3)
    assert m.tolist() == [[True] * 3, [True] * 3, [False, True, False], [True] * 3]
    with pytest.raises(ValueError, match=r"vocab range \[3, 3\)"):
        keep_mask(Candidates.from_lists([[1]]), torch.tensor([0]), num_rows=1, vocab_start=3, vocab_end=3)
