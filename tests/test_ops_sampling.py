"""sampling_candidates: both conventions against plain per-row sort-and-cumsum implementations written here."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from topp_rl.ops import sampling_candidates

F32 = torch.float32


def sglang_reference(row, *, temperature, top_p, top_k, min_p):
    """SGLang's rule, one row, full stable sort: rank by p desc (lower id first), mass before r <= top_p, ..."""
    p = torch.softmax(row.float() / temperature, dim=-1)
    order = sorted(range(p.numel()), key=lambda v: (-p[v].item(), v))
    ps = p[order]
    before = torch.cumsum(ps, dim=0) - ps
    top_p_t, thr = torch.tensor(top_p, dtype=F32), torch.tensor(min_p, dtype=F32) * ps[0]
    kept = []
    for r, v in enumerate(order):
        if (top_k == 0 or r < top_k) and before[r] <= top_p_t and ps[r] >= thr:
            kept.append(v)
    return kept


def vllm_reference(row, *, temperature, top_p, top_k, min_p):
    """vLLM's min-p, then top-k (ties at the k-th logit kept), then top-p on the renormalised rest."""
    z = row.float() / temperature
    vocab = z.numel()
    p = torch.softmax(z, dim=-1)
    z = torch.where(p < torch.tensor(min_p, dtype=F32) * p.max(), torch.tensor(float("-inf")), z)
    if 0 < top_k < vocab:
        kth = sorted(z.tolist())[vocab - top_k]
        z = torch.where(z < kth, torch.tensor(float("-inf")), z)
    order = sorted(range(vocab), key=lambda v: z[v].item())  # ascending, stable (lower id first)
    alive = [v for v in order if z[v] > float("-inf")]
    if top_p < 1:
        cum = torch.cumsum(torch.softmax(z[order], dim=-1), dim=0)
        limit = 1 - torch.tensor(top_p, dtype=F32)
        alive = [
            v for i, v in enumerate(order) if z[v] > float("-inf") and (cum[i] > limit or i == vocab - 1)
        ]
    return alive[::-1]


@st.composite
def cases(draw):
    n = draw(st.integers(1, 4))
    vocab = draw(st.integers(2, 300))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):  # coarse values: many exact ties
        logits = torch.randint(-6, 7, (n, vocab), generator=g).float() * 0.5
    else:
        logits = torch.randn(n, vocab, generator=g) * draw(st.sampled_from([0.5, 2.0, 6.0]))
    params = dict(
        temperature=draw(st.sampled_from([0.3, 0.7, 1.0, 1.6])),
        top_p=draw(st.sampled_from([0.05, 0.5, 0.9, 0.97, 0.999, 1.0])),
        top_k=draw(st.sampled_from([0, 1, 2, 5, 50, 400])),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.05, 0.3])),
    )
    return logits, params


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_sglang_matches_sort_and_cumsum(case):
    logits, params = case
    got = sampling_candidates(logits, **params).to_lists()
    assert got == [sglang_reference(row, **params) for row in logits]


@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_vllm_matches_reference(case):
    logits, params = case
    got = sampling_candidates(logits, convention="vllm", **params).to_lists()
    assert got == [vllm_reference(row, **params) for row in logits]


def test_worked_examples():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert sampling_candidates(logits, top_p=0.7).to_lists() == [[0, 1]]
    assert sampling_candidates(logits, top_p=0.5).to_lists() == [[0, 1]]  # mass before id 1 is 0.5 <= 0.5
    assert sampling_candidates(logits, top_p=0.7, top_k=1).to_lists() == [[0]]
    assert sampling_candidates(logits, min_p=0.5).to_lists() == [[0, 1]]
    assert sampling_candidates(logits, top_p=0.7, convention="vllm").to_lists() == [[0, 1]]
    assert sampling_candidates(logits, top_p=0.4, convention="vllm").to_lists() == [[0]]


def test_ties_lower_id_first_and_argmax_kept():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    assert sampling_candidates(logits, top_k=2).to_lists() == [[1, 2]]
    # vLLM's top-k keeps every logit tied with the k-th largest
    assert sorted(sampling_candidates(logits, top_k=2, convention="vllm").to_lists()[0]) == [1, 2, 3]
    # tiny top_p keeps only the argmax
    assert sampling_candidates(logits, top_p=1e-6).to_lists() == [[1]]
    # a tie group straddling the preselect window: 200 equal maxima, top_k=100 -> ids 0..99
    flat = torch.zeros(1, 1000)
    flat[0, :200] = 5.0
    assert sampling_candidates(flat, top_k=100).to_lists() == [list(range(100))]


def test_window_growth_and_per_row_params():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=g) * torch.tensor([0.1, 0.5, 1, 2, 4, 8])[:, None]
    top_p = torch.tensor([0.99, 0.9, 0.5, 0.95, 0.9, 0.3])
    top_k = torch.tensor([0, 0, 3, 4000, 0, 0])
    got = sampling_candidates(logits, top_p=top_p, top_k=top_k, temperature=0.8).to_lists()
    want = [
        sglang_reference(r, temperature=0.8, top_p=float(p), top_k=int(k), min_p=0.0)
        for r, p, k in zip(logits, top_p, top_k, strict=True)
    ]
    assert got == want
    assert len(got[0]) > 1000  # the flat row needed a window far past the first 64


def test_temperature_applies_before_truncation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 100, generator=g) * 3
    hot = sampling_candidates(logits, temperature=2.0, top_p=0.8).to_lists()
    assert hot == sampling_candidates(logits / 2.0, top_p=0.8).to_lists()
    assert sum(map(len, hot)) > sum(map(len, sampling_candidates(logits, top_p=0.8).to_lists()))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=0.0), r"temperature=0.0 must be finite and >= 1e-06"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]; use top_p=1.0"),
        (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k=-1 must be an integer >= 0; use top_k=0"),
        (dict(min_p=1.0), r"min_p=1.0 must be in \[0, 1\)"),
        (dict(top_p=torch.tensor([0.5, 0.5, 0.5])), r"top_p has shape \(3,\)"),
        (dict(convention="hf"), "convention='hf'"),
    ],
)
def test_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sampling_candidates(torch.zeros(2, 5), **kwargs)


@pytest.mark.parametrize("vocab", [128, 1000, 5000])
@pytest.mark.parametrize("kind", ["ties", "near_uniform", "peaked"])
def test_sglang_equals_the_full_sort_oracle(vocab, kind):
    """Every path of the windowed sampler (one full sort at a small vocab, a resolving window, a growing one)
    against the tests' dense full-sort oracle, on the three shapes that stress it."""
    from oracles import sglang_keep_mask

    g = torch.Generator().manual_seed(vocab)
    n = 12
    if kind == "ties":  # few distinct values: tie groups straddle every window edge
        logits = torch.randint(0, 3, (n, vocab), generator=g).float()
    elif kind == "near_uniform":  # top_p 0.9 keeps ~90% of the ids (a random tiny model's sets)
        logits = torch.randn(n, vocab, generator=g) * 0.05
    else:  # a few boosted ids hold most of the mass
        logits = torch.randn(n, vocab, generator=g)
        logits.scatter_add_(1, torch.randint(0, vocab, (n, 8), generator=g), torch.full((n, 8), 9.0))
    for top_p, top_k, min_p in ((0.9, 0, 0.0), (0.5, 0, 0.0), (1.0, 40, 0.0), (0.95, 0, 0.2), (0.99, 300, 0.0)):
        got = sampling_candidates(logits, temperature=0.8, top_p=top_p, top_k=top_k, min_p=min_p)
        want = sglang_keep_mask(logits.float() / 0.8, top_p=top_p, top_k=top_k, min_p=min_p)
        assert [sorted(r) for r in got.to_lists()] == [row.nonzero().flatten().tolist() for row in want]
