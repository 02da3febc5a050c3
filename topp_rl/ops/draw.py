"""Drawing one token per row from its kept set (the engine's per-decode-step sampler).

`sample_kept` computes the kept sets (`sglang_kept`, the rule of `sampling_candidates`) and draws by inverse
CDF over each set in rank order with float64 cumulative mass. Two draws give the same token for the same u:
`draw_from_sets` works on the sets' K values alone (large vocabularies: ~100 kept ids of 49152), `draw_dense`
on the [N, V] ranking the full sort left behind (small vocabularies, where a dozen ops on [N, V] cost less than
the set draw's two dozen on [K]). The dense draw runs on the CPU only: its proof of equality needs the
sequential CPU cumulative sum (see `draw_dense`).
"""

from __future__ import annotations

import math

import torch

from topp_rl.ops.candidates import Candidates
from topp_rl.ops.sampling import FullRanking, sglang_kept

# The dense draw handles N x V cells where the set draw handles K ids, each at a few times the cost of a cell:
# the dense one is chosen where the sets fill at least 1/8 of the matrix (measured, 1 CPU thread, N = 32: at
# V = 128 sets of 10 ids drew faster, sets of 50 and 115 slower, at V = 1024 sets of 913 3x slower).
_DENSE_DRAW_FILL = 8


def sample_kept(
    logits: torch.Tensor, scaled: torch.Tensor, u: torch.Tensor, *, temperature: float, top_p: float,
    top_k: int, min_p: float,
) -> tuple[Candidates, torch.Tensor, torch.Tensor]:
    """(kept sets, token [N], log-prob [N]): `sampling_candidates(logits, ...)` and `draw_from_sets(scaled,
    sets, u)`, with `scaled` = logits / temperature and u [N] float64 uniforms in [0, 1)."""
    cands, ranking = sglang_kept(logits, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    if ranking is not None and scaled.device.type == "cpu" and scaled.numel() <= _DENSE_DRAW_FILL * cands.ids.numel():
        return cands, *draw_dense(scaled, ranking, u)
    return cands, *draw_from_sets(scaled, cands, u)


def draw_from_sets(scaled: torch.Tensor, cands: Candidates, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], log-prob [B]) drawn per row from softmax(scaled) renormalised over the row's kept set.

    Works on the sets' K values alone, never on a [B, V] tensor (a mean set of ~100 ids against V = 49152 for
    SmolLM2): one float64 cumulative sum of exp(value - row max) over all K values, searched at (mass before
    the row) + u x (the row's mass), gives the inverse-CDF draw, and the row's mass its normaliser. Ids of
    probability 0 (underflow) add no mass, so they are never drawn (but at u -> 1 with rounding, where the
    row's last id is)."""
    rows, ids = cands.row_of_ids(), cands.ids.long()
    vals = scaled[rows, ids]  # [K]
    row_max = torch.full_like(u, -math.inf, dtype=vals.dtype).scatter_reduce_(0, rows, vals, "amax")
    mass = (vals - row_max[rows]).exp()
    cum = torch.cat([mass.new_zeros(1, dtype=torch.float64), mass.double().cumsum(0)])  # [K + 1]
    starts, ends = cands.offsets[:-1].long(), cands.offsets[1:].long()
    before = cum[starts]
    total = cum[ends] - before
    picked = torch.searchsorted(cum[1:], before + u * total, right=True)
    picked = torch.minimum(torch.maximum(picked, starts), ends - 1)  # u * mass rounding at a row's edge
    return ids[picked], vals[picked] - (row_max + total.log().float())


def draw_dense(scaled: torch.Tensor, ranking: FullRanking, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw_from_sets(scaled, the ranking's sets, u)` on the [N, V] ranking (CPU): the same token and log-prob
    for every u.

    The set draw's float64 cumulative sum runs over the kept masses of all rows in CSR order. Here the same
    masses (the same float32 exp of the same differences) sit at their ranks in a row-major [N, V] matrix with
    0 at the dropped ranks; adding 0 is exact and the CPU cumulative sum is sequential, so the flattened sum
    holds the same partial sums at every kept rank and flat ones between (so the same row masses: normalisers).
    The first rank of a row whose sum exceeds the target is then the set draw's pick, and a target at or past
    the row's end falls back to the row's last kept rank, as the set draw's clamp does (rank 0 is always kept).
    The kept ranks of a row are its first `count` on the CPU: every rule cuts a prefix of the ranking (top-k,
    min-p on p descending, and the mass before rank r, fl(c_r - p_r), is non-decreasing in r because the
    sequential cumulative sum c_r is and p_r is non-increasing)."""
    n, vocab = scaled.shape
    vals = torch.where(ranking.keep, scaled.gather(1, ranking.order), -math.inf)
    row_max = vals.amax(dim=1, keepdim=True)
    cum = (vals - row_max).exp_().double().view(-1).cumsum(0).view(n, vocab)
    ends = cum[:, -1]
    before = torch.cat([ends.new_zeros(1), ends[:-1]])
    total = ends - before
    picked = torch.searchsorted(cum, (before + u * total)[:, None], right=True)
    picked = torch.minimum(picked, ranking.count[:, None] - 1)
    log_norm = row_max.squeeze(1) + total.log().float()
    return ranking.order.gather(1, picked).squeeze(1), vals.gather(1, picked).squeeze(1) - log_norm


def inverse_cdf(cum: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index [B] of the first entry of each row's cumulative mass [B, V] above u x the row's total."""
    target = (u * cum[:, -1])[:, None]
    return torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1).squeeze(1)
