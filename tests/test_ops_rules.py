"""Part 2 rules: every bad input raises ValueError naming the value, the constraint and the fix, in both ops."""

import pytest
import torch

from topp_rl.ops import Candidates, candidate_head_logprobs, keep_mask, token_logprobs

T, V, H = 4, 6, 3


def _via_logits(cands, rows, *, tokens=None, temperature=1.0, logits=None, **kw):
    logits = torch.randn(T, V) if logits is None else logits
    tokens = torch.tensor([0, 1, 2, 3]) if tokens is None else tokens
    return token_logprobs(logits, tokens, cands=cands, rows=rows, temperature=temperature, **kw)


def _via_head(cands, rows, *, tokens=None, temperature=1.0, **kw):
    tokens = torch.tensor([0, 1, 2, 3]) if tokens is None else tokens
    return candidate_head_logprobs(
        torch.randn(T, H), torch.randn(V, H), tokens, cands=cands, rows=rows, temperature=temperature, **kw
    )


def _via_mask(cands, rows, *, tokens=None):  # keep_mask has no temperature / vocab_start rules
    tokens = torch.tensor([0, 1, 2, 3]) if tokens is None else tokens
    return keep_mask(cands, rows, num_rows=T, vocab_start=0, vocab_end=V, tokens=tokens)


OPS = [_via_logits, _via_head, _via_mask]
ONE = Candidates.from_lists([[1, 2]])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((ONE, torch.tensor([4])), {}, r"rows holds 4, outside the 4 local rows \[0, 4\)"),
        ((ONE, torch.tensor([-1])), {}, "rows holds -1, outside"),
        ((Candidates.from_lists([[1], [2]]), torch.tensor([1, 1])), {}, "rows repeats local row 1"),
        (
            (Candidates.from_lists([[1], []]), torch.tensor([0, 1])),
            {},
            "candidate row 1 is empty.*nonempty_rows",
        ),
        ((ONE, torch.tensor([0, 1])), {}, r"rows has shape \(2,\) but cands has 1 rows"),
        ((ONE, None), {}, "cands has 1 rows but there are 4 local rows and rows=None"),
        ((None, torch.tensor([0])), {}, "rows .* given without cands"),
        (
            (
                Candidates(
                    ids=torch.tensor([-2], dtype=torch.int32), offsets=torch.tensor([0, 1], dtype=torch.int32)
                ),
                torch.tensor([0]),
            ),
            {},
            "candidate id -2 is negative",
        ),
        ((ONE, torch.tensor([0.0])), {}, "rows has dtype torch.float32"),
        ((ONE, torch.tensor([0])), {"tokens": torch.tensor([0, 1])}, "tokens has shape"),
    ],
)
def test_bad_rows_and_candidates(op, args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        op(*args, **kwargs)


@pytest.mark.parametrize("op", [_via_logits, _via_head])
@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (
            (Candidates.from_lists([[1, 6]]), torch.tensor([0])),
            {},
            r"candidate id 6 is outside the vocabulary \[0, 6\)",
        ),
        (
            (ONE, torch.tensor([0])),
            {"tokens": torch.tensor([0, 1, 9, 3])},
            r"token id 9 is outside the vocabulary",
        ),
        ((ONE, torch.tensor([0])), {"tokens": torch.tensor([0, -1, 2, 3])}, "token id -1 is negative"),
        (
            (ONE, torch.tensor([0])),
            {"tokens": torch.tensor([0.0, 1, 2, 3])},
            "tokens has dtype torch.float32",
        ),
        ((ONE, torch.tensor([0])), {"temperature": 0.0}, "temperature=0.0 must be finite and >= 1e-06"),
        ((ONE, torch.tensor([0])), {"temperature": -1.0}, "temperature=-1.0 must be finite and >= 1e-06"),
        ((ONE, torch.tensor([0])), {"vocab_start": 6}, "vocab_start=6 without a tp_group"),
    ],
)
def test_bad_tokens_ids_and_parameters(op, args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        op(*args, **kwargs)


def test_nonfinite_logits_only_matter_in_rows_with_candidates():
    logits = torch.randn(T, V)
    logits[2, 5] = float("inf")
    with pytest.raises(ValueError, match="logits row 2 has candidates and holds a non-finite value"):
        _via_logits(ONE, torch.tensor([2]), logits=logits)
    logits[2, 5] = float("nan")
    with pytest.raises(ValueError, match="logits row 2 has candidates"):
        _via_logits(ONE, torch.tensor([2]), logits=logits)
    logits[2, 5] = float("-inf")
    with pytest.raises(ValueError, match="logits row 2 has candidates"):
        _via_logits(ONE, torch.tensor([2]), logits=logits)
    out = _via_logits(ONE, torch.tensor([0]), logits=logits)  # row 2 is unrestricted: no error
    assert torch.isfinite(out[[0, 1, 3]]).all()


def test_logits_must_be_2d():
    with pytest.raises(ValueError, match=r"logits has shape \(6,\)"):
        token_logprobs(torch.randn(6), torch.tensor([0]))
