"""`PolicyLoss`: the skeleton every RL loss shares; subclasses supply only the per-token policy term.

loss = aggregate(policy_term * correction weights) + kl_coef * aggregate(KL(pi || pi_ref))
       - entropy_coeff * aggregate(H)
The policy term's advantage is the algorithm's plus teacher_kl_coef times the teacher's per-token reverse-KL
advantage (`topp_rl.losses.distill`), so the teacher term is importance-weighted and clipped like the reward's.
The corrections (TIS, ICEPOP) scale only the policy term; the KL term (when the algorithm keeps it in the loss)
and the entropy bonus are aggregated the same way. H is the entropy of the full-vocabulary, temperature-scaled
policy per token (`LossInputs.entropy`), not of the sampler's kept set: a bonus is there to keep the policy from
collapsing, and the kept-set entropy cannot see a collapse (when the kept set shrinks to one token it is 0, with no
gradient to widen it), while the full one still pushes mass back to the tokens a truncating sampler cut off.
Metrics are (sum, count) pairs: per-token figures count loss tokens; the loss values count this micro-batch's
share of the global denominator, so the reduced `train/loss` is the whole-step loss however the step was split.
"""

import math
from abc import ABC, abstractmethod

import torch
from torch import Tensor

from topp_rl.losses.aggregate import aggregate, check_aggregation, denominator_share
from topp_rl.losses.correction import TIS, IcePop, Pairs
from topp_rl.losses.inputs import LossInputs
from topp_rl.losses.kl import KLPenalty
from topp_rl.losses.teacher import TeacherKL


def to_floats(pairs: Pairs) -> dict[str, tuple[float, float]]:
    """(sum, count) tensors -> floats with one device sync."""
    if not pairs:
        return {}
    flat = torch.stack(
        [
            torch.stack([s.detach().double(), torch.as_tensor(c, device=s.device).double()])
            for s, c in pairs.values()
        ]
    )
    return {name: (s, c) for name, (s, c) in zip(pairs, flat.tolist(), strict=True)}


class PolicyLoss(ABC):
    """Base class: `__call__(inputs: LossInputs) -> (loss [], metrics)`; subclasses implement `policy_term`."""

    default_aggregation = "token-mean"
    kl_in_loss = True

    def __init__(
        self,
        *,
        eps_clip: float = 0.2,
        eps_clip_high: float | None = None,
        aggregation: str | None = None,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        kl_use_candidate_mask: bool = True,
        tis_cap: float | None = None,
        icepop_low: float | None = None,
        icepop_high: float | None = None,
        entropy_coeff: float = 0.0,
        teacher_kl_coef: float = 0.0,
    ) -> None:
        self.eps_clip = eps_clip
        self.eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
        if not (self.eps_clip > 0 and self.eps_clip_high > 0):
            raise ValueError(
                f"eps_clip={eps_clip} and eps_clip_high={eps_clip_high} must be > 0 (typical: 0.2 and 0.28)"
            )
        self.aggregation = check_aggregation(aggregation or self.default_aggregation)
        self.kl = KLPenalty(coef=kl_coef, estimator=kl_estimator, use_candidate_mask=kl_use_candidate_mask)
        if (icepop_low is None) != (icepop_high is None):
            raise ValueError(
                f"icepop_low={icepop_low} and icepop_high={icepop_high}: set both to enable ICEPOP, or neither"
            )
        if not (math.isfinite(entropy_coeff) and entropy_coeff >= 0):
            raise ValueError(f"entropy_coeff={entropy_coeff} must be a finite number >= 0 (algo.entropy_coeff; 0: off)")
        self.entropy_coeff = float(entropy_coeff)
        self.teacher = TeacherKL(coef=teacher_kl_coef)
        self.corrections = [TIS(cap=tis_cap)] if tis_cap is not None else []
        if icepop_low is not None:
            self.corrections.append(IcePop(low=icepop_low, high=icepop_high))

    @property
    def kl_use_candidate_mask(self) -> bool:
        """Whether the module should score the reference model over the recorded candidate set."""
        return self.kl.use_candidate_mask

    @property
    def needs_ref_logprobs(self) -> bool:
        return self.kl.enabled

    @property
    def needs_entropy(self) -> bool:
        """Whether the gradient pass must compute each token's full-vocabulary entropy (the entropy bonus)."""
        return self.entropy_coeff > 0

    @property
    def needs_teacher_logprobs(self) -> bool:
        return self.teacher.enabled

    @property
    def corrects_staleness(self) -> bool:
        """Whether the loss reweights or masks tokens by the ratio to the rollout policy (TIS / ICEPOP): what
        training on samples of an older policy (`rollout.overlap`) needs."""
        return bool(self.corrections)

    @abstractmethod
    def policy_term(self, inputs: LossInputs, *, advantages: Tensor) -> tuple[Tensor, Pairs]:
        """Per-token policy loss [R] (before mask and aggregation) and its metrics."""

    def shaped_advantages(self, inputs: LossInputs) -> tuple[Tensor, Pairs]:
        """Advantages [R] the policy term uses; the datamodule's by default."""
        return inputs.advantages, {}

    def __call__(self, inputs: LossInputs) -> tuple[Tensor, dict[str, tuple[float, float]]]:
        advantages, pairs = self.shaped_advantages(inputs)
        advantages, teacher_pairs = self.teacher.shaped(inputs, advantages)  # + the teacher's reverse KL, if on
        pairs.update(teacher_pairs)
        term, term_pairs = self.policy_term(inputs, advantages=advantages)
        pairs.update(term_pairs)
        for correction in self.corrections:
            weight, corr_pairs = correction(inputs)
            term = term * weight
            pairs.update(corr_pairs)
        pg_loss = aggregate(term, inputs, mode=self.aggregation)
        loss = pg_loss
        share = denominator_share(inputs, mode=self.aggregation)
        if self.kl.enabled and self.kl_in_loss:
            kl_tok = self.kl.per_token(inputs, logprobs=inputs.logprobs)
            kl_loss = aggregate(kl_tok, inputs, mode=self.aggregation)
            loss = loss + self.kl.coef * kl_loss
            pairs["train/kl_ref"] = ((kl_tok.detach() * inputs.loss_mask).sum(), inputs.loss_mask.sum())
            pairs["train/kl_loss"] = (kl_loss.detach(), share)
        if self.needs_entropy:
            if inputs.entropy is None:
                raise ValueError(f"entropy_coeff={self.entropy_coeff} needs LossInputs.entropy (the full-vocabulary "
                                 "entropy per token, with grad); score the tokens with return_entropy=True")
            bonus = aggregate(inputs.entropy, inputs, mode=self.aggregation)
            loss = loss - self.entropy_coeff * bonus
            pairs["train/entropy_bonus"] = (bonus.detach(), share)  # the aggregated entropy, before the coefficient
        pairs["train/pg_loss"] = (pg_loss.detach(), share)
        pairs["train/loss"] = (loss.detach(), share)
        return loss, to_floats(pairs)
