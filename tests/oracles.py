"""Plain reference implementations the tests (and the rollout benchmark's baseline) compare the library with."""

import torch


def sglang_keep_mask(scaled: torch.Tensor, *, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """Dense keep mask [N, V] of SGLang's truncation rule by one full sort.

    p = softmax(scaled); rank by p descending (ties: lower id first); keep rank r iff (top_k == 0 or r < top_k)
    and (mass of ranks before r) <= top_p and p_r >= min_p * p_max.
    """
    probs = scaled.softmax(-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p
    keep_sorted = before <= top_p
    if top_k > 0:
        keep_sorted[:, top_k:] = False
    if min_p > 0:
        keep_sorted &= sorted_p >= min_p * sorted_p[:, :1]
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
