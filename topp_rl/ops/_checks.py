"""Input checks shared by the ops: each failure is a ValueError naming the value, the constraint and the fix."""

from __future__ import annotations

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


def check_sampling_params(
    *, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor
) -> None:
    def first_bad(t: torch.Tensor, bad: torch.Tensor) -> float:
        return t[bad.nonzero()[0]].item()

    if bool((bad := ~(temperature > 0)).any()):
        raise ValueError(
            f"temperature={first_bad(temperature, bad)} must be > 0; greedy decoding has no candidate set "
            "(use top_k=1 for a one-token set)"
        )
    if bool((bad := ~((top_p > 0) & (top_p <= 1))).any()):
        raise ValueError(f"top_p={first_bad(top_p, bad)} must lie in (0, 1]; use 1.0 to disable top-p")
    if bool((bad := top_k < 0).any()):
        raise ValueError(f"top_k={first_bad(top_k, bad)} must be >= 0; use 0 to disable top-k")
    if bool((bad := ~((min_p >= 0) & (min_p < 1))).any()):
        raise ValueError(f"min_p={first_bad(min_p, bad)} must lie in [0, 1); use 0.0 to disable min-p")


def check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not t > 0 or t == float("inf"):
        raise ValueError(
            f"temperature={temperature} must be finite and > 0; pass the rollout's sampling temperature"
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
