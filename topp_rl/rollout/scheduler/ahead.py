"""`RolloutScheduler`: the generations of up to K steps ahead of the step being trained (`rollout.max_staleness`).

When step k's rollout is taken, the scheduler starts the generations of steps k + 1 .. k + K not started yet, on
background threads; everything else of a rollout step (rewards, which may use signals, advantages, collectives,
packing) stays on the trainer's thread. How the generations in flight meet a weight update is the engine
wrapper's (`topp_rl.engines.VersionedEngine`): whole responses wait for it, or partial rollouts continue across it.
Threads: K when the engine batches concurrent calls (an `InFlightUpdates` engine: the embedded engine with
continuous batching, SGLang), so the steps in flight share one decode batch; else one, in step order.

Resume: the generations in flight were sampled with weights no checkpoint holds, so the checkpoint holds their
samples instead (`state`, which waits for them) and the engine's version; a resumed run trains its next steps on
them. At K <= 1 with the embedded engine this continues with exactly the rollouts of an uninterrupted run. At
K > 1 with partial rollouts the moment an update lands in a response depends on timing: no schedule is
reproducible there, and none is offered.
"""

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from topp_rl.data.sample import Sample
from topp_rl.engines.base import RolloutEngine
from topp_rl.engines.versioned import VersionedEngine
from topp_rl.rollout.broadcast import samples_from_state, samples_to_state

Generated = tuple[list[Sample], float]  # (samples, seconds their generation took on its thread)


def versioned(engine: RolloutEngine, *, partial: bool) -> VersionedEngine:
    """`engine` counting weight versions; refused where generating beside training cannot work."""
    if engine.shares_trainer_weights:
        raise ValueError(
            "rollout.max_staleness >= 1 (or rollout.overlap=true) generates the next steps while this one trains, "
            "but the embedded engine samples with the trainer's own weights (rollout.engine.share_weights=true); set "
            "rollout.engine.share_weights=false so it keeps its own copy, or use rollout=sglang"
        )
    return VersionedEngine(engine, partial=partial)


class RolloutScheduler:
    """Generations in flight, keyed by the rollout step they are for."""

    def __init__(self, max_staleness: int) -> None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness!r} must be an integer >= 1 (0: no scheduler)")
        self.max_staleness = max_staleness
        self._pool: ThreadPoolExecutor | None = None  # made at the first start: its size follows the engine
        self._ahead: dict[int, Future] = {}

    def take(self, step: int) -> Generated | None:
        """The generation of `step` if it was started ahead (re-raising its error), else None. Generations for
        earlier steps (nobody will train them) are finished and dropped."""
        for earlier in sorted(s for s in self._ahead if s < step):
            self._ahead.pop(earlier).exception()
        future = self._ahead.pop(step, None)
        return None if future is None else future.result()

    def start_ahead(self, step: int, generate: Callable[[int], list[Sample]], *, concurrent: bool) -> None:
        """Start the generations of steps step + 1 .. step + K that are not in flight, in step order (call it
        when step's rollout is taken: the engine then holds the weights `step` trains). `concurrent`: the engine
        runs several calls at once."""
        if self._pool is None:
            workers = self.max_staleness if concurrent else 1
            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout-ahead")
        for s in range(step + 1, step + self.max_staleness + 1):
            if s not in self._ahead:
                self._ahead[s] = self._pool.submit(_timed, generate, s)

    @property
    def steps_in_flight(self) -> list[int]:
        return sorted(self._ahead)

    def put(self, step: int, samples: list[Sample], seconds: float) -> None:
        """Hand `samples` over as the generation of `step` (restored from a checkpoint)."""
        done: Future = Future()
        done.set_result((samples, seconds))
        self._ahead[step] = done

    def state(self, step: int, engine: VersionedEngine) -> dict | None:
        """The generations in flight for steps >= `step` as checkpoint state (their samples, the engine's
        version), waiting for them to finish; None if none is in flight."""
        steps = {s: self._ahead[s].result() for s in self.steps_in_flight if s >= step}
        if not steps:
            return None
        return {"engine_version": engine.version,
                "steps": {s: {"samples": samples_to_state(samples), "seconds": seconds}
                          for s, (samples, seconds) in steps.items()}}

    def restore(self, entry: dict, step: int, engine: VersionedEngine) -> None:
        """Hand a checkpoint's `entry` over as the generations of its steps, at the engine version they were
        sampled with (also a checkpoint of one-step overlap, which held one step)."""
        if "steps" not in entry:  # written by rollout.overlap before the scheduler: one step
            entry = {"engine_version": entry["engine_version"],
                     "steps": {entry["step"]: {"samples": entry["samples"], "seconds": entry["seconds"]}}}
        if min(entry["steps"]) != step:
            raise ValueError(f"checkpoint holds the rollouts in flight for steps {sorted(entry['steps'])}, but its "
                             f"data position is step {step}; the checkpoint is inconsistent: resume another one")
        for s, held in entry["steps"].items():
            self.put(int(s), samples_from_state(held["samples"]), held["seconds"])
        engine.restore(entry["engine_version"])

    def wait(self) -> None:
        """Let the generations in flight finish, dropping their results (and errors: nobody will train on them)."""
        while self._ahead:
            self._ahead.pop(min(self._ahead)).exception()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _timed(generate: Callable[[int], list[Sample]], step: int) -> Generated:
    start = time.perf_counter()
    samples = generate(step)
    return samples, time.perf_counter() - start
