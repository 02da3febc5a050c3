"""Candidates: CSR round-trips, concat/select/slice helpers and structural validation."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from topp_rl.ops import Candidates

ROWS = st.lists(st.lists(st.integers(0, 999), max_size=6), max_size=8)


@settings(max_examples=40, deadline=None)
@given(rows=ROWS)
def test_from_lists_round_trip(rows):
    c = Candidates.from_lists(rows)
    assert c.ids.dtype == torch.int32 and c.offsets.dtype == torch.int32
    assert c.num_rows == len(rows) == len(c)
    assert c.to_lists() == rows
    assert c == Candidates.from_lists(rows) and c != Candidates.from_lists(rows + [[1]])
    assert c.row_lengths().tolist() == [len(r) for r in rows]
    assert c.row_of_ids().tolist() == [i for i, r in enumerate(rows) for _ in r]
    assert c.nonempty_rows().tolist() == [i for i, r in enumerate(rows) if r]


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(ROWS, max_size=4))
def test_concat_is_list_concat(parts):
    merged = Candidates.concat([Candidates.from_lists(p) for p in parts])
    assert merged.to_lists() == [r for p in parts for r in p]
    Candidates(ids=merged.ids, offsets=merged.offsets)  # built unchecked: the construction checks pass
    if parts:  # parts that are slices of a larger set (offsets rebased to 0) concatenate alike
        whole = Candidates.from_lists([r for p in parts for r in p])
        bounds = list(itertools.accumulate(map(len, parts), initial=0))
        sliced = Candidates.concat([whole[a:b] for a, b in itertools.pairwise(bounds)])
        assert sliced == whole


@settings(max_examples=40, deadline=None)
@given(rows=ROWS, data=st.data())
def test_select_and_slice(rows, data):
    c = Candidates.from_lists(rows)
    if rows:
        index = data.draw(st.lists(st.integers(0, len(rows) - 1), max_size=10))
        assert c.select(torch.tensor(index, dtype=torch.int64)).to_lists() == [rows[i] for i in index]
    a = data.draw(st.integers(0, len(rows)))
    b = data.draw(st.integers(0, len(rows)))
    assert c[a:b].to_lists() == rows[a:b]
    assert c[a:].to_lists() == rows[a:]


def test_select_drops_empty_rows_for_the_ops():
    c = Candidates.from_lists([[3, 1], [], [7], []])
    keep = c.nonempty_rows()
    assert keep.tolist() == [0, 2]
    assert c.select(keep).to_lists() == [[3, 1], [7]]
    assert Candidates.empty(3).to_lists() == [[], [], []]
    assert Candidates.concat([]).num_rows == 0


def test_select_of_every_row_in_order_is_the_same_rows_without_a_copy():
    c = Candidates.from_lists([[3, 1], [], [7]])
    assert c.select(torch.arange(3)) is c
    assert c.select([0, 1, 2]) is c
    assert c.select(torch.tensor([0, 2, 1])).to_lists() == [[3, 1], [7], []]  # same rows, another order: a copy
    assert c.select(torch.tensor([0, 1])).to_lists() == [[3, 1], []]


@pytest.mark.parametrize(
    ("ids", "offsets", "message"),
    [
        ([1, 2], [1, 2], r"offsets\[0\] = 1; it must be 0"),
        ([1, 2, 3], [0, 2, 1, 3], "decrease at row 1"),
        ([1, 2, 3], [0, 2], r"offsets\[-1\] = 2 but len\(ids\) = 3"),
        ([1], [], "offsets is empty"),
    ],
)
def test_structure_errors(ids, offsets, message):
    with pytest.raises(ValueError, match=message):
        Candidates(ids=torch.tensor(ids, dtype=torch.int32), offsets=torch.tensor(offsets, dtype=torch.int32))


def test_dtype_and_range_errors():
    with pytest.raises(ValueError, match="int32"):
        Candidates(ids=torch.tensor([1], dtype=torch.int64), offsets=torch.tensor([0, 1], dtype=torch.int32))
    c = Candidates.from_lists([[0, 9], [10]])
    assert c.validate(11) is c
    with pytest.raises(ValueError, match=r"candidate id 10 is outside the vocabulary \[0, 10\)"):
        c.validate(10)
    with pytest.raises(ValueError, match="candidate id -1"):
        Candidates.from_lists([[-1]]).validate(5)
    with pytest.raises(ValueError, match="select rows span"):
        c.select(torch.tensor([2]))
    with pytest.raises(ValueError, match="step 2"):
        c[::2]
