"""Wire format for candidate sets: round trips, every accepted input form, and every strict error."""

import numpy as np
import pybase64
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from topp_rl.engines.serving.wire import (
    IDS_KEY,
    OFFSETS_KEY,
    decode_candidates,
    encode_candidates,
    merge_encoded,
)
from topp_rl.ops import Candidates

ROWS = [[5, 3], [7], [1, 2, 9]]
TOKENS = [3, 7, 9]


def _b64(values: list[int]) -> str:
    return pybase64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode()


def test_round_trip_and_documented_layout():
    meta = encode_candidates(Candidates.from_lists(ROWS))
    assert set(meta) == {IDS_KEY, OFFSETS_KEY}
    assert meta[IDS_KEY] == _b64([5, 3, 7, 1, 2, 9])
    assert meta[OFFSETS_KEY] == _b64([0, 2, 3, 6])
    out = decode_candidates(meta, num_tokens=3, vocab_size=10, tokens=TOKENS)
    assert out.to_lists() == ROWS
    assert out.ids.dtype == torch.int32 and out.offsets.dtype == torch.int32


@pytest.mark.parametrize(
    "meta",
    [
        {"candidate_ids": np.asarray([5, 3, 7, 1, 2, 9], "<i4").tobytes(), "candidate_offsets": [0, 2, 3, 6]},
        {IDS_KEY: [5, 3, 7, 1, 2, 9], OFFSETS_KEY: (0, 2, 3, 6)},
        {"output_token_sampling_mask": ROWS},
    ],
    ids=["raw-bytes", "lists", "sglang-nested"],
)
def test_accepted_forms(meta):
    assert decode_candidates(meta, num_tokens=3, vocab_size=10, tokens=TOKENS).to_lists() == ROWS


def test_no_candidate_data_is_none():
    assert decode_candidates({"output_token_logprobs": []}, num_tokens=3) is None
    assert decode_candidates({"output_token_sampling_mask": None}, num_tokens=3) is None


@pytest.mark.parametrize(
    ("meta", "kwargs", "message"),
    [
        ({IDS_KEY: _b64([1])}, {}, "not 'candidate_offsets_b64'"),
        ({OFFSETS_KEY: _b64([0, 1])}, {}, "not 'candidate_ids_b64'"),
        ({IDS_KEY: _b64([1, 2]), OFFSETS_KEY: _b64([1, 2])}, {"num_tokens": 1}, "start at 0"),
        ({IDS_KEY: _b64([1, 2]), OFFSETS_KEY: _b64([0, 2, 1, 2])}, {"num_tokens": 3}, "decrease at row 1"),
        ({IDS_KEY: _b64([1, 2]), OFFSETS_KEY: _b64([0, 1])}, {"num_tokens": 1}, "last candidate offset 1"),
        ({IDS_KEY: _b64([1, 2]), OFFSETS_KEY: _b64([0, 2])}, {"num_tokens": 2}, "2 entries but 2 tokens"),
        (
            {IDS_KEY: _b64([1, 12]), OFFSETS_KEY: _b64([0, 2])},
            {"vocab_size": 10},
            "candidate id 12 is outside",
        ),
        ({IDS_KEY: _b64([-1]), OFFSETS_KEY: _b64([0, 1])}, {"vocab_size": 10}, "candidate id -1 is outside"),
        (
            {IDS_KEY: _b64([1, 2]), OFFSETS_KEY: _b64([0, 2])},
            {"tokens": [4]},
            "sampled token 4 at response position 0",
        ),
        ({IDS_KEY: "%%not base64%%", OFFSETS_KEY: _b64([0])}, {"num_tokens": 0}, "malformed base64"),
        ({IDS_KEY: "AAA=", OFFSETS_KEY: _b64([0])}, {"num_tokens": 0}, "not a multiple of 4"),
    ],
)
def test_strict_errors(meta, kwargs, message):
    kwargs = {"num_tokens": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        decode_candidates(meta, **kwargs)


def test_merge_shifts_offsets():
    turn1 = encode_candidates(Candidates.from_lists([[4, 1], [2]]))
    turn2 = encode_candidates(Candidates.from_lists([[8], [0, 3, 6]]))
    merged = merge_encoded([turn1, turn2])
    assert merged[OFFSETS_KEY] == _b64([0, 2, 3, 4, 7])
    assert decode_candidates(merged, num_tokens=4).to_lists() == [[4, 1], [2], [8], [0, 3, 6]]


def test_merge_rejects_broken_part():
    broken = {IDS_KEY: _b64([1]), OFFSETS_KEY: _b64([0, 2])}
    with pytest.raises(ValueError, match="part 1: last candidate offset 2"):
        merge_encoded([encode_candidates(Candidates.from_lists([[1]])), broken])


@given(
    rows=st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6), max_size=12),
    form=st.sampled_from(["b64", "bytes", "lists", "nested"]),
)
@settings(max_examples=60, deadline=None)
def test_round_trip_any_rows(rows, form):
    cands = Candidates.from_lists(rows)
    meta = encode_candidates(cands)
    if form == "bytes":
        meta = {k: pybase64.b64decode(v) for k, v in meta.items()}
    elif form == "lists":
        meta = {IDS_KEY: cands.ids.tolist(), OFFSETS_KEY: cands.offsets.tolist()}
    elif form == "nested":
        meta = {"output_token_sampling_mask": rows}
    assert decode_candidates(meta, num_tokens=len(rows)).to_lists() == rows
