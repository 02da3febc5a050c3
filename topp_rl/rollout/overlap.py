"""One-step off-policy rollouts (`rollout.overlap=true`): step k + 1 is generated while step k trains.

`topp_rl.engines.VersionedEngine` wraps the engine: `generate` and `update_weights` take one lock, so a weight
push waits for the generation in flight, and every sample records its weight version. `Prefetcher` runs
`generate` for the next ticket on one background thread, started before the current step's rewards so the two run
at once; everything else of a rollout step (rewards, which may use signals, advantages, collectives, packing) stays
on the trainer's thread.

Staleness is bounded by 1: step k + 1's generation starts once step k's batch is taken, with the weights of
step k - 1's update, and step k's own update waits for it. The loss sees old log-probs (the trained policy)
against rollout log-probs (the policy one update back), both over the recorded kept sets; `algo.loss.tis_cap`
or `algo.loss.icepop_low` / `icepop_high` corrects the gap. Where it pays: an engine on other cores or devices
(an SGLang server beside the trainer); an embedded engine shares the trainer's cores.

Resume: the generation in flight was sampled with weights one update older than the checkpoint's, which no
checkpoint holds, so the checkpoint holds its samples instead (`RolloutDataModule.state_dict` waits for them)
and the engine's version (`Prefetcher.entry` / `restore`); a resumed run trains its first step on them and
continues with exactly the rollouts of an uninterrupted run.
"""

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from topp_rl.data.sample import Sample
from topp_rl.engines.base import RolloutEngine
from topp_rl.engines.versioned import VersionedEngine
from topp_rl.rollout.broadcast import samples_from_state, samples_to_state


def versioned(engine: RolloutEngine) -> VersionedEngine:
    """`engine` under one lock with a weight version; refused where generating beside training cannot work."""
    if engine.shares_trainer_weights:
        raise ValueError(
            "rollout.overlap=true generates the next step while this one trains, but the embedded engine "
            "samples with the trainer's own weights (rollout.engine.share_weights=true); set "
            "rollout.engine.share_weights=false so it keeps its own copy, or use rollout=sglang"
        )
    return VersionedEngine(engine)


class Prefetcher:
    """At most one generation in flight, keyed by its rollout step."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-prefetch")
        self._pending: tuple[int, Future] | None = None

    def submit(self, step: int, generate: Callable[[], list[Sample]]) -> None:
        self.wait()
        self._pending = (step, self._pool.submit(_timed, generate))

    def take(self, step: int) -> tuple[list[Sample], float] | None:
        """(samples, seconds they took on the background thread) generated ahead for `step` (re-raising its
        error), or None if none was."""
        if self._pending is None or self._pending[0] != step:
            self.wait()  # a stale one (another step): finish it, drop it
            return None
        _, future = self._pending
        self._pending = None
        return future.result()

    def peek(self, step: int) -> tuple[list[Sample], float] | None:
        """What `take(step)` would return, left in place (None if no generation for `step` is in flight)."""
        if self._pending is None or self._pending[0] != step:
            return None
        return self._pending[1].result()

    def put(self, step: int, samples: list[Sample], seconds: float) -> None:
        """Hand `samples` over as the generation of `step` (restored from a checkpoint)."""
        self.wait()
        done: Future = Future()
        done.set_result((samples, seconds))
        self._pending = (step, done)

    def entry(self, step: int, engine: VersionedEngine) -> dict | None:
        """The generation in flight for `step` as checkpoint state (its samples, the engine's version), waiting
        for it to finish; None if none is in flight."""
        if (ahead := self.peek(step)) is None:
            return None
        samples, seconds = ahead
        return {"step": step, "samples": samples_to_state(samples), "seconds": seconds,
                "engine_version": engine.version}

    def restore(self, entry: dict, step: int, engine: VersionedEngine) -> None:
        """Hand a checkpoint's `entry` over as the generation of `step`, at the engine version it was sampled."""
        if entry["step"] != step:
            raise ValueError(f"checkpoint holds the rollout in flight for step {entry['step']}, but its data "
                             f"position is step {step}; the checkpoint is inconsistent: resume another one")
        self.put(step, samples_from_state(entry["samples"]), entry["seconds"])
        engine.restore(entry["engine_version"])

    def wait(self) -> None:
        """Let the generation in flight finish, dropping its result (and its error: nobody will train on it)."""
        if self._pending is not None:
            _, future = self._pending
            self._pending = None
            future.exception()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)


def _timed(generate: Callable[[], list[Sample]]) -> tuple[list[Sample], float]:
    start = time.perf_counter()
    samples = generate()
    return samples, time.perf_counter() - start
