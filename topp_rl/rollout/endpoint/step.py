"""`EndpointStep`: the rollout step that runs agent code against an OpenAI-compatible endpoint (config
`rollout/step=endpoint`, selected by `task=agent`), a `RolloutStep`.

Per step: the `n` trajectories of every record, each with its own base URL on one `EndpointServer` (127.0.0.1, a
free port); the agent function (`topp_rl.tasks.agent_task.resolve_agent`) is called once per trajectory with an
`openai.AsyncOpenAI` client pointed at it, all concurrently, and its return value is the trajectory's reward.
Requests are batched into the engine by `TurnBatcher` (a round when every live trajectory has a request waiting).

The agents run on an event loop of their own, on a daemon thread, and the server on the step's loop: an agent
that blocks its loop (a sync sleep in an `async def`) cannot stall the server, and the step stops waiting for
the agents `agent_timeout_s` + `GRACE_S` after they started, failing those still running (timeout). Each agent
call is bounded by `agent_timeout_s` (engine time included). An agent that raises (anything: SystemExit and
KeyboardInterrupt included, even from a task of its own, which stops the agents' loop), times out, returns no
finite number within the reward cap, never asks the endpoint, or sends a request to another trajectory's URL
fails its trajectory (reward 0, counted by kind in `rollout/env_errors/<kind>`, in `rollout/env_timeouts`, and in
`rollout/trajectories_failed`, the message in the first sample's `metadata["env_error"]`); its model tokens still
train (with reward 0), as in the agent loop. An agent that fails after the endpoint refused one of its requests
(HTTP 400: a temperature other than the run's, an unknown key) fails as `bad_request`. More than
`max_failed_frac` of a step's trajectories failing raises. An engine failure raises.

The console hears once per run of what the agent code may not see: the first refused request (what to send
instead), the first `max_tokens` served capped at the run's `max_new_tokens`, and a step where more than
`PREFIX_BREAK_WARN_FRAC` of the trajectories split (their requests did not extend the previous ids: usually a
chat template that re-renders the history).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import secrets
import ssl
import threading
from typing import Any

import httpx

from topp_rl.data import PromptRecord, SamplingParams
from topp_rl.data.sample import Sample
from topp_rl.engines.base import RolloutEngine
from topp_rl.rollout.endpoint.batcher import TurnBatcher
from topp_rl.rollout.endpoint.server import CLIENT_HEADER, EndpointServer
from topp_rl.rollout.step import RolloutStep, Stats
from topp_rl.rollout.trajectory import (
    END_ENV,
    FAIL_ERROR,
    FAIL_TIMEOUT,
    Trajectory,
    check_context,
    check_failed_share,
    check_step_settings,
    score_trajectories,
    trajectory_stats,
)
from topp_rl.tasks import Task
from topp_rl.tasks.agent_task import resolve_agent
from topp_rl.tasks.environment import (
    BAD_REQUEST,
    EXCEPTION,
    NO_REQUEST,
    TIMEOUT,
    EnvFault,
    contained,
    describe,
    faulted,
    reward_value,
)

GRACE_S = 10.0  # past agent_timeout_s, how long the step waits for an agent loop that does not answer at all
API_KEY = "topp-rl"  # the endpoint checks none; the SDK wants one
# A step where more than this share of trajectories split into several samples warns (once per run): each split
# trains correctly, but re-encodes the history as prompt, so a template that re-renders it costs every turn.
PREFIX_BREAK_WARN_FRAC = 0.5
PREFIX_BREAK = "prefix_breaks"

log = logging.getLogger(__name__)


class EndpointStep(RolloutStep):
    def __init__(self, *, agent: str, max_turns: int, max_trajectory_tokens: int, agent_timeout_s: float = 120.0,
                 max_failed_frac: float = 0.5) -> None:
        self.agent, self.agent_fn = agent, resolve_agent(agent, key="rollout.step.agent")
        check_step_settings(max_turns=max_turns, max_trajectory_tokens=max_trajectory_tokens,
                            max_failed_frac=max_failed_frac, timeout=("agent_timeout_s", agent_timeout_s))
        self.max_turns, self.max_tokens = max_turns, max_trajectory_tokens
        self.agent_timeout_s, self.max_failed_frac = agent_timeout_s, max_failed_frac
        self.noticed: set[str] = set()  # the kinds of notice the console has had this run (one line each)
        # Imported by the step, not at start: W&B advertises Weave to every run that has imported openai. The SDK
        # loads openai.resources on a client's first call: seconds, paid here.
        importlib.import_module("openai.resources")

    def generate(self, engine: RolloutEngine, records: list[PromptRecord], params: SamplingParams, *,
                 seed: int | None, tokenizer: Any) -> list[Sample]:
        if engine.records_routes:
            raise ValueError("the endpoint does not merge MoE routes across turns; set rollout.record_routes=false "
                             "(and rollout.routing_replay=false) for a multi-turn MoE run")
        check_context(max_trajectory_tokens=self.max_tokens, context=engine.max_context)
        return asyncio.run(self._generate(engine, records, params, seed=seed, tokenizer=tokenizer))

    async def _generate(self, engine, records, params, *, seed, tokenizer) -> list[Sample]:
        trajs = [Trajectory(record=r) for r in records for _ in range(params.n)]
        batcher = TurnBatcher(engine, dataclasses.replace(params, n=1), trajectories=len(trajs), seed=seed)
        # Each trajectory's client sends its own token: a request sent to another trajectory's URL is seen.
        tokens = [secrets.token_hex(8) for _ in trajs]
        server = EndpointServer(trajs, batcher, tokenizer=tokenizer, params=params, vocab_size=engine.vocab_size,
                                max_turns=self.max_turns, max_trajectory_tokens=self.max_tokens,
                                context=engine.max_context, client_tokens=tokens, notice=self._notice)
        await server.start()
        try:
            await self._run_agents(trajs, server, batcher, tokens)
        finally:
            await server.stop()
        if batcher.engine_error is not None:
            raise batcher.engine_error
        samples = []
        for i, t in enumerate(trajs):
            mine = t.finish(trajectory=i)
            mine[0].metadata |= {"bad_requests": len(server.refusals.get(i, ())), "capped_requests":
                                 server.capped.get(i, 0)}
            samples += mine
        self._check_prefix_breaks(trajs)
        return samples

    # ----- what the console hears, once per run -----
    def _notice(self, kind: str, message: str) -> None:
        if kind in self.noticed:
            return
        self.noticed.add(kind)
        if kind == BAD_REQUEST:
            log.warning("the agent endpoint refused a request of %s (HTTP 400): %s (printed once; later refusals are "
                        "counted in rollout/bad_requests, and a trajectory whose agent failed on one in "
                        "rollout/env_errors/bad_request)", self.agent, message)
        else:
            log.warning("%s", message)

    def _check_prefix_breaks(self, trajs: list[Trajectory]) -> None:
        split = sum(t.prefix_breaks > 0 for t in trajs)
        if trajs and split > PREFIX_BREAK_WARN_FRAC * len(trajs):
            self._notice(PREFIX_BREAK, f"{split} of {len(trajs)} trajectories this step split into several samples "
                         "(rollout/prefix_breaks): a request's prompt ids did not extend the previous prompt + "
                         "completion, most likely because a chat template re-renders the history differently from the "
                         "ids sampled (it drops reasoning or special tokens). Each split trains correctly but "
                         "re-encodes the history as prompt; to keep a trajectory in one sample, send token ids to "
                         "/v1/completions (prompt = the previous prompt_token_ids + completion_token_ids + the new "
                         "ids), or use a template that renders earlier turns unchanged")

    # ----- the agents, on a loop of their own -----
    async def _run_agents(self, trajs: list[Trajectory], server: EndpointServer, batcher: TurnBatcher,
                          tokens: list[str]) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        stopped: list[BaseException] = []

        def settle(i: int, kind: str, value: Any) -> None:  # called from the agents' thread
            _post(loop, self._settle, trajs[i], i, kind, value, batcher, server.refusals)

        def work() -> None:
            try:
                asyncio.run(self._agents(trajs, server, settle, tokens))
            except BaseException as e:  # agent code's SystemExit / KeyboardInterrupt in a task of its own (asyncio
                stopped.append(e)  # lets them out of the loop); no signal reaches this thread
            finally:
                _post(loop, lambda: done.done() or done.set_result(None))

        threading.Thread(target=work, name="topp-rl-agents", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), self.agent_timeout_s + GRACE_S)
        except TimeoutError:  # the agents' loop is blocked: fail whoever is still running, leave the thread behind
            for i, t in enumerate(trajs):
                if i in batcher.live:
                    self._settle(t, i, TIMEOUT, f"the agents' event loop did not answer within "
                                 f"rollout.step.agent_timeout_s={self.agent_timeout_s} + {GRACE_S} s (a blocking call "
                                 f"inside an async agent function, {self.agent}, stalls every agent of the step)",
                                 batcher, server.refusals)
        for i, t in enumerate(trajs):  # the agents' loop stopped before these settled
            if i in batcher.live:
                cause = describe(stopped[0]) if stopped else "no outcome"
                self._settle(t, i, EXCEPTION, f"the agent {self.agent}'s event loop stopped ({cause})", batcher,
                             server.refusals)

    async def _agents(self, trajs: list[Trajectory], server: EndpointServer, settle, tokens: list[str]) -> None:
        # A connection pool per trajectory: httpcore matches each request against every connection of its pool, so
        # one pool shared by hundreds of trajectories costs more than the engine (measured: 5 s a round at 128);
        # one shared TLS context makes a client cheap (0.2 ms instead of 44 ms for a fresh one, though no TLS is
        # used on 127.0.0.1).
        tls = ssl.create_default_context()
        await asyncio.gather(*(self._agent(i, t.record, server.base_url(i), tls, settle, tokens[i])
                               for i, t in enumerate(trajs)))

    async def _agent(self, i: int, record: PromptRecord, base_url: str, tls: ssl.SSLContext, settle,
                     token: str) -> None:
        async with httpx.AsyncClient(verify=tls, timeout=self.agent_timeout_s, headers={CLIENT_HEADER: token}) as http:
            openai = importlib.import_module("openai")  # loaded in __init__; not at start (see there)
            client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, http_client=http, max_retries=0)
            try:
                with faulted(self.agent_fn):
                    value = await asyncio.wait_for(contained(self.agent_fn, client, record), self.agent_timeout_s)
            except TimeoutError:
                settle(i, TIMEOUT, f"the agent {self.agent} took longer than rollout.step.agent_timeout_s="
                       f"{self.agent_timeout_s} s")
            except EnvFault as e:  # whatever the agent raised, SystemExit and KeyboardInterrupt included: counted
                settle(i, e.kind, f"the agent {self.agent} raised {describe(e.__cause__)}")
            else:
                settle(i, "ok", value)

    def _settle(self, t: Trajectory, i: int, kind: str, value: Any, batcher: TurnBatcher,
                refusals: dict[int, list[str]]) -> None:
        """Record trajectory i's outcome (on the server's loop, where every state change happens); an agent that
        raised after a request of its was refused (400) failed on that request (`refusals`: the server's)."""
        if i not in batcher.live:
            return
        if kind == EXCEPTION and refusals.get(i):
            kind, value = BAD_REQUEST, f"the agent {self.agent} raised on the endpoint's HTTP 400: {refusals[i][0]}"
        if kind == "ok":
            try:
                t.reward, t.reward_info = reward_value(value)
            except EnvFault as e:
                kind, value = e.kind, f"the agent {self.agent} returned {value!r:.200}: {e}"
            if kind == "ok" and not t.samples:
                kind, value = NO_REQUEST, f"the agent {self.agent} returned without a request to the endpoint"
        if kind != "ok":
            if t.live:
                t.fail(kind, str(value))
            else:  # ended by a budget (refused request): truncated, reward 0, the message kept
                t.error, t.reward = str(value), 0.0
        elif t.live:
            t.end = END_ENV
        batcher.retire(i)

    def check(self, samples: list[Sample], *, reduce_sum=None) -> None:
        """Raise when more than `max_failed_frac` of the step's trajectories failed (on every rank alike)."""
        check_failed_share(samples, max_failed_frac=self.max_failed_frac, reduce_sum=reduce_sum,
                           fix=self._fix(samples))

    def _fix(self, samples: list[Sample]) -> str:
        """The advice for the first failure (the one the message shows): its kind says what to change."""
        kind = next((s.metadata.get("env_error_kind") for s in samples if s.metadata["trajectory_sample"] == 0
                     and s.metadata["end"] in (FAIL_ERROR, FAIL_TIMEOUT)), None)
        if kind == BAD_REQUEST:
            return (f"fix the agent {self.agent}'s requests: send what the endpoint serves (the run's sampling "
                    "settings: leave temperature / top_p / top_k / min_p out, or send the run's; keys it knows), as "
                    "the 400's message says")
        if kind == TIMEOUT:
            return (f"fix the agent {self.agent}, or raise rollout.step.agent_timeout_s={self.agent_timeout_s} if it "
                    "is just slow")
        return f"fix the agent {self.agent}"

    def stats(self, samples: list[Sample]) -> Stats:
        """The multi-turn figures, and the endpoint's own per step (of a rank): refused requests (400) and
        requests served below the max_tokens they asked."""
        firsts = [s.metadata for s in samples if s.metadata["trajectory_sample"] == 0]
        return trajectory_stats(samples) | {
            "rollout/bad_requests": (float(sum(m.get("bad_requests", 0) for m in firsts)), 1.0),
            "rollout/max_tokens_capped": (float(sum(m.get("capped_requests", 0) for m in firsts)), 1.0),
        }

    # ----- score: the agents' rewards -----
    def score(self, samples: list[Sample], records: list[PromptRecord], params: SamplingParams, *, task: Task,
              tokenizer: Any, first_group: int = 0) -> list[Sample]:
        score_trajectories(samples, records, n=params.n, first_group=first_group)
        return samples


def _post(loop: asyncio.AbstractEventLoop, fn, *args: Any) -> None:
    """`fn(*args)` on the step's loop, from the agents' thread; dropped when the step is over (a blocked agents'
    loop that woke up after the step stopped waiting for it)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop has closed
        pass
