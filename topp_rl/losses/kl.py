"""KL(pi || pi_ref) per token, estimated from tokens sampled by pi (Schulman's k1 / k2 / k3).

With x = log pi(y) - log pi_ref(y) for a sampled token y:
- k1 = x                      (unbiased, can be negative)
- k2 = x^2 / 2                (biased, >= 0)
- k3 = exp(-x) - 1 + x        (unbiased, >= 0)
No clamping of x: the estimates are exact, so an exploding reference gap shows up rather than being hidden.
Whether pi_ref is scored over the recorded candidate set or the full vocabulary is the module's choice
(`use_candidate_mask`); the estimators do not care.
"""

import torch
from torch import Tensor

from topp_rl.losses.inputs import LossInputs

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, *, estimator: str) -> Tensor:
    """Per-token KL estimate [R] from log pi [R] and log pi_ref [R]; gradient flows through both."""
    x = logprobs - ref_logprobs
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        return torch.expm1(-x) + x
    raise ValueError(f"kl_estimator={estimator!r} is not supported; choose one of {', '.join(KL_ESTIMATORS)}")


class KLPenalty:
    """`coef` * KL(pi || pi_ref) per token, with the estimator and mask choice of the algorithm config."""

    def __init__(self, *, coef: float, estimator: str = "k3", use_candidate_mask: bool = True) -> None:
        if coef < 0:
            raise ValueError(f"kl_coef={coef} must be >= 0; use 0 to disable the KL penalty")
        if estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator={estimator!r} is not supported; choose one of {', '.join(KL_ESTIMATORS)}"
            )
        self.coef = coef
        self.estimator = estimator
        self.use_candidate_mask = use_candidate_mask

    @property
    def enabled(self) -> bool:
        return self.coef > 0

    def per_token(self, inputs: LossInputs, *, logprobs: Tensor) -> Tensor:
        """KL estimate [R] of `logprobs` against `inputs.ref_logprobs` (unscaled)."""
        if inputs.ref_logprobs is None:
            raise ValueError(
                f"kl_coef={self.coef} needs LossInputs.ref_logprobs; configure a reference model or set kl_coef=0"
            )
        return kl_estimate(logprobs, inputs.ref_logprobs, estimator=self.estimator)
