"""`task=agent`: prompts from a data file (the keys of `task=dataset`) for agent code that talks to the run through
its OpenAI-compatible endpoint (`topp_rl.rollout.endpoint`, docs/agents.md).

The agent is `async def fn(client, record) -> float | {"score": float, ...}`, named `pkg.mod:fn` or
`path/to/file.py:fn` (`task.agent`); it is called once per trajectory with an `openai.AsyncOpenAI` client pointed
at the endpoint and the trajectory's `PromptRecord` (`record.text`, `record.answer`, `record.data`: the row), and
what it returns is the trajectory's reward. `resolve_agent` refuses at start a name that does not import or a
function that is not `async def`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from topp_rl.data import PromptRecord
from topp_rl.tasks.datasets import DatasetTask
from topp_rl.tasks.reward_import import resolve_reward_fn
from topp_rl.tasks.rewards import RewardSet, RewardTerm

AgentFn = Callable[[Any, PromptRecord], Any]  # async (openai.AsyncOpenAI, record) -> float | {"score": ...}


def resolve_agent(spec: str, *, key: str = "task.agent") -> AgentFn:
    """`pkg.mod:fn` or `path/to/file.py:fn` -> the agent function, refused unless it is `async def`."""
    if not spec or spec == "???":
        raise ValueError(f"config {key}={spec!r}: must name an agent function, pkg.mod:fn or path/to/file.py:fn "
                         "(async def fn(client, record) -> float | dict); e.g. "
                         "task.agent=topp_rl.tasks.agents.lookup:lookup_agent")
    fn = resolve_reward_fn(spec, key=key)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"config {key}={spec!r}: must be an `async def` function (client, record) -> float | dict "
                         f"(it is a {type(fn).__name__}); the endpoint runs every trajectory's agent concurrently on "
                         "one event loop")
    return fn


class AgentTask(DatasetTask):
    """A `DatasetTask` whose reward is the agent's return value (`rollout/step=endpoint` reads `agent`)."""

    def __init__(self, *, agent: str, reward_fn: str | None = None, rewards: list[Any] | None = None,
                 **kwargs: Any) -> None:
        if reward_fn is not None or rewards:
            raise ValueError(f"config task.reward_fn={reward_fn!r} / task.rewards={rewards!r}: must be unset with "
                             "task=agent (the agent function's return value is the reward); return the score from "
                             f"{agent}")
        self.agent, self.agent_fn = agent, resolve_agent(agent)
        super().__init__(reward_fn=f"{__name__}:agent_reward", **kwargs)
        self.init_args = {k: v for k, v in self.init_args.items() if k != "reward_fn"} | {"agent": agent}
        self.reward_set = RewardSet([RewardTerm(name="agent", fn=agent_reward)])
        self.reward_name = "agent"

    def describe(self) -> str:
        return f"{super().describe()} through the agent {self.agent}"


def agent_reward(response: str, record: PromptRecord) -> float:
    """What a single-turn step would call for this task's reward: refused, the agent's return value is the reward."""
    raise ValueError("task=agent has no reward of a single response: the agent function's return value is the "
                     "reward; run it with rollout/step=endpoint (conf/task/agent.yaml selects it)")
