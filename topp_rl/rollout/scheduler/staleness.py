"""The staleness rule and its metrics (`rollout.max_staleness=K`).

A token's staleness is the number of weight updates between the weights that sampled it and the weights that
train it. A prompt group is trained only if every token of every sample in it is at most K updates old; an older
group is dropped whole (advantages come from whole groups) and counted (`rollout/dropped_stale`). The scheduler
starts each generation late enough that this never happens in a steady run; it catches the generations a
checkpoint held when a run resumes with a smaller K.
"""

import torch

from topp_rl.data.sample import Sample
from topp_rl.parallel.collectives import DataParallelCollectives

Stats = dict[str, tuple[float, float]]


def check_staleness_key(max_staleness: object, *, overlap: object) -> int:
    """K from `rollout.max_staleness` and the older `rollout.overlap` (true means K = 1), refused naming the key."""
    if not isinstance(overlap, bool):
        raise ValueError(f"config rollout.overlap={overlap!r}: must be true or false; set rollout.overlap=false")
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"config rollout.max_staleness={max_staleness!r}: must be an integer >= 0 (0: on-policy, "
                         "K: rollouts up to K weight updates ahead of training); set e.g. rollout.max_staleness=2")
    if overlap and max_staleness > 1:
        raise ValueError(f"config rollout.overlap=True: must be false with rollout.max_staleness={max_staleness} "
                         "(overlap means max_staleness=1); set rollout.overlap=false and keep rollout.max_staleness")
    return max(max_staleness, int(overlap))


def drop_stale_groups(samples: list[Sample], *, trained_version: int,
                      max_staleness: int) -> tuple[list[Sample], int]:
    """(the samples of the groups whose every token is at most `max_staleness` updates older than
    `trained_version`, how many groups were dropped)."""
    oldest: dict[int, int] = {}
    for s in samples:
        if s.response_length:
            oldest[s.group_index] = min(oldest.get(s.group_index, s.weight_version), min(s.token_versions()))
    stale = {g for g, v in oldest.items() if trained_version - v > max_staleness}
    return [s for s in samples if s.group_index not in stale], len(stale)


def staleness_stats(train: list[Sample], *, trained_version: int, dropped: int,
                    dp: DataParallelCollectives) -> Stats:
    """The step's staleness over its trained tokens (loss-mask tokens of `train`, this rank's trained samples),
    the same keys on every rank: mean (reduced as a mean), max and dropped groups (DP-global: one all-reduce each),
    and the share of trained samples whose tokens span more than one weight version (partial rollouts)."""
    tokens = [trained_version - v for s in train for v, m in zip(s.token_versions(), s.loss_mask, strict=True) if m]
    dropped_all = dp.sum(torch.tensor([float(dropped)], dtype=torch.float64))
    return {
        "rollout/staleness_mean": (float(sum(tokens)), float(len(tokens))),
        "rollout/staleness_max": (float(dp.max(max(tokens, default=0))), 1.0),
        "rollout/partial_frac": (float(sum(s.spans_versions for s in train)), float(len(train))),
        "rollout/dropped_stale": (float(dropped_all[0]), 1.0),
    }
