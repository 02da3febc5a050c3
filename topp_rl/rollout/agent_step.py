"""`AgentLoopStep`: the multi-turn agent rollout step (config `rollout/step=agent`), a `RolloutStep`.

Each record starts `params.n` trajectories, each with an `Episode` of the configured `Environment`
(`topp_rl.tasks.environment`). Rounds run every live trajectory's next turn at once: ONE `engine.generate` call
(n=1 per prompt) over the running ids of all waiting trajectories (prompt + every earlier turn's exact ids:
never re-tokenised), then every episode's answer concurrently (async episodes on one event loop, sync ones on
threads), each call bounded by `env_timeout_s`. A trajectory is one `Sample` (`topp_rl.rollout.trajectory`), or
several when the engine answered other ids than the running ones (a prefix break starts a new sample): model tokens
train, environment tokens have loss mask 0. Budgets: `max_turns` model turns and
`max_trajectory_tokens` response tokens (model + environment); a trajectory that reaches one ends (status
truncated, counted). An environment call that raises or times out ends only its trajectory (reward 0, counted);
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
from typing import Any

import numpy as np

from topp_rl.data import PromptRecord, SamplingParams
from topp_rl.data.sample import Sample
from topp_rl.engines.base import RolloutEngine
from topp_rl.rollout.step import RolloutStep, Stats
from topp_rl.rollout.trajectory import (
    END_ABORTED,
    FAIL_ERROR,
    FAIL_TIMEOUT,
    Trajectory,
    check_failed_share,
    check_step_settings,
    score_trajectories,
    trajectory_stats,
)
from topp_rl.tasks import Task
from topp_rl.tasks.environment import Environment, EnvTimeout, call_env, reward_value


class AgentLoopStep(RolloutStep):
    def __init__(self, *, environment: Environment, max_turns: int, max_trajectory_tokens: int,
                 env_timeout_s: float = 30.0, max_failed_frac: float = 0.5) -> None:
        if not isinstance(environment, Environment):
            raise TypeError(f"environment is a {type(environment).__name__}; pass a topp_rl.tasks.environment."
                            "Environment (an object with start(record) -> Episode; in config: "
                            "rollout.step.environment._target_)")
        check_step_settings(max_turns=max_turns, max_trajectory_tokens=max_trajectory_tokens,
                            max_failed_frac=max_failed_frac)
        if not env_timeout_s > 0:
            raise ValueError(f"rollout.step.env_timeout_s={env_timeout_s} must be > 0 (seconds per environment call)")
        self.environment, self.max_turns, self.max_tokens = environment, max_turns, max_trajectory_tokens
        self.env_timeout_s, self.max_failed_frac = env_timeout_s, max_failed_frac

    # ----- generate: rounds of one engine call, then the episodes -----
    def generate(self, engine: RolloutEngine, records: list[PromptRecord], params: SamplingParams, *,
                 seed: int | None, tokenizer: Any) -> list[Sample]:
        # The rounds' count differs between DP ranks: an engine whose generate is a collective (FSDP's shared,
        # sharded module) gathers once for the step instead.
        with engine.holding_weights():
            return _run(self._generate(engine, records, params, seed=seed, tokenizer=tokenizer))

    async def _generate(self, engine, records, params, *, seed, tokenizer) -> list[Sample]:
        trajs = [Trajectory(record=r, samples=[Sample(prompt_ids=r.prompt_ids)]) for r in records
                 for _ in range(params.n)]
        await asyncio.gather(*(self._guard(t, self._start(t)) for t in trajs))
        turn = dataclasses.replace(params, n=1)
        rounds = 0
        while waiting := [t for t in trajs if t.live]:
            sent = [t.sample.tokens for t in waiting]
            outs = engine.generate(sent, turn, seed=_round_seed(seed, rounds))
            rounds += 1
            jobs = []
            for t, ids, out in zip(waiting, sent, outs, strict=True):
                model_turn = t.add_model_turn(out, ids, max_tokens=self.max_tokens, tokenizer=tokenizer)
                if model_turn is not None:
                    jobs.append(self._guard(t, self._respond(t, model_turn, tokenizer, engine.vocab_size)))
            await asyncio.gather(*jobs)
        await asyncio.gather(*(self._guard(t, self._reward(t)) for t in trajs
                               if t.episode is not None and not t.failed and t.end != END_ABORTED))
        return [s for i, t in enumerate(trajs) for s in t.finish(trajectory=i)]

    async def _start(self, t: Trajectory) -> None:
        t.episode = await call_env(self.environment.start, t.record, timeout_s=self.env_timeout_s)

    async def _respond(self, t: Trajectory, turn, tokenizer, vocab_size: int) -> None:
        output = await call_env(t.episode.respond, turn, timeout_s=self.env_timeout_s)
        t.add_env_output(output, max_turns=self.max_turns, max_tokens=self.max_tokens, tokenizer=tokenizer,
                         vocab_size=vocab_size)

    async def _reward(self, t: Trajectory) -> None:
        t.reward, t.reward_info = reward_value(await call_env(t.episode.reward, timeout_s=self.env_timeout_s))

    @staticmethod
    async def _guard(t: Trajectory, job) -> None:
        """Run one environment job; its timeout or exception ends only this trajectory (reward 0)."""
        try:
            await job
        except EnvTimeout as e:
            t.fail(FAIL_TIMEOUT, str(e))
        except Exception as e:  # any error of the environment's code: counted, never fatal on its own
            t.fail(FAIL_ERROR, f"{type(e).__name__}: {e}")

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
