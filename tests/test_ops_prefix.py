"""Large vocabularies (V > 8192): the threshold-prefix path of `sampling_candidates` ("sglang") gives exactly the
full-sort rule's sets, in rank order, and what the top-k window path gives, for every row: SmolLM2-like, near-
uniform (sets ~0.9 V), peaky (sets of 1), tie groups across the cut, underflow to p = 0; top-k, min-p,
temperature, top_p = 1; scalar and per-row parameters."""

import pytest
import torch

from topp_rl.ops import sampling, sampling_candidates
from topp_rl.ops._prefix import _entries_above, threshold_prefix
from topp_rl.ops.sampling import sglang_kept

PARAMS = [  # (temperature, top_p, top_k, min_p)
    (1.0, 0.9, 0, 0.0), (0.7, 0.95, 50, 0.0), (1.0, 0.95, 0, 0.01), (1.3, 1.0, 50, 0.0), (1.0, 1.0, 0, 0.0),
    (0.8, 0.5, 5, 0.2), (1.0, 0.05, 0, 0.0), (1.0, 0.9, 1, 0.0), (1.0, 0.9, 300, 0.0), (0.6, 0.99, 0, 0.001),
]


def _rows(vocab: int, seed: int) -> torch.Tensor:
    """One row of each kind: SmolLM2-like (as benchmarks/bench_sampler.py), near-uniform, peaky with ids at
    p = 0, one-hot, tie groups of 40 ids straddling every cut, and a flat head over an underflowing tail."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    zipf = -1.4 * ranks.log() + torch.randn(vocab, generator=g) * 0.3
    zipf = zipf[torch.randperm(vocab, generator=g)]
    uniform = torch.randn(vocab, generator=g) * 0.05
    peaky = torch.randn(vocab, generator=g) * 3
    peaky[1], peaky[2] = -200.0, -float("inf")
    one_hot = torch.full((vocab,), -1e4)
    one_hot[vocab // 3] = 0.0
    ties = torch.full((vocab,), -8.0)
    groups = torch.randperm(vocab, generator=g)[:400].view(10, 40)
    for level, ids in enumerate(groups):
        ties[ids] = 10.0 - level * 0.5
    head = torch.full((vocab,), -300.0)
    head[torch.randperm(vocab, generator=g)[:500]] = 0.0
    return torch.stack([zipf, uniform, peaky, one_hot, ties, head])


def _reference_sets(logits, temperature, top_p, top_k, min_p) -> list[list[int]]:
    """The rule by one full stable sort, each row in rank order."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    ps, order = p.sort(dim=-1, descending=True, stable=True)
    keep = (ps.cumsum(-1) - ps) <= torch.tensor(top_p, dtype=torch.float32)
    if top_k:
        keep[:, top_k:] = False
    keep &= ps >= torch.tensor(min_p, dtype=torch.float32) * ps[:, :1]
    keep[:, 0] = True
    return [order[i][keep[i]].tolist() for i in range(len(p))]


def _window_path(monkeypatch, logits, **kw):
    with monkeypatch.context() as m:
        m.setattr(sampling, "_PREFIX_MIN_V", 1 << 62)
        return sglang_kept(logits, **kw)[0]


@pytest.mark.parametrize("vocab", [2049, 5000, 8193, 16384, 49152, 100_000])
def test_prefix_path_equals_the_full_sort_and_the_window(vocab, monkeypatch):
    logits = _rows(vocab, seed=vocab)
    n = logits.shape[0]
    for temperature, top_p, top_k, min_p in PARAMS:
        kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        cands, _ = sglang_kept(logits, **kw)
        assert cands.to_lists() == _reference_sets(logits, *kw.values()), kw
        assert cands == _window_path(monkeypatch, logits, **kw), kw
        per_row = {k: torch.full((n,), v) for k, v in kw.items()}
        assert sampling_candidates(logits, **per_row) == cands, kw
        for plan in ("first", "after_window"):  # every parameter through both orders, whatever the plan picks
            with monkeypatch.context() as m:
                m.setattr(sampling, "_prefix_plan", lambda top_k, min_p, plan=plan: plan)
                assert sglang_kept(logits, **kw)[0] == cands, (kw, plan)


def test_smollm2_like_batches_at_49152():
    """The engine's case: batches of SmolLM2-like rows (sets of ~30 to ~1300 ids) at several top_p."""
    g = torch.Generator().manual_seed(0)
    vocab = 49152
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    scale = torch.empty(16, 1).uniform_(1.1, 1.6, generator=g)
    z = -scale * ranks.log()[None, :] + torch.randn(16, vocab, generator=g) * 0.3
    logits = z.gather(1, torch.argsort(torch.rand(16, vocab, generator=g), dim=-1))
    for temperature, top_p, top_k, min_p in [(1.0, 0.9, 0, 0.0), (0.7, 0.8, 0, 0.0), (1.0, 0.999, 0, 0.0),
                                             (1.2, 0.95, 1000, 0.0), (1.0, 0.95, 0, 0.002)]:
        kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        cands, ranking = sglang_kept(logits, **kw)
        assert (ranking is None) == (top_p < 0.999)  # a full sort only where sets reach ~0.9 V
        assert cands.to_lists() == _reference_sets(logits, *kw.values()), kw


def test_mixed_per_row_parameters():
    """Per-row parameters differing by row (the trainer's path): each row as the reference at its own values."""
    logits = torch.cat([_rows(49152, seed=1), _rows(49152, seed=2)])
    n = logits.shape[0]
    g = torch.Generator().manual_seed(3)
    temperature = torch.empty(n).uniform_(0.6, 1.4, generator=g)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.9, 0.8, 0.3, 0.99, 0.9, 1.0, 0.7, 0.9])
    top_k = torch.tensor([0, 50, 0, 1, 0, 200, 0, 0, 20, 0, 0, 0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.01, 0.0, 0.0, 0.0, 0.3])
    got = sampling_candidates(logits, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p).to_lists()
    for i in range(n):
        want = _reference_sets(logits[i:i + 1], float(temperature[i]), float(top_p[i]), int(top_k[i]),
                               float(min_p[i]))
        assert got[i] == want[0], i


def test_threshold_prefix_is_the_full_sorts_first_ranks():
    """Each row's prefix: the first `count` ranks of the full stable sort, and every entry outside it has a
    smaller p than every entry inside (so no tie crosses it); rows spanning half of V get count 0."""
    logits = torch.cat([_rows(49152, seed=4), _rows(49152, seed=4) * 1.5])
    probs = torch.softmax(logits, dim=-1)
    vals, ids, count = threshold_prefix(probs, top_p=0.9, top_k=0, min_p=0.0)
    ps, order = probs.sort(dim=-1, descending=True, stable=True)
    assert int(count[1]) == 0  # the near-uniform row
    for i in range(len(probs)):
        c = int(count[i])
        assert c * 2 < probs.shape[1]
        if c == 0:
            continue
        assert torch.equal(ids[i, :c], order[i, :c]) and torch.equal(vals[i, :c], ps[i, :c])
        assert bool((vals[i, c:] == -1).all())
        assert c == probs.shape[1] or bool(ps[i, c] < ps[i, c - 1])


@pytest.mark.parametrize("vocab", [8192, 49152])
def test_block_compaction_equals_the_dense_one(vocab):
    """The entries above a threshold found through block maxima equal those of the dense mask's nonzero, in order,
    at thresholds from every entry (sets of 1) down to 0 (whole rows), ties included, with and without a row mask."""
    probs = torch.softmax(_rows(vocab, seed=5), dim=-1)
    g = torch.Generator().manual_seed(6)
    ascending = probs.sort(dim=1).values
    for quantile in (1.0, 0.9999, 0.999, 0.99, 0.9, 0.0):
        t = ascending[:, int(quantile * (vocab - 1))]  # an entry's own value: ties at t
        for use in (None, torch.rand(len(probs), generator=g) < 0.5):
            want = ((probs >= t[:, None]) & (True if use is None else use[:, None])).nonzero().unbind(1)
            got = _entries_above(probs, t, use, sparse=True)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (quantile, use)
