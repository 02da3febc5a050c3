"""Rollout correction: reweight or mask tokens by the gap between the old-log-prob pass and the engine.

Both use rho = exp(old - rollout), the importance ratio of the trainer's old policy over the engine's sampler,
and both act as a stop-gradient per-token multiplier on the policy-gradient term (not on the KL term):
- `TIS` (truncated importance sampling): weight min(rho, cap).
- `IcePop`: weight 1 where low <= rho <= high, else 0 (the token is dropped, but still counts in the global
  denominator, so micro-batching stays exact and the dropped share is visible as a metric).
"""

import torch
from torch import Tensor

from topp_rl.losses.inputs import LossInputs

Pairs = dict[str, tuple[Tensor, Tensor]]


def _rollout_ratio(inputs: LossInputs, *, option: str) -> Tensor:
    if inputs.rollout_logprobs is None:
        raise ValueError(
            f"{option} needs LossInputs.rollout_logprobs; record rollout log-probs in the engine or disable {option}"
        )
    return torch.exp(inputs.old_logprobs.detach() - inputs.rollout_logprobs)


class TIS:
    """Truncated IS weight min(exp(old - rollout), cap) per token [R], no gradient."""

    def __init__(self, *, cap: float) -> None:
        if not cap > 0:
            raise ValueError(f"tis_cap={cap} must be > 0 (typical: 2.0); use null to disable TIS")
        self.cap = cap

    def __call__(self, inputs: LossInputs) -> tuple[Tensor, Pairs]:
        rho = _rollout_ratio(inputs, option="tis_cap")
        weight = rho.clamp(max=self.cap)
        m = inputs.loss_mask
        n = m.sum()
        return weight, {
            "train/tis_weight_mean": ((weight * m).sum(), n),
            "train/tis_clipped_frac": (((rho > self.cap).float() * m).sum(), n),
        }


class IcePop:
    """0/1 weight per token [R]: 1 where low <= exp(old - rollout) <= high."""

    def __init__(self, *, low: float, high: float) -> None:
        if not 0 <= low <= 1 <= high:
            raise ValueError(
                f"icepop bounds low={low}, high={high} must satisfy 0 <= low <= 1 <= high (typical: 0.5, 2.0)"
            )
        self.low = low
        self.high = high

    def __call__(self, inputs: LossInputs) -> tuple[Tensor, Pairs]:
        rho = _rollout_ratio(inputs, option="icepop")
        keep = ((rho >= self.low) & (rho <= self.high)).to(inputs.loss_mask.dtype)
        m = inputs.loss_mask
        return keep, {"train/icepop_masked_frac": (((1 - keep) * m).sum(), m.sum())}
