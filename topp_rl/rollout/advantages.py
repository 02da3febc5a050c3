"""Advantage estimators: one scalar per sample from its reward and prompt group (small strategy objects).

- `GroupAdvantage` (GRPO; Dr. GRPO with `normalize_std=False`): r - mean(group), optionally / (std(group) + eps),
  std with Bessel's correction as in the GRPO reference implementations; a group of one gets 0.
- `RLOOAdvantage` (RLOO): r_i - mean of the other samples of its group (leave-one-out baseline), optionally /
  (std(group) + eps).
- `BatchAdvantage` (REINFORCE++): r - mean(batch), optionally / (std(batch) + eps); the batch statistics span
  every DP rank through `reduce` (a sum over ranks).
- `NoBaseline`: the raw reward.
Config: `algo.advantage` is a `_target_` entry naming one of these classes. `group_relative` tells config
validation whether the estimator compares samples of one prompt (and so needs `rollout.n_samples >= 2`).
`informative_groups` drops the groups whose rewards are all equal (`data.drop_zero_variance_groups`).
`trajectory_advantages` applies an estimator per trajectory: a multi-turn trajectory split into several samples
(a prefix break) is ONE reward in its group's statistics, and each of its samples gets the trajectory's advantage.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from topp_rl.data.sample import Sample

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class AdvantageEstimator(Protocol):
    group_relative: ClassVar[bool]  # the baseline comes from the sample's own prompt group

    def __call__(
        self, rewards: torch.Tensor, groups: torch.Tensor, *, reduce: Reduce = _identity
    ) -> torch.Tensor:
        """rewards float [N], groups int64 [N] -> advantages float32 [N]."""
        ...


def _group_stats(
    rewards: torch.Tensor, groups: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size, group mean, group sum of squared deviations)."""
    _, inverse = torch.unique(groups, return_inverse=True)
    k = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(k, dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(k, dtype=rewards.dtype).index_add_(0, inverse, rewards) / count
    dev = rewards - mean[inverse]
    ss = torch.zeros(k, dtype=rewards.dtype).index_add_(0, inverse, dev * dev)
    return count[inverse], mean[inverse], ss[inverse]


@dataclass(frozen=True)
class GroupAdvantage:
    group_relative: ClassVar[bool] = True
    normalize_std: bool = True
    eps: float = 1e-6

    def __call__(
        self, rewards: torch.Tensor, groups: torch.Tensor, *, reduce: Reduce = _identity
    ) -> torch.Tensor:
        r = rewards.double()
        count, mean, ss = _group_stats(r, groups)
        adv = r - mean
        if self.normalize_std:
            std = (ss / (count - 1).clamp(min=1)).sqrt()
            adv = torch.where(std > 0, adv / (std + self.eps), torch.zeros_like(adv))  # constant group -> 0
        return adv.float()


@dataclass(frozen=True)
class RLOOAdvantage:
    group_relative: ClassVar[bool] = True
    normalize_std: bool = False
    eps: float = 1e-6

    def __call__(
        self, rewards: torch.Tensor, groups: torch.Tensor, *, reduce: Reduce = _identity
    ) -> torch.Tensor:
        r = rewards.double()
        count, mean, ss = _group_stats(r, groups)
        # r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean); a group of one has no baseline: 0.
        scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
        adv = scale * (r - mean)
        if self.normalize_std:
            std = (ss / (count - 1).clamp(min=1)).sqrt()
            adv = torch.where(std > 0, adv / (std + self.eps), torch.zeros_like(adv))  # constant group -> 0
        return adv.float()


@dataclass(frozen=True)
class BatchAdvantage:
    group_relative: ClassVar[bool] = False
    normalize_std: bool = True
    eps: float = 1e-6

    def __call__(
        self, rewards: torch.Tensor, groups: torch.Tensor, *, reduce: Reduce = _identity
    ) -> torch.Tensor:
        r = rewards.double()
        totals = reduce(torch.stack([r.sum(), (r * r).sum(), torch.tensor(float(r.numel()), dtype=r.dtype)]))
        n = totals[2].clamp(min=1)
        mean = totals[0] / n
        adv = r - mean
        if self.normalize_std:
            std = ((totals[1] / n - mean * mean).clamp(min=0) * n / (n - 1).clamp(min=1)).sqrt()
            adv = adv / (std + self.eps) if std > 0 else torch.zeros_like(adv)
        return adv.float()


@dataclass(frozen=True)
class NoBaseline:
    group_relative: ClassVar[bool] = False
    def __call__(
        self, rewards: torch.Tensor, groups: torch.Tensor, *, reduce: Reduce = _identity
    ) -> torch.Tensor:
        return rewards.float()


def trajectory_advantages(estimator: AdvantageEstimator, samples: list[Sample], *, reduce: Reduce = _identity,
                          shaping: torch.Tensor | None = None) -> torch.Tensor:
    """One advantage per sample, computed over trajectories: the samples that share `metadata["trajectory"]`
    (a multi-turn step's, `topp_rl.rollout.trajectory`) count once in the estimator's group or batch statistics
    and all get that trajectory's advantage; a sample without it is a trajectory of its own. `shaping` [N]: added
    to each sample's reward before the estimator sees it (the overlong penalty, `topp_rl.rollout.overlong`)."""
    position: dict[object, int] = {}  # trajectory key -> its place among `heads`
    heads: list[Sample] = []  # each trajectory's first sample
    first: list[int] = []  # and its place in `samples`
    owner = []
    for i, s in enumerate(samples):
        key = ("trajectory", s.metadata["trajectory"]) if "trajectory" in s.metadata else ("sample", i)
        if key not in position:
            position[key] = len(heads)
            heads.append(s)
            first.append(i)
        head = heads[position[key]]
        if head.reward != s.reward or head.group_index != s.group_index:
            raise ValueError(f"samples {head.index} and {s.index} of trajectory {key[1]} differ in reward "
                             f"({head.reward} vs {s.reward}) or group; a trajectory's samples share both")
        owner.append(position[key])
    rewards = torch.tensor([float(s.reward) for s in heads], dtype=torch.float64)
    groups = torch.tensor([s.group_index for s in heads], dtype=torch.long)
    owner_t = torch.tensor(owner, dtype=torch.long)
    if shaping is not None:
        per_head = shaping.double()[torch.tensor(first, dtype=torch.long)]
        if not torch.equal(shaping.double(), per_head[owner_t]):
            raise ValueError("the reward shaping differs between samples of one trajectory; a trajectory's samples "
                             "share one reward")
        rewards = rewards + per_head
    return estimator(rewards, groups, reduce=reduce)[owner_t]


@dataclass(frozen=True)
class GroupSelection:
    """The groups a step trains, of the ones a DP rank generated (whole groups: every live sample of a kept group)."""

    train: list[Sample]  # in sample order
    groups: int  # generated
    informative: int  # of them with rewards that differ (all of them without `drop`)
    filtered: int  # zero-variance groups left out
    surplus: int = 0  # informative groups past `most`, left out

    @property
    def trained(self) -> int:
        return self.groups - self.filtered - self.surplus


def informative_groups(live: list[Sample], *, drop: bool, most: int | None = None) -> GroupSelection:
    """With `drop`, the groups of two or more samples whose rewards are all equal are left out, and of the others
    only the first `most` in group order (the surplus of a refilled step). Never drops everything (ranks stay in
    lockstep): with no group carrying signal, the first `most` groups train (group-relative advantages are zero).
    Whole groups either way: a group's baseline is computed over all its live samples, never over a part."""
    by_group: dict[int, list[Sample]] = {}
    for s in live:
        by_group.setdefault(s.group_index, []).append(s)
    if not drop:
        return GroupSelection(train=live, groups=len(by_group), informative=len(by_group), filtered=0)
    order = sorted(by_group)
    informative = [g for g in order if len(by_group[g]) < 2 or len({s.reward for s in by_group[g]}) > 1]
    keep = (informative or order)[:most]
    kept = sorted((s for g in keep for s in by_group[g]), key=lambda s: s.index)
    surplus = len(informative) - len(keep) if informative else 0
    return GroupSelection(train=kept, groups=len(by_group), informative=len(informative),
                          filtered=len(by_group) - len(keep) - surplus, surplus=surplus)
