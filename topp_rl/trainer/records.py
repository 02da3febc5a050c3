"""`OnPolicyRecord`: per-token figures of the on-policy (old-log-prob) pass, handed to the callbacks.

The old-log-prob pass runs with the same weights the rollout engine sampled with, so comparing its log-probs with
the engine's recorded ones measures the train/rollout mismatch; `logprobs_unmasked` shows what scoring over the
full vocabulary would have given instead.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OnPolicyRecord:
    """Tensors over this rank's response tokens of one rollout step, in sample order (all [R])."""

    logprobs: torch.Tensor  # float (the scoring dtype), over the recorded candidate set (as used for training)
    logprobs_unmasked: torch.Tensor  # float, over the full vocabulary
    rollout_logprobs: torch.Tensor  # float32, as recorded by the engine
    loss_mask: torch.Tensor  # float32, 1 = trainable token
    entropy: torch.Tensor  # float, of the unrestricted temperature-scaled distribution
    support_size: torch.Tensor  # int64, candidate-set size; 0 = no candidate data (unrestricted)
    # int64, weight updates between the weights that sampled the token and the weights this pass ran (0: on-policy;
    # > 0: rollouts ahead of training, `rollout.max_staleness`); None: every token 0
    staleness: torch.Tensor | None = None
    # MoE: (token-layer routes where the trainer's own top-k set equals the rollout's, token-layer routes
    # recorded) over the pass's tokens, prompt included; None when the batch carried no routes
    routing_agreement: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        n = self.logprobs.shape[0]
        for name in ("logprobs_unmasked", "rollout_logprobs", "loss_mask", "entropy", "support_size", "staleness"):
            if getattr(self, name) is not None and getattr(self, name).shape != (n,):
                raise ValueError(
                    f"OnPolicyRecord.{name} has shape {tuple(getattr(self, name).shape)}, expected ({n},) like "
                    "logprobs; build every field over the same response tokens"
                )

    @classmethod
    def concat(cls, records: list["OnPolicyRecord"]) -> "OnPolicyRecord":
        """Join per-micro-batch records (in micro-batch order) into one record for the rollout step."""
        if not records:
            raise ValueError("OnPolicyRecord.concat got no records; pass at least one micro-batch record")
        tensors = [f for f in cls.__dataclass_fields__ if f not in ("routing_agreement", "staleness")]
        routing = [r.routing_agreement for r in records if r.routing_agreement is not None]
        agreement = (sum(a for a, _ in routing), sum(n for _, n in routing)) if routing else None
        staleness = None if all(r.staleness is None for r in records) else torch.cat([r.token_staleness() for r in records])
        return cls(**{f: torch.cat([getattr(r, f) for r in records]) for f in tensors}, staleness=staleness,
                   routing_agreement=agreement)

    def token_staleness(self) -> torch.Tensor:
        """`staleness`, zeros where None."""
        if self.staleness is not None:
            return self.staleness
        return torch.zeros(self.logprobs.shape[0], dtype=torch.int64, device=self.logprobs.device)
