"""`gather_tokens`: one rollout's per-token values from the context-parallel ranks that each hold some tokens."""

import torch
import torch.distributed as dist


def gather_tokens(values: torch.Tensor, token_index: torch.Tensor, *, num_tokens: int, group) -> torch.Tensor:
    """[R] in sample order from this rank's values [R_local] at `token_index` (CP ranks hold disjoint tokens).

    Other CP ranks' tokens arrive through an all_reduce of a detached copy, so gradient flows only into this
    rank's own tokens: each CP rank computes the same whole-sequence loss, and its parameter gradient covers
    its own rows; summing gradients over CP (not averaging) gives the full gradient.
    """
    full = values.new_zeros(num_tokens).index_put((token_index,), values)
    if group is None:
        return full
    others = full.detach().clone()
    dist.all_reduce(others, group=group)
    return full + (others - full.detach())
