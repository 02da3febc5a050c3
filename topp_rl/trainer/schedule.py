"""Learning-rate schedules as multipliers of the optimizer's base lr, per optimizer step (`LambdaLR`).

`lr_multiplier(step)`: linear warmup from 1/warmup_steps to 1 over the first `warmup_steps` steps, then
constant, linear or cosine decay to `min_ratio` at `total_steps`. With `warmup_steps=0` and `decay="constant"`
the lr never changes (the default).
"""

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    warmup_steps: int = 0
    decay: Literal["constant", "linear", "cosine"] = "constant"
    min_ratio: float = 0.0
    total_steps: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ValueError(f"lr warmup_steps={self.warmup_steps!r} must be an integer >= 0; use 0 for no warmup")
        if self.decay not in ("constant", "linear", "cosine"):
            raise ValueError(f"lr decay={self.decay!r} must be 'constant', 'linear' or 'cosine'")
        if not 0 <= self.min_ratio <= 1:
            raise ValueError(f"lr min_ratio={self.min_ratio} must be in [0, 1] (a fraction of the base lr)")
        if self.total_steps < max(1, self.warmup_steps):
            raise ValueError(
                f"lr total_steps={self.total_steps} must be >= warmup_steps={self.warmup_steps} and >= 1; "
                "shorten the warmup or train longer"
            )

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        shape = 1.0 - progress if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * shape
