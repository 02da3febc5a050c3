"""`keep_mask`: the dense bool keep-mask of candidate sets over one vocab shard, built without a Python loop.

Dense meaning: mask[rows[j], v - vocab_start] = True iff v in cands(j) (or v = tokens[rows[j]] when `tokens` is
given), for v in [vocab_start, vocab_end); rows not listed in `rows` stay all True (unrestricted). Built with one
fill of the output and one scatter of all candidate ids (repeat_interleave gives each id its row). The ops in
`token_logprobs` / `candidate_head_logprobs` never need this mask; it is for dense reference paths and tools.
"""

from __future__ import annotations

import torch

from topp_rl.ops._checks import check_cands_rows
from topp_rl.ops.candidates import Candidates


def keep_mask(
    cands: Candidates,
    rows: torch.Tensor,
    *,
    num_rows: int,
    vocab_start: int,
    vocab_end: int,
    tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [num_rows, vocab_end - vocab_start]: True = kept. `rows` [cands.num_rows] are local row indices."""
    width = vocab_end - vocab_start
    if width <= 0 or vocab_start < 0:
        raise ValueError(
            f"vocab range [{vocab_start}, {vocab_end}) is empty or negative; pass this shard's "
            "vocab_start >= 0 and vocab_end > vocab_start"
        )
    if num_rows < 0:
        raise ValueError(f"num_rows={num_rows} must be >= 0")
    device = rows.device if rows is not None else cands.device
    checked = check_cands_rows(cands, rows, num_rows=num_rows, device=device)
    if tokens is not None and (tokens.dim() != 1 or tokens.numel() != num_rows):
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}; pass one token per row ([{num_rows}])")
    if checked is None:
        return torch.ones(num_rows, width, dtype=torch.bool, device=device)
    cands, rows = checked
    listed = torch.zeros(num_rows, dtype=torch.bool, device=device)
    listed[rows] = True
    if bool(listed.all()):
        mask = torch.zeros(num_rows, width, dtype=torch.bool, device=device)
    else:  # one pass: every row written once, True where unrestricted
        mask = torch.empty(num_rows, width, dtype=torch.bool, device=device)
        mask.copy_((~listed)[:, None].expand(num_rows, width))
    local = cands.ids.long() - vocab_start
    row = rows[cands.row_of_ids()]
    if tokens is not None:
        local = torch.cat([local, tokens.to(device).long()[rows] - vocab_start])
        row = torch.cat([row, rows])
    inside = (local >= 0) & (local < width)
    mask.view(-1)[row[inside] * width + local[inside]] = True
    return mask
