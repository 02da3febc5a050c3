"""DAPO's overlong handling of the samples that reach the generation budget B = `rollout.max_new_tokens`.

- Filtering (`filter`): a truncated sample (status TRUNCATED: cut by max_new_tokens; in a multi-turn step, a
  trajectory ended by a budget) leaves the loss: its loss mask becomes 0. It stays in its group's statistics (its
  reward counts in the group's mean and std: DAPO and verl mask only the loss), and in the sample count of the
  seq-mean aggregations (contributing 0, like any sample without loss tokens); the token-mean denominator no
  longer counts its tokens.
- Soft penalty (`buffer` L, `penalty` P): a response of n tokens gets
      0                      if n <= B - L
      (B - L - n) / L * P    if B - L < n <= B      (-P at n = B: a truncated response)
  added to its reward before the advantages are computed. The task's reward is kept as it is everywhere else:
  the logged `rollout/reward_mean`, zero-variance group selection and refill read it (DAPO's dynamic sampling
  keys on accuracy too).
Config: `algo.overlong` (`_target_: topp_rl.rollout.overlong.Overlong`), handed to the datamodule as
`data.overlong`; `check` refuses settings that cannot work, at start (`topp_rl.config.validate_overlong`).
"""

import math
from dataclasses import dataclass

import torch

from topp_rl.data.sample import Sample, SampleStatus


@dataclass(frozen=True)
class Overlong:
    filter: bool = False
    buffer: int = 0
    penalty: float = 0.0

    @property
    def penalises(self) -> bool:
        return self.penalty > 0

    def check(self, *, max_new_tokens: int) -> None:
        """Raise ValueError on settings that cannot work with a budget of `max_new_tokens`."""
        if not isinstance(self.filter, bool):
            raise ValueError(f"config algo.overlong.filter={self.filter!r}: must be true or false")
        if isinstance(self.buffer, bool) or not isinstance(self.buffer, int) or self.buffer < 0:
            raise ValueError(f"config algo.overlong.buffer={self.buffer!r}: must be an integer >= 0 (tokens at the end "
                             "of the budget where the penalty grows); e.g. algo.overlong.buffer=4096 of 20480")
        if (isinstance(self.penalty, bool) or not isinstance(self.penalty, int | float) or not math.isfinite(self.penalty)
                or self.penalty < 0):
            raise ValueError(f"config algo.overlong.penalty={self.penalty!r}: must be a finite number >= 0 (the "
                             "penalty at the budget, subtracted from the reward); e.g. algo.overlong.penalty=1.0")
        if (self.buffer > 0) != self.penalises:
            raise ValueError(f"config algo.overlong.buffer={self.buffer} with algo.overlong.penalty={self.penalty}: "
                             "the soft penalty needs both > 0 (one alone does nothing); set both, e.g. "
                             "algo.overlong.buffer=4 algo.overlong.penalty=1.0, or both to 0")
        if self.buffer >= max_new_tokens:
            raise ValueError(f"config algo.overlong.buffer={self.buffer}: must be < rollout.max_new_tokens "
                             f"({max_new_tokens}), the budget whose last `buffer` tokens are penalised; lower the "
                             "buffer (DAPO: 4096 of 20480) or raise rollout.max_new_tokens")

    def penalties(self, samples: list[Sample], *, max_new_tokens: int) -> torch.Tensor:
        """float64 [N]: each sample's soft penalty (<= 0; all 0 without `penalty`)."""
        lengths = torch.tensor([s.response_length for s in samples], dtype=torch.float64)
        if not self.penalises:
            return torch.zeros_like(lengths)
        over = (lengths - (max_new_tokens - self.buffer)).clamp(min=0)  # tokens into the buffer
        return -over.clamp(max=self.buffer) / self.buffer * self.penalty

    def filter_truncated(self, samples: list[Sample]) -> int:
        """With `filter`: zero the loss mask of every truncated sample, in place; returns how many were."""
        if not self.filter:
            return 0
        cut = [s for s in samples if s.status == SampleStatus.TRUNCATED]
        for s in cut:
            s.loss_mask = [0] * s.response_length
        return len(cut)

    def stats(self, *, filtered: int, penalties: torch.Tensor) -> dict[str, tuple[float, float]]:
        """(sum, count) figures over a rank's trained samples (`penalties` [N]); only the parts switched on."""
        n = float(penalties.numel())
        out = {}
        if self.filter:
            out["rollout/overlong_filtered_frac"] = (float(filtered), n)  # of the trained samples, out of the loss
        if self.penalises:
            out["rollout/overlong_penalty_mean"] = (float(penalties.sum()), n)
            out["rollout/overlong_penalised_frac"] = (float((penalties < 0).sum()), n)
        return out
