"""`VersionedEngine`: an engine that generates on other threads while the trainer pushes weights
(`rollout.max_staleness >= 1`; `topp_rl.rollout.scheduler`).

The engine counts the weight updates it received (`version`) and every response token records the version of
the weights that sampled it (`Sample.weight_version`, and `Sample.weight_versions` where a response spans an
update). Two ways an update meets the generations in flight:
- whole responses (`partial=False`): `generate` calls hold a shared lock and an update takes it exclusively, so
  it waits for the calls in flight (which keep the weights they started with) and new calls wait for it (an
  update waiting blocks new calls: it is never starved). An engine that cannot run two calls at once
  (`InFlightUpdates` says it can) runs them one at a time;
- partial rollouts (`partial=True`, an `InFlightUpdates` engine): the update lands between two decode steps of
  the responses in flight, which continue under the new weights; the engine stamps each token's version.
"""

import contextlib
import threading
from collections.abc import Iterable, Iterator

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample
from topp_rl.engines.base import EngineWrapper, InFlightUpdates, RolloutEngine


class VersionedEngine(EngineWrapper):
    """A `RolloutEngine` made safe to generate on other threads while one pushes weights."""

    def __init__(self, engine: RolloutEngine, *, partial: bool = False) -> None:
        if partial and not isinstance(engine, InFlightUpdates):
            raise ValueError(
                f"rollout.partial_rollouts=true needs an engine whose weight updates land between decode steps, but "
                f"{type(engine).__name__} cannot take one while it generates; use the embedded engine with "
                "rollout.engine.batching=continuous, or rollout=sglang, or set rollout.partial_rollouts=false"
            )
        self.inner, self.partial = engine, partial
        self.vocab_size = engine.vocab_size
        self.version = 0  # weight updates received
        self._resend = False  # the next push re-sends the weights of `version` (a resumed run's start push)
        self._calls = _SharedExclusive()
        # One call at a time unless the engine batches concurrent calls itself.
        self._one_call = None if isinstance(engine, InFlightUpdates) else threading.Lock()

    @property
    def concurrent(self) -> bool:
        """Several `generate` calls run at once (they share the engine's decode batch)."""
        return self._one_call is None

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None) -> list[Sample]:
        if self.partial:
            start = self.version
            samples = self.inner.generate(prompts, params, seed=seed)
            for s in samples:  # the engine stamped every token; an empty (aborted) one gets the version it started at
                if not s.response_length:
                    s.weight_version = start
            return samples
        with self._calls.shared(), self._one_call or contextlib.nullcontext():
            version = self.version
            samples = self.inner.generate(prompts, params, seed=seed)
        for s in samples:
            s.weight_version, s.weight_versions = version, None
        return samples

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        version = self.version if self._resend else self.version + 1
        if self.partial:
            self.inner.update_weights_in_flight(named_tensors, version=version)
        else:
            with self._calls.exclusive():
                self.inner.update_weights(named_tensors)
        self.version, self._resend = version, False

    def restore(self, version: int) -> None:
        """Continue a checkpointed run whose engine had received `version` updates. The next push (the start push
        of the resumed run, `WeightSync.sync_on_start`) re-sends the checkpoint's weights, which are that
        version's: it is not counted again."""
        with self._calls.exclusive():
            self.version = version
            self._resend = True
            if self.partial:
                self.inner.start_version(version)

    def close(self) -> None:
        with self._calls.exclusive():
            self.inner.close()


class _SharedExclusive:
    """A readers-writer lock that prefers the writer: once `exclusive` waits, new `shared` holders wait too."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            self._cond.wait_for(lambda: not self._writer and not self._readers)
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
