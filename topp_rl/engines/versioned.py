"""`VersionedEngine`: an engine that generates on one thread while another pushes weights (`rollout.overlap`).

`generate` and `update_weights` take one lock, so a weight push waits for the generation in flight (which keeps
sampling with the weights it started with), and every sample records the number of weight updates its engine
had received (`Sample.weight_version`). The prefetching itself is the rollout pipeline's
(`topp_rl.rollout.overlap.Prefetcher`).
"""

import threading
from collections.abc import Iterable

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample
from topp_rl.engines.base import EngineWrapper, RolloutEngine


class VersionedEngine(EngineWrapper):
    """A `RolloutEngine` made safe to generate on one thread while another pushes weights."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.inner = engine
        self.vocab_size = engine.vocab_size
        self.version = 0  # weight updates received
        self._resend = False  # the next push re-sends the weights of `version` (a resumed run's start push)
        self._lock = threading.Lock()

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None) -> list[Sample]:
        with self._lock:
            version = self.version
            samples = self.inner.generate(prompts, params, seed=seed)
        for s in samples:
            s.weight_version = version
        return samples

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with self._lock:
            self.inner.update_weights(named_tensors)
            if self._resend:
                self._resend = False
            else:
                self.version += 1

    def restore(self, version: int) -> None:
        """Continue a checkpointed run whose engine had received `version` updates. The next push (the start push
        of the resumed run, `WeightSync.sync_on_start`) re-sends the checkpoint's weights, which are that
        version's: it is not counted again."""
        with self._lock:
            self.version = version
            self._resend = True

    def close(self) -> None:
        with self._lock:
            self.inner.close()
