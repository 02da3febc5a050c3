"""The five RL losses as `PolicyLoss` subclasses; each differs only in its per-token policy term.

r = exp(log pi - log pi_old) per token, A the advantage, [.]_c = clamp(., 1 - eps_clip, 1 + eps_clip_high),
sg = stop-gradient. Per-token terms (masked and aggregated by `PolicyLoss`):
- GRPOLoss:        max(-A r, -A [r]_c)                               (PPO clip, DAPO's asymmetric bounds)
- DrGRPOLoss:      same term, seq-mean-token-sum aggregation          (Dr. GRPO)
- GSPOLoss:        max(-A s, -A [s]_c), s = exp(mean_{t in seq} log r) (GSPO, sequence-level ratio)
- CISPOLoss:       -sg([r]_c) A log pi                                (CISPO: clipped tokens keep gradient)
- ReinforcePPLoss: the PPO term with A + shaped KL return              (REINFORCE++)
Departures: Dr. GRPO divides the token sum by a constant (the generation budget); here it is divided by the
global sequence count only (a constant factor, which Adam absorbs). The advantage normalisation of each
algorithm (group std for GRPO, none for Dr. GRPO, global batch for REINFORCE++) lives in the datamodule's
advantage config, not here.
"""

import warnings

import torch
from torch import Tensor

from topp_rl.losses.base import PolicyLoss
from topp_rl.losses.correction import Pairs
from topp_rl.losses.inputs import LossInputs


def clipped_surrogate(ratio: Tensor, advantages: Tensor, *, low: float, high: float) -> tuple[Tensor, Tensor]:
    """PPO term max(-A r, -A clamp(r, low, high)) [R] and where the clipped branch is active [R] bool."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(low, high)
    active = clipped > unclipped
    # where(), not maximum(): same values and gradient (ties take the unclipped branch, whose gradient equals
    # the clamp's inside the range), and a much cheaper backward on CPU.
    return torch.where(active, clipped, unclipped), active


def _ratio_pairs(ratio: Tensor, clipped: Tensor, inputs: LossInputs) -> Pairs:
    m = inputs.loss_mask
    n = m.sum()
    return {
        "train/clip_frac": ((clipped.to(m.dtype) * m).sum(), n),
        "train/ratio_mean": ((ratio.detach() * m).sum(), n),
    }


class GRPOLoss(PolicyLoss):
    """PPO-clip on token ratios (GRPO / DAPO); `eps_clip_high` > `eps_clip` gives DAPO's clip-higher."""

    def policy_term(self, inputs: LossInputs, *, advantages: Tensor) -> tuple[Tensor, Pairs]:
        ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
        term, clipped = clipped_surrogate(
            ratio, advantages, low=1 - self.eps_clip, high=1 + self.eps_clip_high
        )
        return term, _ratio_pairs(ratio, clipped, inputs)


class DrGRPOLoss(GRPOLoss):
    """GRPO's term with token-sum aggregation (pair with the no-std advantage config)."""

    default_aggregation = "seq-mean-token-sum"


class GSPOLoss(PolicyLoss):
    """Sequence-level ratio s = exp(mean masked log r over the sample), clipped; gradient reaches every token
    of the sample through the mean. Default bounds are the GSPO paper's (3e-4, 4e-4)."""

    default_aggregation = "seq-mean-token-mean"

    def __init__(self, *, eps_clip: float = 3e-4, eps_clip_high: float | None = 4e-4, **kwargs) -> None:
        super().__init__(eps_clip=eps_clip, eps_clip_high=eps_clip_high, **kwargs)

    def policy_term(self, inputs: LossInputs, *, advantages: Tensor) -> tuple[Tensor, Pairs]:
        m = inputs.loss_mask
        log_ratio_sum = inputs.segment_sum((inputs.logprobs - inputs.old_logprobs) * m)
        seq_ratio = torch.exp(log_ratio_sum / inputs.segment_sum(m).clamp(min=1.0))
        ratio = seq_ratio[inputs.segments[0]]
        term, clipped = clipped_surrogate(
            ratio, advantages, low=1 - self.eps_clip, high=1 + self.eps_clip_high
        )
        return term, _ratio_pairs(ratio, clipped, inputs)


class CISPOLoss(PolicyLoss):
    """-sg(clamp(r, 1 - eps_clip, 1 + eps_clip_high)) * A * log pi per token.

    Canonical CISPO is one-sided: eps_clip >= 1 (no lower bound, the default), only eps_clip_high bounds r.
    """

    def __init__(self, *, eps_clip: float = 1.0, eps_clip_high: float | None = 4.0, **kwargs) -> None:
        if eps_clip < 1.0:
            warnings.warn(
                f"CISPOLoss eps_clip={eps_clip} < 1.0 clips the IS weight from below; canonical CISPO is "
                "one-sided (eps_clip >= 1.0), tune eps_clip_high instead",
                stacklevel=2,
            )
        super().__init__(eps_clip=eps_clip, eps_clip_high=eps_clip_high, **kwargs)

    def policy_term(self, inputs: LossInputs, *, advantages: Tensor) -> tuple[Tensor, Pairs]:
        ratio = torch.exp(inputs.logprobs - inputs.old_logprobs).detach()
        low, high = max(1 - self.eps_clip, 0.0), 1 + self.eps_clip_high
        weight = ratio.clamp(low, high)
        clipped = (ratio < low) | (ratio > high)
        return -advantages * weight * inputs.logprobs, _ratio_pairs(ratio, clipped, inputs)


class ReinforcePPLoss(GRPOLoss):
    """REINFORCE++: PPO-clip with the KL penalty moved from the loss into the reward.

    Per token the reward gets -kl_coef * KL_t (KL_t from the configured estimator on the old and reference
    log-probs, no gradient), summed to the end of the sample (gamma = 1) and added to the datamodule's
    advantage, which holds the globally batch-normalised outcome reward.
    Departure from the paper: the paper normalises the whole return (outcome + KL) over the global batch; here
    only the outcome part is normalised (by the datamodule, before packing) and the KL return is added raw,
    because normalising it needs every rank's tokens before the loss and the KL part is small (kl_coef ~1e-3).
    """

    kl_in_loss = False

    def shaped_advantages(self, inputs: LossInputs) -> tuple[Tensor, Pairs]:
        if not self.kl.enabled:
            return inputs.advantages, {}
        m = inputs.loss_mask
        kl_tok = self.kl.per_token(inputs, logprobs=inputs.old_logprobs.detach()).detach() * m
        returns = reverse_segment_cumsum(kl_tok, inputs)
        pairs = {"train/kl_ref": (kl_tok.sum(), m.sum())}
        return inputs.advantages - self.kl.coef * returns, pairs


def reverse_segment_cumsum(values: Tensor, inputs: LossInputs) -> Tensor:
    """G_t = sum of values [R] from token t to the end of t's sample (samples contiguous), in float64."""
    ids, _ = inputs.segments
    x = values.double()
    upto = torch.cumsum(x, 0)
    seg_end = torch.cumsum(inputs.segment_sum(x), 0)
    return (seg_end[ids] - upto + x).to(values.dtype)
