"""Input checks shared by the ops: each failure is a ValueError naming the value, the constraint and the fix."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from topp_rl.ops.candidates import Candidates

ParamT = float | int | torch.Tensor


def per_row(value: ParamT, *, name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar or [n] sampling parameter as an [n] tensor."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.dim() == 0:
        return t.expand(n)
    if t.shape != (n,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; pass a scalar or one value per row ([{n}])")
    return t


@dataclass(frozen=True)
class SamplingRule:
    """One sampling parameter's constraint, written once: `ok` works on Python numbers and on tensors."""

    name: str
    kind: type  # float or int (bools are rejected for both: `top_k=true` is a typo, not greedy)
    ok: Callable[[Any], Any]
    constraint: str
    fix: str


# Smallest temperature accepted: logits / T must stay finite in float32 for logits of a few hundred.
MIN_TEMPERATURE = 1e-6

SAMPLING_RULES: tuple[SamplingRule, ...] = (
    SamplingRule("temperature", float, lambda t: (t >= MIN_TEMPERATURE) & (t < math.inf),
                 f"finite and >= {MIN_TEMPERATURE:g} (smaller values overflow logits / temperature)",
                 "use e.g. temperature=1.0, or top_k=1 for a one-token (greedy) set"),
    SamplingRule("top_p", float, lambda t: (t > 0) & (t <= 1), "in (0, 1]", "use top_p=1.0 to disable top-p"),
    SamplingRule("top_k", int, lambda t: t >= 0, "an integer >= 0", "use top_k=0 to disable top-k"),
    SamplingRule("min_p", float, lambda t: (t >= 0) & (t < 1), "in [0, 1)", "use min_p=0.0 to disable min-p"),
)


def check_sampling_value(rule: SamplingRule, value: Any, *, key: str | None = None) -> float | int:
    """A scalar sampling parameter checked against its rule; raises ValueError naming `key` (default: the
    parameter's name), the value, the constraint and the fix. Returns the value as the rule's type."""
    label = key or rule.name
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if not numeric or (rule.kind is int and not isinstance(value, int)):
        constraint = rule.constraint if rule.kind is int else f"a number {rule.constraint}"
        raise ValueError(f"{label}={value!r} must be {constraint}; {rule.fix}")
    if not rule.ok(value):
        raise ValueError(f"{label}={value!r} must be {rule.constraint}; {rule.fix}")
    return rule.kind(value)


def check_sampling_params(
    *, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor
) -> None:
    """Per-row [n] parameters against `SAMPLING_RULES`; the error names the first offending value."""
    values = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    for rule in SAMPLING_RULES:
        t = values[rule.name]
        bad = ~rule.ok(t)
        if bool(bad.any()):
            value = t[bad.nonzero()[0]].item()
            raise ValueError(f"{rule.name}={value} must be {rule.constraint}; {rule.fix}")


def check_temperature(temperature: float) -> float:
    """The scoring temperature, checked by the same rule the sampler's is (it must be the rollout's)."""
    rule = SAMPLING_RULES[0]
    t = float(temperature)
    if not rule.ok(t):
        raise ValueError(
            f"temperature={temperature} must be {rule.constraint}; pass the rollout's sampling temperature"
        )
    return t


def check_logits_tokens(logits_rows: int, tokens: torch.Tensor, *, what: str) -> torch.Tensor:
    if tokens.dim() != 1 or tokens.numel() != logits_rows:
        raise ValueError(
            f"tokens has shape {tuple(tokens.shape)} but {what} has {logits_rows} rows; pass one token per row"
        )
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"tokens has dtype {tokens.dtype}; pass integer token ids (int64)")
    tokens = tokens.long()
    if tokens.numel() and int(tokens.min()) < 0:
        raise ValueError(f"token id {int(tokens.min())} is negative; token ids must lie in [0, vocab_size)")
    return tokens


def check_cands_rows(
    cands: Candidates | None, rows: torch.Tensor | None, *, num_rows: int, device: torch.device
) -> tuple[Candidates, torch.Tensor] | None:
    """Validated (cands on `device`, int64 rows), or None when nothing is restricted.

    `rows=None` with `cands` means row i of cands is local row i (needs cands.num_rows == num_rows).
    """
    if cands is None:
        if rows is not None and rows.numel():
            raise ValueError(f"rows ({rows.numel()} entries) given without cands; pass cands or drop rows")
        return None
    if rows is None:
        if cands.num_rows != num_rows:
            raise ValueError(
                f"cands has {cands.num_rows} rows but there are {num_rows} local rows and rows=None; "
                "pass rows (the local row of each candidate row)"
            )
        rows = torch.arange(num_rows, device=device)
    if rows.dim() != 1 or rows.numel() != cands.num_rows:
        raise ValueError(
            f"rows has shape {tuple(rows.shape)} but cands has {cands.num_rows} rows; pass one local row index "
            "per candidate row"
        )
    if rows.dtype.is_floating_point or rows.dtype == torch.bool:
        raise ValueError(f"rows has dtype {rows.dtype}; pass int64 row indices")
    if cands.num_rows == 0:
        return None
    rows = rows.to(device=device, dtype=torch.int64)
    lo, hi = int(rows.min()), int(rows.max())
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"rows holds {bad}, outside the {num_rows} local rows [0, {num_rows}); fix the row map"
        )
    if torch.unique(rows).numel() != rows.numel():
        srt = rows.sort().values
        dup = int(srt[1:][srt[1:] == srt[:-1]][0])
        raise ValueError(f"rows repeats local row {dup}; each local row may carry at most one candidate row")
    cands = cands.to(device)
    lengths = cands.row_lengths()
    if bool((lengths == 0).any()):
        empty = int((lengths == 0).nonzero()[0])
        raise ValueError(
            f"candidate row {empty} is empty; a recorded set holds at least the sampled token. Empty rows mean "
            "'unrestricted': drop them first (cands.select(cands.nonempty_rows()) and the matching rows)"
        )
    if int(cands.ids.min()) < 0:
        raise ValueError(f"candidate id {int(cands.ids.min())} is negative; ids must lie in [0, vocab_size)")
    return cands, rows


def check_vocab(*, cands: Candidates | None, tokens: torch.Tensor, vocab_size: int) -> None:
    """Ids and tokens below the (global) vocab size; called once the global size is known."""
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"token id {int(tokens.max())} is outside the vocabulary [0, {vocab_size}); check the tokenizer/model "
            "vocab sizes and vocab_start"
        )
    if cands is not None:
        cands.validate(vocab_size)


def check_finite_rows(logits: torch.Tensor, rows: torch.Tensor) -> None:
    """Rows with candidates must be finite: a row sum is non-finite iff some entry is (inf - inf = nan)."""
    if rows.numel() * 2 > logits.shape[0]:  # most rows: one streaming pass beats gathering copies
        row_sums = logits.sum(dim=-1, dtype=torch.float32)[rows]
    else:
        step = max(1, (1 << 21) // max(logits.shape[1], 1))
        row_sums = torch.cat(
            [
                logits.index_select(0, rows[a : a + step]).sum(dim=-1, dtype=torch.float32)
                for a in range(0, rows.numel(), step)
            ]
        )
    bad = ~torch.isfinite(row_sums)
    if bool(bad.any()):
        row = int(rows[bad.nonzero()[0]])
        raise ValueError(
            f"logits row {row} has candidates and holds a non-finite value (inf or nan); restricted log-probs "
            "need finite logits there (check the model output / vocab padding)"
        )
