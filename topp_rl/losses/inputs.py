"""`LossInputs`: the per-response-token tensors every RL loss reads, plus the global denominators.

Sequences must be whole inside one `LossInputs` (the packer never splits a sample across micro-batches; under
context parallelism the module gathers a sample's response log-probs before calling the loss), because the
sequence-level pieces (GSPO's ratio, seq-mean aggregation, REINFORCE++ returns) need all of a sample's tokens.
"""

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossInputs:
    """Per response token [R], in sample order; `seq_index` [R] names each token's sample.

    `num_loss_tokens_global` (sum of `loss_mask` over the whole rollout step, all micro-batches and DP ranks) and
    `num_sequences_global` are the loss denominators, so summing a loss over micro-batches equals the loss of
    the whole step.
    """

    logprobs: Tensor  # [R] float, with grad
    old_logprobs: Tensor  # [R] float, the old-log-prob pass (no grad)
    advantages: Tensor  # [R] float
    loss_mask: Tensor  # [R] float, 1 = trainable token (fractional weights allowed)
    seq_index: Tensor  # [R] int64, sample of each token (any ids; tokens of a sample contiguous)
    num_loss_tokens_global: float
    num_sequences_global: int
    ref_logprobs: Tensor | None = None  # [R] float, reference model (no grad)
    rollout_logprobs: Tensor | None = None  # [R] float, as recorded by the engine
    entropy: Tensor | None = None  # [R] float, full-vocabulary entropy, with grad (only for an entropy bonus)
    teacher_logprobs: Tensor | None = None  # [R] float, the teacher's (no grad; topp_rl.losses.distill)

    def __post_init__(self) -> None:
        if self.logprobs.ndim != 1:
            raise ValueError(
                f"LossInputs.logprobs has shape {tuple(self.logprobs.shape)}; it must be 1-D [R] over the "
                "response tokens: flatten the packed micro-batch first"
            )
        r = self.logprobs.shape[0]
        for name in (
            "old_logprobs",
            "advantages",
            "loss_mask",
            "seq_index",
            "ref_logprobs",
            "rollout_logprobs",
            "entropy",
            "teacher_logprobs",
        ):
            t = getattr(self, name)
            if t is not None and t.shape != (r,):
                raise ValueError(
                    f"LossInputs.{name} has shape {tuple(t.shape)}, expected ({r},) like logprobs; "
                    "build every per-token field over the same response tokens"
                )
        if self.seq_index.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"LossInputs.seq_index has dtype {self.seq_index.dtype}; pass integer sample ids"
            )
        if not self.num_loss_tokens_global > 0:
            raise ValueError(
                f"LossInputs.num_loss_tokens_global is {self.num_loss_tokens_global}; it must be > 0 "
                "(sum of loss_mask over the whole rollout step); skip steps without trainable tokens"
            )
        if not self.num_sequences_global > 0:
            raise ValueError(
                f"LossInputs.num_sequences_global is {self.num_sequences_global}; it must be > 0 "
                "(number of samples in the whole rollout step)"
            )

    @cached_property
    def segments(self) -> tuple[Tensor, int]:
        """(compact sample id in [0, S) per token [R], S): `seq_index` relabelled for index_add."""
        ids, inverse = torch.unique_consecutive(self.seq_index, return_inverse=True)
        if ids.numel() != torch.unique(ids).numel():
            raise ValueError(
                "LossInputs.seq_index is not contiguous per sample (a sample id reappears after another "
                "sample's tokens); keep each sample's response tokens together, in sample order"
            )
        return inverse, ids.numel()

    def segment_sum(self, values: Tensor) -> Tensor:
        """Per-sample sums [S] of `values` [R] (differentiable)."""
        ids, n = self.segments
        return values.new_zeros(n).index_add(0, ids, values)
