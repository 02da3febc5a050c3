"""Which local logit rows predict response tokens, and which candidate row each of them scores.

The logit row at packed position g predicts the token at g + 1 of the same sequence, so for sample s (start o_s,
length L_s, response length R_s) the row at o_s + L_s - R_s - 1 + j predicts response token j. Candidate rows
are the response tokens of all samples concatenated in sample order, so token j of sample s is candidate row
sum(R_<s) + j. Vectorised: one searchsorted maps every local row to its sequence.
"""

from __future__ import annotations

import torch

from topp_rl.parallel.context import _check_lengths, _check_positions


def response_rows(
    positions: torch.Tensor, seq_lengths: torch.Tensor, response_lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows int64 [M], cand_rows int64 [M]): local rows predicting a response token, in local-row order, and
    the index of that token's candidate row.

    `positions` is `cp_local_positions(seq_lengths, ...)` (-1 = padding). Over all CP ranks the cand_rows
    cover [0, sum(response_lengths)) exactly once.
    """
    lengths = _check_lengths(seq_lengths)
    _check_positions(positions)
    resp = _check_response_lengths(response_lengths, lengths)
    ends = torch.cumsum(lengths, 0)
    total = int(ends[-1]) if ends.numel() else 0
    if positions.numel() and int(positions.max()) >= total:
        raise ValueError(
            f"response_rows: positions reach {int(positions.max())} but seq_lengths sum to {total}; "
            "build positions from the same seq_lengths"
        )
    pos = positions.to(lengths.device)
    seq = torch.searchsorted(ends, pos, right=True)  # padding (-1) maps to 0 and is masked below
    # j: index of the response token this row predicts (negative for prompt rows).
    j = pos - (ends - resp)[seq] + 1
    keep = (pos >= 0) & (j >= 0) & (j < resp[seq])
    rows = keep.nonzero().squeeze(1)
    resp_starts = torch.cumsum(resp, 0) - resp
    cand_rows = resp_starts[seq[rows]] + j[rows]
    return rows, cand_rows


def _check_response_lengths(response_lengths: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    if (
        not isinstance(response_lengths, torch.Tensor)
        or response_lengths.is_floating_point()
        or response_lengths.shape != lengths.shape
    ):
        raise ValueError(
            f"response_lengths must be an integer tensor shaped like seq_lengths {tuple(lengths.shape)}, got "
            f"{tuple(getattr(response_lengths, 'shape', ()))}; pass one response length per sequence"
        )
    resp = response_lengths.to(torch.int64)
    bad = (resp < 0) | ((resp > 0) & (resp >= lengths))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"response_lengths[{i}]={int(resp[i])} with seq_lengths[{i}]={int(lengths[i])}: a response length "
            "must be in [0, seq_length - 1] (the first response token is predicted by a prompt row); "
            "each sequence needs at least one prompt token"
        )
    return resp
