"""`Candidates`: per-token candidate sets (the token ids a sampler kept) in CSR form.

Row i holds `ids[offsets[i]:offsets[i + 1]]` (global vocab ids). The structure is checked on construction;
the vocab range by `validate(vocab_size)`. In a packed batch an EMPTY row means "no recorded set, unrestricted";
the log-prob ops reject empty rows, so callers drop them first (`nonempty_rows()` + `select`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Candidates:
    """CSR candidate sets: `ids` int32 [K], `offsets` int32 [N + 1] (offsets[0] = 0, non-decreasing, [-1] = K)."""

    ids: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:
        for name, t in (("ids", self.ids), ("offsets", self.offsets)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
                got = (
                    f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
                )
                raise ValueError(
                    f"Candidates.{name} is a {got}; it must be a 1-D int32 tensor (convert with .to(torch.int32))"
                )
        if self.offsets.numel() == 0:
            raise ValueError(
                "Candidates.offsets is empty; it must hold N + 1 entries (torch.zeros(1) for no rows)"
            )
        first, last = int(self.offsets[0]), int(self.offsets[-1])
        if first != 0:
            raise ValueError(f"Candidates.offsets[0] = {first}; it must be 0 (CSR offsets start at 0)")
        if last != self.ids.numel():
            raise ValueError(
                f"Candidates.offsets[-1] = {last} but len(ids) = {self.ids.numel()}; "
                "the last offset must equal the number of ids"
            )
        steps = self.offsets[1:] - self.offsets[:-1]
        if steps.numel() and bool((steps < 0).any()):
            row = int((steps < 0).nonzero()[0])
            raise ValueError(
                f"Candidates.offsets decrease at row {row} ({int(self.offsets[row])} -> "
                f"{int(self.offsets[row + 1])}); offsets must be non-decreasing (row i = ids[offsets[i]:offsets[i+1]])"
            )

    def __eq__(self, other: object) -> bool:
        """Same rows with the same ids in the same order (tensor-valued fields make the dataclass default
        ambiguous)."""
        if not isinstance(other, Candidates):
            return NotImplemented
        return torch.equal(self.offsets.cpu(), other.offsets.cpu()) and torch.equal(
            self.ids.cpu(), other.ids.cpu()
        )

    __hash__ = None  # mutable tensor contents: not hashable

    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def __len__(self) -> int:
        return self.num_rows

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]]) -> Candidates:
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        flat = [int(v) for r in rows for v in r]
        return cls(ids=torch.tensor(flat, dtype=torch.int32), offsets=offsets.to(torch.int32))

    @classmethod
    def empty(cls, num_rows: int, *, device: torch.device | str | None = None) -> Candidates:
        """`num_rows` empty (= unrestricted) rows."""
        return cls(
            ids=torch.zeros(0, dtype=torch.int32, device=device),
            offsets=torch.zeros(num_rows + 1, dtype=torch.int32, device=device),
        )

    @classmethod
    def built(cls, *, ids: torch.Tensor, offsets: torch.Tensor) -> Candidates:
        """Rows built by code that guarantees the layout (int32 ids and offsets from a cumulative sum of row
        sizes): the construction checks are skipped (three host syncs per decode step in the sampler)."""
        cands = object.__new__(cls)
        object.__setattr__(cands, "ids", ids)
        object.__setattr__(cands, "offsets", offsets)
        return cands

    def to_lists(self) -> list[list[int]]:
        ids, offsets = self.ids.tolist(), self.offsets.tolist()
        return [ids[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]

    @classmethod
    def concat(cls, parts: Sequence[Candidates]) -> Candidates:
        """Rows of all `parts`, in order."""
        if not parts:
            return cls.empty(0)
        # Each part's offsets (after its leading 0) shifted by the ids of the parts before it: valid parts make
        # a valid whole, so the construction checks are not run again (a packed batch concatenates 32 samples).
        device = parts[0].offsets.device
        rows = torch.tensor([p.num_rows for p in parts], device=device)
        shifts = torch.tensor(list(itertools.accumulate((p.ids.numel() for p in parts[:-1]), initial=0)),
                              device=device)
        tail = torch.cat([p.offsets[1:] for p in parts]).long()
        tail += shifts.repeat_interleave(rows, output_size=tail.numel())
        offsets = torch.cat([parts[0].offsets[:1], tail.to(torch.int32)])
        return cls.built(ids=torch.cat([p.ids for p in parts]), offsets=offsets)

    def validate(self, vocab_size: int) -> Candidates:
        """Raise ValueError unless every id lies in [0, vocab_size); returns self for chaining."""
        if self.ids.numel():
            lo, hi = (int(v) for v in torch.aminmax(self.ids))  # one pass over the ids
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"candidate id {bad} is outside the vocabulary [0, {vocab_size}); ids must be global token "
                    "ids of this model (check the engine's vocab size and any TP shard offset)"
                )
        return self

    def row_lengths(self) -> torch.Tensor:
        """int64 [N]: size of every row."""
        return (self.offsets[1:] - self.offsets[:-1]).long()

    def row_of_ids(self) -> torch.Tensor:
        """int64 [K]: the row each id belongs to (repeat_interleave of the row numbers by the row lengths).

        Built as a cumulative count of the row ends at or before each id (a +1 at every inner offset), which ran
        3x faster than repeat_interleave here; repeated offsets (empty rows) add up."""
        k = self.ids.numel()
        ends = torch.zeros(k + 1, dtype=torch.int64, device=self.device)
        inner = self.offsets[1:-1].long()
        ends.index_add_(0, inner, torch.ones_like(inner))
        return ends[:k].cumsum(0)

    def nonempty_rows(self) -> torch.Tensor:
        """int64 indices of the rows holding at least one id."""
        return (self.row_lengths() > 0).nonzero().flatten()

    def select(self, rows: torch.Tensor | Sequence[int]) -> Candidates:
        """Rows `rows` (int64 indices, any order, repeats allowed) as a new `Candidates`; vectorised."""
        index = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_rows):
            raise ValueError(
                f"select rows span [{int(index.min())}, {int(index.max())}] but there are {self.num_rows} rows; "
                "pass indices in [0, num_rows)"
            )
        if index.numel() == self.num_rows and bool((index == torch.arange(self.num_rows, device=self.device)).all()):
            return self  # every row in order (one rank, every row kept): nothing to copy; `Candidates` is frozen
        offsets = self.offsets.long()
        starts, lengths = offsets[index], offsets[index + 1] - offsets[index]
        new_offsets = torch.zeros(index.numel() + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(lengths, 0, out=new_offsets[1:])
        row_of = torch.repeat_interleave(torch.arange(index.numel(), device=self.device), lengths)
        within = torch.arange(int(new_offsets[-1]), device=self.device) - new_offsets[:-1][row_of]
        return Candidates(ids=self.ids[starts[row_of] + within], offsets=new_offsets.to(torch.int32))

    def __getitem__(self, rows: slice) -> Candidates:
        """A contiguous range of rows (step 1), sharing no storage with ids beyond the range."""
        if not isinstance(rows, slice):
            raise ValueError(
                f"Candidates[{rows!r}]: only slices index rows; use select() for an index tensor"
            )
        start, stop, step = rows.indices(self.num_rows)
        if step != 1:
            raise ValueError(f"Candidates slice step {step} is not 1; use select() for strided rows")
        stop = max(start, stop)
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        return Candidates(ids=self.ids[a:b], offsets=self.offsets[start : stop + 1] - a)

    def to(self, device: torch.device | str) -> Candidates:
        return Candidates(ids=self.ids.to(device), offsets=self.offsets.to(device))


def rows_missing_token(cands: Candidates, tokens: torch.Tensor) -> torch.Tensor:
    """Indices of rows i whose ids do not contain `tokens[i]` (vectorised; empty rows count as missing)."""
    offsets = cands.offsets.long()
    counts = offsets[1:] - offsets[:-1]
    row_of = torch.repeat_interleave(torch.arange(cands.num_rows), counts)
    hits = (cands.ids.long() == tokens.long()[row_of]).long()
    found = torch.zeros(cands.num_rows, dtype=torch.long).index_add_(0, row_of, hits)
    return torch.nonzero(found == 0).flatten()
