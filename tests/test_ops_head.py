"""candidate_head_logprobs equals token_logprobs(hidden @ weight.T) and the dense reference, values and grads,
on either side of its gather / dense switch (each path forced, and the cost model's own mix)."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops_reference import dense_logprobs

import topp_rl.ops.head as head
from topp_rl.ops import Candidates, candidate_head_logprobs, token_logprobs


@st.composite
def problems(draw):
    num_rows, vocab, hidden_size = draw(st.integers(1, 9)), draw(st.integers(2, 50)), draw(st.integers(1, 8))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    hidden = torch.randn(num_rows, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (num_rows,), generator=g)
    rows = draw(st.lists(st.integers(0, num_rows - 1), unique=True, max_size=num_rows))
    cand_lists = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=5)) for _ in rows]
    return hidden, weight, tokens, rows, cand_lists, draw(st.sampled_from([0.6, 1.0, 1.4]))


# _PAIR_COST_RATIO values that force a path: 0 sends every restricted row to the candidate gather, a huge
# ratio sends every one to the masked dense path; 8 splits the sets of `problems` (vocab 2-50) between both.
PATHS = {"gather": 0, "dense": 10**9, "mixed": 8}


@contextlib.contextmanager
def forced(path: str, *, small_chunks: bool = False):
    old = (head._CHUNK_ELEMENTS, head._PAIR_ELEMENTS, head._MAX_ROWS, head._MASK_BYTES, head._PAIR_COST_RATIO)
    head._PAIR_COST_RATIO = PATHS[path]
    if small_chunks:  # several row blocks, vocab chunks, pair chunks and masked blocks
        head._CHUNK_ELEMENTS, head._PAIR_ELEMENTS, head._MAX_ROWS, head._MASK_BYTES = 5, 5, 3, 200
    try:
        yield
    finally:
        head._CHUNK_ELEMENTS, head._PAIR_ELEMENTS, head._MAX_ROWS, head._MASK_BYTES, head._PAIR_COST_RATIO = old


@settings(max_examples=60, deadline=None)
@given(problem=problems(), small_chunks=st.booleans(), path=st.sampled_from(sorted(PATHS)))
def test_head_matches_dense(problem, small_chunks, path):
    hidden, weight, tokens, rows, cand_lists, temperature = problem
    cands = Candidates.from_lists(cand_lists) if rows else None
    row_t = torch.tensor(rows, dtype=torch.int64) if rows else None
    with forced(path, small_chunks=small_chunks):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = candidate_head_logprobs(h, w, tokens, cands=cands, rows=row_t, temperature=temperature)
        h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ref, _ = dense_logprobs(h2 @ w2.T, tokens, rows, cand_lists, temperature)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        a = torch.linspace(-1, 2, out.numel(), dtype=torch.float64)
        grads = torch.autograd.grad((a * out).sum(), (h, w))
        ref_grads = torch.autograd.grad((a * ref).sum(), (h2, w2))
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _switch_problem():
    """128-id vocab; sets from singletons to the whole vocabulary, so the default cost model splits the rows."""
    g = torch.Generator().manual_seed(5)
    num_rows, vocab, hidden_size = 40, 128, 16
    hidden = torch.randn(num_rows, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (num_rows,), generator=g)
    rows = list(range(0, num_rows, 4)) + list(range(1, num_rows, 4)) + [2, 6]
    sizes = [1, 2, 3, 5, 9, 17, 33, 64, 110, 127, 128]
    cand_lists = [
        torch.randperm(vocab, generator=g)[: sizes[j % len(sizes)]].tolist() for j in range(len(rows))
    ]
    return hidden, weight, tokens, rows, cand_lists


def test_switch_both_ends_equal_the_dense_reference_and_each_other():
    hidden, weight, tokens, rows, cand_lists = _switch_problem()
    cands, row_t = Candidates.from_lists(cand_lists), torch.tensor(rows)
    gathered, masked = head._split_by_cost((cands, row_t), vocab_local=weight.shape[0])
    assert gathered is not None and masked is not None  # the default cost model uses both paths here
    assert int(gathered[0].row_lengths().max()) < int(masked[0].row_lengths().min())
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref, _ = dense_logprobs(ref_h @ ref_w.T, tokens, rows, cand_lists, 0.7)
    a = torch.linspace(-1, 2, ref.numel(), dtype=torch.float64)
    ref_grads = torch.autograd.grad((a * ref).sum(), (ref_h, ref_w))
    results = {}
    for path in ("gather", "dense", "default"):
        with forced(path) if path != "default" else contextlib.nullcontext():
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            out = candidate_head_logprobs(h, w, tokens, cands=cands, rows=row_t, temperature=0.7)
            results[path] = (out, *torch.autograd.grad((a * out).sum(), (h, w)))
        for got, want in zip(results[path], (ref, *ref_grads), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for got, want in zip(results["gather"], results["dense"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_head_equals_token_logprobs_float32_and_bf16():
    """16-bit hidden states and weights are multiplied in float32: against the float64 reference on the inputs as
    given (already rounded to their dtype), the log-probs carry float32 round-off only, on any CPU; the gradients,
    returned in the inputs' dtype, one more rounding to it (a relative unit round-off, eps / 2)."""
    g = torch.Generator().manual_seed(0)
    num_rows, hidden_size, vocab = 48, 32, 2000
    hidden = torch.randn(num_rows, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) * 0.3
    tokens = torch.randint(0, vocab, (num_rows,), generator=g)
    rows = torch.arange(0, num_rows, 3)
    cands = Candidates.from_lists([torch.randint(0, vocab, (4,), generator=g).tolist() for _ in rows])
    for dtype in (torch.float32, torch.bfloat16):
        h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
        h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))  # the same values, exactly
        want = token_logprobs(h64 @ w64.T, tokens, cands=cands, rows=rows, temperature=0.8)
        want_grads = torch.autograd.grad(want.sum(), (h64, w64))
        out = candidate_head_logprobs(h, w, tokens, cands=cands, rows=rows, temperature=0.8)
        assert out.dtype == torch.float32
        # float32 dot products of 32 terms (|logit| < 10) and a log-sum-exp over 2000: ~1e-5
        torch.testing.assert_close(out.double(), want.detach(), rtol=0, atol=1e-4)
        grads = torch.autograd.grad(out.sum(), (h, w))
        for got, ref in zip(grads, want_grads, strict=True):
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), ref, rtol=torch.finfo(dtype).eps / 2, atol=1e-5)


def test_head_rejects_bad_shapes_and_nonfinite_hidden():
    hidden, weight = torch.randn(3, 4), torch.randn(10, 5)
    with pytest.raises(ValueError, match="same H"):
        candidate_head_logprobs(hidden, weight, torch.zeros(3, dtype=torch.long), cands=None, rows=None)
    hidden = torch.randn(3, 4)
    hidden[1, 2] = float("nan")
    with pytest.raises(ValueError, match="hidden row 1 has candidates and holds a non-finite value"):
        candidate_head_logprobs(
            hidden,
            torch.randn(10, 4),
            torch.zeros(3, dtype=torch.long),
            cands=Candidates.from_lists([[1]]),
            rows=torch.tensor([1]),
        )


def test_gradient_accumulation_sparse_and_gathered_paths_equal_float64_sums():
    """`_accumulate`'s sparse x dense matmul (src and out of one dtype) and its gathered fallback (a src of
    another dtype, as a bfloat16 model's) both give out[dest] += coef * src[src_index], pairs in any order."""
    g = torch.Generator().manual_seed(0)
    num_out, num_src, width, num_pairs = 7, 50, 16, 120
    flat = torch.randperm(num_out * num_src, generator=g)[:num_pairs]
    dest, src_index = flat // num_src, flat % num_src
    coef = torch.randn(num_pairs, generator=g, dtype=torch.float64)
    for src in (torch.randn(num_src, width, generator=g, dtype=torch.float64), torch.randn(num_src, width, generator=g)):
        want = torch.zeros(num_out, width, dtype=torch.float64).index_put_(
            (dest,), coef[:, None] * src.double()[src_index], accumulate=True
        )
        got = torch.ones(num_out, width, dtype=torch.float64)  # accumulates into what is there
        head._accumulate(got, dest, coef, src=src, src_index=src_index)
        torch.testing.assert_close(got, want + 1, rtol=0, atol=1e-12)
