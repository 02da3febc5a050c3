"""`PhaseTimer`: wall seconds per named phase of a step, a nested phase's time counted once (in itself).

The training step's figures `perf/old_logprob_s` and `perf/optim_s` come from it: with `ppo_epochs=1` the
on-policy records are read inside the gradient pass (`old_logprob` nested in `optim`), and that share belongs to
the old-log-prob phase, not to the optimisation.
"""

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: list[str] = []  # the phases entered and not left, innermost last
        self._since = 0.0  # when the innermost open phase last started counting

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._switch()
        self._open.append(name)
        try:
            yield
        finally:
            self._switch()
            self._open.pop()

    def _switch(self) -> None:
        """Charge the time since the last switch to the innermost open phase (the only one counting)."""
        now = self.clock()
        if self._open:
            self.seconds[self._open[-1]] += now - self._since
        self._since = now
