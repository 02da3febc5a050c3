"""`AgentLoopStep`: the multi-turn agent rollout step (config `rollout/step=agent`), a `RolloutStep`.

Each record starts `params.n` trajectories, each with an `Episode` of the configured `Environment`
(`topp_rl.tasks.environment`). Rounds run every live trajectory's next turn at once: ONE `engine.generate` call
(n=1 per prompt) over the running ids of all waiting trajectories (prompt + every earlier turn's exact ids:
never re-tokenised), then every episode's answer concurrently (async methods on the step's environment event
loop, a thread of its own; sync ones on worker threads), each call bounded by `env_timeout_s`. A trajectory is one
`Sample` (`topp_rl.rollout.trajectory`), or several when the engine answered other ids than the running ones (a
prefix break starts a new sample): model tokens train, environment tokens have loss mask 0. Budgets: `max_turns`
model turns, `max_trajectory_tokens` response tokens (model + environment), and the model's context (no room for
a turn of `max_new_tokens`); a trajectory that reaches one ends (status truncated, counted). A fault of the
environment's code (`topp_rl.tasks.environment.EnvFault`: anything it raises, SystemExit and KeyboardInterrupt
included; a bad answer or reward; a call past its timeout) ends only its trajectory (reward 0, counted by kind);
more than `max_failed_frac` of a step's trajectories failing raises. Rewards come from the episodes.

Departures from slime's multi-turn rollouts: no re-tokenisation of the transcript (slime re-applies the chat
template each turn), and environment tokens never get a log-prob or a candidate set.
MoE routes: the last model turn's call covers the whole transcript (`topp_rl.rollout.trajectory`).
Distributed: the failure share is checked by `check` after the samples reached every rank (`RolloutStep.check`,
summed over DP ranks), so every rank raises alike; trajectory numbers are step-global (`score`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any

import numpy as np

from topp_rl.data import PromptRecord, SamplingParams
from topp_rl.data.sample import Sample
from topp_rl.engines.base import RolloutEngine
from topp_rl.rollout.step import RolloutStep, Stats
from topp_rl.rollout.trajectory import (
    END_ABORTED,
    END_CONTEXT,
    Trajectory,
    check_context,
    check_failed_share,
    check_step_settings,
    room_for_turn,
    score_trajectories,
    trajectory_stats,
)
from topp_rl.tasks import Task
from topp_rl.tasks.environment import (
    BAD_RETURN,
    EXCEPTION,
    EnvFault,
    Environment,
    EnvLoop,
    Episode,
    call_env,
    resolve_environment,
    reward_value,
)

TIMEOUT_KEY = "rollout.step.env_timeout_s"


class AgentLoopStep(RolloutStep):
    def __init__(self, *, environment: Environment | str, max_turns: int, max_trajectory_tokens: int,
                 env_timeout_s: float = 30.0, max_failed_frac: float = 0.5) -> None:
        if isinstance(environment, str):  # pkg.mod:Class or path/to/file.py:Class, as rewards and agents are named
            environment = resolve_environment(environment)
        if not isinstance(environment, Environment):
            raise TypeError(f"environment is a {type(environment).__name__}; pass a topp_rl.tasks.environment."
                            "Environment (an object with start(record) -> Episode; in config: "
                            "rollout.step.environment=pkg.mod:Class or path/to/file.py:Class)")
        check_step_settings(max_turns=max_turns, max_trajectory_tokens=max_trajectory_tokens,
                            max_failed_frac=max_failed_frac, timeout=("env_timeout_s", env_timeout_s))
        self.environment, self.max_turns, self.max_tokens = environment, max_turns, max_trajectory_tokens
        self.env_timeout_s, self.max_failed_frac = env_timeout_s, max_failed_frac

    # ----- generate: rounds of one engine call, then the episodes -----
    def generate(self, engine: RolloutEngine, records: list[PromptRecord], params: SamplingParams, *,
                 seed: int | None, tokenizer: Any) -> list[Sample]:
        # The rounds' count differs between DP ranks: an engine whose generate is a collective (FSDP's shared,
        # sharded module) gathers once for the step instead.
        context = engine.max_context
        check_context(max_trajectory_tokens=self.max_tokens, context=context)
        env_loop = EnvLoop()  # the async environment methods' (each step its own: one blocked by a call stays behind)
        try:
            with engine.holding_weights():
                return _run(self._generate(engine, records, params, seed=seed, tokenizer=tokenizer, context=context,
                                           env_loop=env_loop))
        finally:
            env_loop.close()

    async def _generate(self, engine, records, params, *, seed, tokenizer, context, env_loop) -> list[Sample]:
        trajs = [Trajectory(record=r, samples=[Sample(prompt_ids=r.prompt_ids)]) for r in records
                 for _ in range(params.n)]
        call = functools.partial(call_env, timeout_s=self.env_timeout_s, loop=env_loop, key=TIMEOUT_KEY)
        await asyncio.gather(*(self._guard(t, self._start(t, call)) for t in trajs))
        turn = dataclasses.replace(params, n=1)
        rounds = 0
        while waiting := self._with_room(trajs, max_new_tokens=turn.max_new_tokens, context=context):
            sent = [t.sample.tokens for t in waiting]
            outs = engine.generate(sent, turn, seed=_round_seed(seed, rounds))
            rounds += 1
            jobs = []
            for t, ids, out in zip(waiting, sent, outs, strict=True):
                model_turn = t.add_model_turn(out, ids, max_tokens=self.max_tokens, tokenizer=tokenizer)
                if model_turn is not None:
                    jobs.append(self._guard(t, self._respond(t, model_turn, tokenizer, engine.vocab_size, call)))
            await asyncio.gather(*jobs)
        await asyncio.gather(*(self._guard(t, self._reward(t, call)) for t in trajs
                               if t.episode is not None and not t.failed and t.end != END_ABORTED))
        return [s for i, t in enumerate(trajs) for s in t.finish(trajectory=i)]

    @staticmethod
    def _with_room(trajs: list[Trajectory], *, max_new_tokens: int, context: int | None) -> list[Trajectory]:
        """The live trajectories whose next turn fits the model's context; the others end there, truncated."""
        for t in trajs:
            if t.live and not room_for_turn(t.sample.tokens, max_new_tokens=max_new_tokens, context=context):
                t.end_on_budget(END_CONTEXT)
        return [t for t in trajs if t.live]

    async def _start(self, t: Trajectory, call) -> None:
        episode = await call(self.environment.start, t.record)
        if not isinstance(episode, Episode):
            raise EnvFault(BAD_RETURN, f"{type(self.environment).__qualname__}.start returned {episode!r:.80} "
                           f"({type(episode).__name__}); return an Episode (an object with respond(turn) and reward())")
        t.episode = episode

    async def _respond(self, t: Trajectory, turn, tokenizer, vocab_size: int, call) -> None:
        output = await call(t.episode.respond, turn)
        t.add_env_output(output, max_turns=self.max_turns, max_tokens=self.max_tokens, tokenizer=tokenizer,
                         vocab_size=vocab_size, source=f"{type(t.episode).__qualname__}.respond")

    async def _reward(self, t: Trajectory, call) -> None:
        value = await call(t.episode.reward)
        try:
            t.reward, t.reward_info = reward_value(value)
        except EnvFault as e:
            raise EnvFault(e.kind, f"{type(t.episode).__qualname__}.reward: {e}") from None

    @staticmethod
    async def _guard(t: Trajectory, job) -> None:
        """Run one environment job; a fault of the environment's code (any exception it raised, a bad return
        value, a timeout) ends only this trajectory (reward 0), counted by kind."""
        try:
            await job
        except EnvFault as e:
            t.fail(e.kind, str(e))
        except Exception as e:  # from the loop's own handling of what the environment gave: counted the same
            t.fail(EXCEPTION, f"{type(e).__name__}: {e}")

    def check(self, samples: list[Sample], *, reduce_sum=None) -> None:
        """Raise when more than `max_failed_frac` of the step's trajectories failed (`reduce_sum`: sums a tensor
        over the DP ranks, so every rank decides alike on the step's counts; None: this rank's own)."""
        check_failed_share(samples, max_failed_frac=self.max_failed_frac, reduce_sum=reduce_sum,
                           fix=f"fix the environment (or raise rollout.step.env_timeout_s={self.env_timeout_s} if its "
                           "calls are just slow)")

    # ----- score: the episodes' rewards -----
    def score(self, samples: list[Sample], records: list[PromptRecord], params: SamplingParams, *, task: Task,
              tokenizer: Any, first_group: int = 0) -> list[Sample]:
        score_trajectories(samples, records, n=params.n, first_group=first_group)
        return samples

    def stats(self, samples: list[Sample]) -> Stats:
        return trajectory_stats(samples)


def _run(coro):
    """`asyncio.run(coro)` through a task that returns None: on the main thread asyncio.run formats its task's repr
    (the result's too: up to 6 samples, every tensor of each) when it restores the SIGINT handler, a cost a step
    of cheap turns felt (docs/agents.md "Speed")."""
    result = []

    async def main() -> None:
        result.append(await coro)

    asyncio.run(main())
    return result[0]


def _round_seed(seed: int | None, round_index: int) -> int | None:
    """A distinct, reproducible engine seed per round of the step."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, round_index]).generate_state(1)[0])
