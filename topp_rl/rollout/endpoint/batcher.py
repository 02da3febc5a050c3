"""`TurnBatcher`: the endpoint's requests of a step, batched into one `engine.generate` call per round.

The rule is event-driven: a round starts when no round is running and every live trajectory (its agent function
has not returned) has a request waiting; it takes every waiting request. Not a collect window on a timer, because
- a round then holds every trajectory that will ask (the most the engine can batch) and never waits past the
  last request: no idle time to tune;
- which requests share a round, and the round's seed, follow from the agents' requests alone, not from timing,
  so a step with deterministic agents is reproducible (the same as the agent loop's rounds).
The cost: an agent that works between two requests (a slow tool) holds the round for everyone, as a slow
environment does in the agent loop; its time is bounded by the per-trajectory timeout.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from topp_rl.data import SamplingParams
from topp_rl.data.sample import Sample
from topp_rl.engines.base import RolloutEngine


class Retired(Exception):
    """The request's trajectory ended (its agent returned, raised or timed out) before the engine answered."""


@dataclass(eq=False)
class _Request:
    trajectory: int
    ids: list[int]
    future: asyncio.Future


class TurnBatcher:
    def __init__(self, engine: RolloutEngine, params: SamplingParams, *, trajectories: int, seed: int | None) -> None:
        self.engine, self.params, self.seed = engine, params, seed
        self.live = set(range(trajectories))
        self.waiting: list[_Request] = []
        self.running = False
        self.rounds = 0
        self.engine_error: BaseException | None = None  # the engine's failure: the step raises it

    async def generate(self, trajectory: int, ids: list[int]) -> Sample:
        """The engine's answer to `ids` for `trajectory`, once its round ran."""
        if trajectory not in self.live:
            raise Retired(f"trajectory {trajectory} has ended")
        request = _Request(trajectory, ids, asyncio.get_running_loop().create_future())
        self.waiting.append(request)
        self._maybe_start()
        return await request.future

    def retire(self, trajectory: int) -> None:
        """`trajectory`'s agent is done: it no longer holds rounds back; its waiting requests are dropped."""
        self.live.discard(trajectory)
        for r in [r for r in self.waiting if r.trajectory == trajectory]:
            self.waiting.remove(r)
            if not r.future.done():
                r.future.set_exception(Retired(f"trajectory {trajectory} ended while its request waited"))
        self._maybe_start()

    def _maybe_start(self) -> None:
        if self.running or not self.waiting or not self.live <= {r.trajectory for r in self.waiting}:
            return
        batch = sorted(self.waiting, key=lambda r: r.trajectory)  # stable: a trajectory's requests keep their order
        self.waiting = []
        self.running = True
        asyncio.get_running_loop().create_task(self._round(batch))

    async def _round(self, batch: list[_Request]) -> None:
        try:
            # On a worker thread: the event loop keeps serving (connections, timeouts) while the engine runs.
            outs = await asyncio.to_thread(self.engine.generate, [r.ids for r in batch], self.params,
                                           seed=round_seed(self.seed, self.rounds))
        except BaseException as e:  # every waiting agent hears of it; the step raises it at the end
            self.engine_error = self.engine_error or e
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(RuntimeError(f"the rollout engine failed: {type(e).__name__}: {e}"))
        else:
            for r, out in zip(batch, outs, strict=True):
                if not r.future.done():
                    r.future.set_result(out)
        finally:
            self.rounds += 1
            self.running = False
        self._maybe_start()


def round_seed(seed: int | None, round_index: int) -> int | None:
    """A distinct, reproducible engine seed per round of the step."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, round_index]).generate_state(1)[0])
