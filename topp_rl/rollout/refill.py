"""Dynamic sampling that keeps the batch full (`data.refill=true`, with `data.drop_zero_variance_groups=true`).

A step whose zero-variance groups were dropped would train fewer than `prompts_per_step` groups exactly when the
learning signal is scarce. With refill, each DP rank generates more groups, in rounds, until it holds its share of
`prompts_per_step` (`target`) groups whose rewards differ, or until it generated `max_refill_factor` x `target`
groups in the step (`budget`; past it the step trains what it has, `rollout/refill_capped`).

How it departs from DAPO / verl's `filter_groups` (whole extra batches until enough): a round draws the missing
groups scaled by the informative share seen so far in the step (at least one informative group assumed), so one
more round usually fills the batch without generating a whole batch each time; the informative groups past the
target (`rollout/groups_surplus`) are left out, the last ones in data order, so a step trains exactly
`prompts_per_step` groups whenever it found that many.

Data position: a round takes the next prompts of the data stream, after everything drawn before (the step's own
prompts, earlier rounds); the prompts refill rounds drew move every later step's prompts on, and the datamodule's
checkpoint holds their count, so a resumed run draws exactly the prompts (and seeds) of an uninterrupted one.
Every DP rank runs the same rounds: the round sizes are summed over the DP group (a vector with one entry per DP
rank), so a rank that needs nothing more still joins each round's collectives, generating nothing; an engine whose
`generate` is a collective (sampling from the FSDP-sharded module) holds its gathered weights through the rounds
(`RolloutEngine.holding_weights`), so the ranks' calls need not match in number.
"""

import math
from dataclasses import dataclass

from topp_rl.data.sample import Sample


def check_refill(*, refill: bool, drop_zero_variance_groups: bool, max_refill_factor: object,
                 max_staleness: int) -> None:
    """The settings of dynamic sampling, refused naming the key (`data.*`)."""
    factor = max_refill_factor
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor) or factor < 1:
        raise ValueError(f"config data.max_refill_factor={factor!r}: must be a finite number >= 1 (the most groups a "
                         "step may generate, as a multiple of rollout.prompts_per_step); set e.g. "
                         "data.max_refill_factor=4")
    if not refill:
        return
    if not drop_zero_variance_groups:
        raise ValueError("config data.refill=True: must be false while data.drop_zero_variance_groups=false (refill "
                         "replaces the zero-variance groups that option drops; without it nothing is dropped, so "
                         "nothing needs refilling); set data.drop_zero_variance_groups=true, or data.refill=false")
    if max_staleness:
        raise ValueError(f"config data.refill=True: must be false with rollout.max_staleness={max_staleness} (or "
                         "rollout.overlap=true): rollouts ahead generate step k + 1 before step k's rewards are known, "
                         "but refill takes step k + 1's prompts after those step k's refill rounds drew, which depend "
                         "on those rewards; set rollout.max_staleness=0 and rollout.overlap=false, or data.refill=false")


@dataclass(frozen=True, kw_only=True)
class RefillPlan:
    """One DP rank's refill rounds within a step."""

    target: int  # informative groups the rank trains: its share of prompts_per_step
    max_factor: float  # data.max_refill_factor

    @property
    def budget(self) -> int:
        """The most groups the rank generates in a step, the step's own included."""
        return math.floor(round(self.max_factor * self.target, 9))

    def next_round(self, *, informative: int, generated: int) -> int:
        """Groups to generate in the next round (0: done): the missing ones over the informative share so far,
        ceil(missing * generated / max(informative, 1)), within the budget."""
        missing = self.target - informative
        if missing <= 0 or generated >= self.budget:
            return 0
        return min(self.budget - generated, -(-missing * generated // max(informative, 1)))


def continue_indices(earlier: list[Sample], new: list[Sample]) -> None:
    """Sample indices are the packer's sequence ids, unique on a rank. A multi-turn step numbers a round's samples
    from first_group * n on, more than n per group where a trajectory splits (a prefix break), so they may reach
    a later round's numbers: a round's samples move past the rank's earlier ones where they would collide."""
    if not earlier or not new:
        return
    floor = max(s.index for s in earlier) + 1
    lowest = min(s.index for s in new)
    if lowest < floor:
        for s in new:
            s.index += floor - lowest
