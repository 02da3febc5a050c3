"""The engine's per-step sampler (`topp_rl.ops.draw`): the fast paths give exactly what the general ones give.

The scalar-parameter path of `sampling_candidates` against the per-row tensor path (the windowed algorithm)
and a full-sort reference, in rank order; the dense draw against the set draw, the same token and log-prob for the same u
(random, 0, 1 - 2^-53 and values at the inverse CDF's steps).
"""

import pytest
import torch

from topp_rl.ops import Candidates, sampling_candidates
from topp_rl.ops.draw import draw_dense, draw_from_sets, sample_kept
from topp_rl.ops.sampling import sglang_kept

F32 = torch.float32
PARAMS = [  # (temperature, top_p, top_k, min_p)
    (1.0, 0.9, 0, 0.0), (0.7, 0.95, 50, 0.0), (1.3, 1.0, 50, 0.0), (1.0, 0.9, 0, 0.05), (0.8, 0.5, 5, 0.2),
    (1.0, 1.0, 0, 0.0), (1.0, 0.05, 0, 0.0), (1.0, 1.0, 1, 0.0),
]


def _logits(kind: str, n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":  # a random tiny model: sets of ~90% of the ids
        return torch.randn(n, vocab, generator=g) * 0.05
    if kind == "ties":  # three values: tie groups straddle every cut
        return torch.randint(0, 3, (n, vocab), generator=g).float()
    z = torch.randn(n, vocab, generator=g) * 3  # peaky, with ids that underflow to p = 0 and one -inf
    z[:, 1] = -200.0
    z[:, 2] = -float("inf")
    return z


def _reference_sets(logits, temperature, top_p, top_k, min_p) -> list[list[int]]:
    """The rule of `sampling_candidates` by one full stable sort, each row in rank order."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    ps, order = p.sort(dim=-1, descending=True, stable=True)
    keep = (ps.cumsum(-1) - ps) <= torch.tensor(top_p, dtype=F32)
    if top_k:
        keep[:, top_k:] = False
    keep &= ps >= torch.tensor(min_p, dtype=F32) * ps[:, :1]
    keep[:, 0] = True
    return [order[i][keep[i]].tolist() for i in range(len(p))]


def _per_row(n, temperature, top_p, top_k, min_p) -> dict:
    return dict(temperature=torch.full((n,), temperature), top_p=torch.full((n,), top_p),
                top_k=torch.full((n,), top_k), min_p=torch.full((n,), min_p))


def _edge_uniforms(scaled: torch.Tensor, cands: Candidates, seed: int) -> list[torch.Tensor]:
    """Random u, u = 0, u -> 1, and for each row the u that put the set draw's target on (and one ulp either
    side of) the step into its 2nd and its last kept id: where a different rounding would pick another id."""
    n = cands.num_rows
    out = [torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64),
           torch.zeros(n, dtype=torch.float64), torch.full((n,), 1 - 2**-53, dtype=torch.float64)]
    rows, ids = cands.row_of_ids(), cands.ids.long()
    vals = scaled[rows, ids]
    row_max = torch.full((n,), -float("inf")).scatter_reduce_(0, rows, vals, "amax")
    cum = (vals - row_max[rows]).exp().double().cumsum(0)
    starts, ends = cands.offsets[:-1].long(), cands.offsets[1:].long() - 1
    before = torch.cat([torch.zeros(1, dtype=torch.float64), cum])[starts]
    for step in (starts, (ends - 1).clamp_min(starts)):
        u = ((cum[step] - before) / (cum[ends] - before)).clamp(0, 1 - 2**-53)
        out += [u, torch.nextafter(u, torch.zeros_like(u)), torch.nextafter(u, torch.ones_like(u)).clamp(max=1 - 2**-53)]
    return out


@pytest.mark.parametrize("vocab", [16, 33, 64, 65, 128, 129, 200])
@pytest.mark.parametrize("kind", ["uniform", "ties", "peaky"])
def test_fast_paths_equal_the_general_ones(vocab, kind):
    n = 6
    logits = _logits(kind, n, vocab, seed=vocab)
    for temperature, top_p, top_k, min_p in PARAMS:
        kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        cands, ranking = sglang_kept(logits, **kw)
        general = sampling_candidates(logits, **_per_row(n, *kw.values()))
        assert cands == general, kw
        assert cands.to_lists() == _reference_sets(logits, *kw.values()), kw
        assert cands == sampling_candidates(logits, **kw)
        scaled = logits / temperature
        if ranking is not None:  # the kept ranks are a prefix of every row (what the dense draw relies on)
            assert torch.equal(ranking.keep, torch.arange(vocab) < ranking.count[:, None])
        for u in _edge_uniforms(scaled, cands, seed=vocab):
            want_tokens, want_lp = draw_from_sets(scaled, cands, u)
            got_cands, tokens, lp = sample_kept(logits, scaled, u, **kw)
            assert got_cands == cands and torch.equal(tokens, want_tokens), (kw, u)
            assert torch.equal(lp, want_lp), (kw, u)
            if ranking is not None:
                tokens, lp = draw_dense(scaled, ranking, u)
                assert torch.equal(tokens, want_tokens) and torch.equal(lp, want_lp), (kw, u)


@pytest.mark.parametrize("vocab", [300, 1000, 5000, 9000])
@pytest.mark.parametrize("kind", ["uniform", "ties", "peaky"])
def test_windowed_vocabularies_equal_the_full_sort(vocab, kind):
    """Vocabularies where the window (first sized from p_max up to V = 8192) may resolve, grow or fall back."""
    logits = _logits(kind, 4, vocab, seed=vocab)
    for temperature, top_p, top_k, min_p in PARAMS[:5]:
        kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        cands, _ = sglang_kept(logits, **kw)
        assert cands == sampling_candidates(logits, **_per_row(4, *kw.values())), kw
        assert cands.to_lists() == _reference_sets(logits, *kw.values()), kw
        scaled = logits / temperature
        u = torch.rand(4, generator=torch.Generator().manual_seed(vocab), dtype=torch.float64)
        want_tokens, want_lp = draw_from_sets(scaled, cands, u)
        _, tokens, lp = sample_kept(logits, scaled, u, **kw)
        assert torch.equal(tokens, want_tokens) and torch.equal(lp, want_lp), kw


def test_large_vocab_full_sort_and_window_paths():
    """V = 49152: near-uniform rows fall back to one full sort (the dense draw then runs over 3 x 49152 cells),
    peaky rows resolve in the window (no ranking: the set draw)."""
    for kind, full_sort in (("uniform", True), ("peaky", False)):
        logits = _logits(kind, 3, 49152, seed=7)
        for temperature, top_p, top_k, min_p in ((1.0, 0.9, 0, 0.0), (0.8, 0.95, 0, 0.01)):
            kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
            cands, ranking = sglang_kept(logits, **kw)
            assert (ranking is not None) == full_sort
            assert cands == sampling_candidates(logits, **_per_row(3, *kw.values()))
            scaled = logits / temperature
            for u in _edge_uniforms(scaled, cands, seed=1):
                want_tokens, want_lp = draw_from_sets(scaled, cands, u)
                _, tokens, lp = sample_kept(logits, scaled, u, **kw)
                assert torch.equal(tokens, want_tokens)
                assert torch.equal(lp, want_lp), (kw, u)
                if ranking is not None:
                    tokens, lp = draw_dense(scaled, ranking, u)
                    assert torch.equal(tokens, want_tokens) and torch.equal(lp, want_lp)


def test_dense_draw_follows_the_renormalised_kept_distribution():
    """Each kept id at its renormalised probability (5 sd), never a dropped id, nor one whose p underflows."""
    base = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 2
    base[2, 5] = -200.0
    reps = 20_000
    logits = base.repeat_interleave(reps, 0)
    cands, ranking = sglang_kept(logits, temperature=0.9, top_p=0.8, top_k=0, min_p=0.0)
    assert ranking is not None
    u = torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    tokens, log_probs = draw_dense(logits / 0.9, ranking, u)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[cands.row_of_ids(), cands.ids.long()] = True
    dense = (logits / 0.9).masked_fill(~keep, float("-inf")).log_softmax(-1)
    assert bool(keep.gather(1, tokens[:, None]).all()) and not bool((tokens[2 * reps :] == 5).any())
    torch.testing.assert_close(log_probs, dense.gather(1, tokens[:, None]).squeeze(1), atol=1e-6, rtol=0)
    for r in range(3):
        freq = torch.bincount(tokens[r * reps : (r + 1) * reps], minlength=40).double() / reps
        prob = dense[r * reps].exp().double()
        sd = (prob * (1 - prob) / reps).sqrt()
        assert bool(((freq - prob).abs() <= 5 * sd + 1e-12).all()), (r, (freq - prob).abs().max())


@pytest.mark.parametrize(
    "kw",
    [dict(top_p=1 + 1e-12), dict(min_p=1 - 1e-12), dict(top_p=1e-50), dict(temperature=1e39), dict(top_k=50.0),
     dict(top_p=True), dict(top_k=2**63), dict(temperature=0.0), dict(min_p=float("nan"))],
)
def test_scalar_parameters_accept_and_reject_as_per_row_tensors(kw):
    """A plain-number parameter is checked at float32 / int64, as the per-row tensors are: the same sets, or
    the same error."""
    logits = _logits("peaky", 3, 30, seed=0)
    try:
        want = sampling_candidates(logits, **{k: torch.tensor([v] * 3) for k, v in kw.items()})
    except (ValueError, RuntimeError) as e:
        with pytest.raises(type(e)):
            sampling_candidates(logits, **kw)
    else:
        assert sampling_candidates(logits, **kw) == want


def test_a_row_without_distribution_names_the_row():
    logits = torch.zeros(3, 20)
    logits[1, 4] = float("nan")
    with pytest.raises(ValueError, match=r"logits row 1 \(of 3\) is not finite after dividing by temperature=0.5"):
        sglang_kept(logits, temperature=0.5, top_p=0.9, top_k=0, min_p=0.0)
