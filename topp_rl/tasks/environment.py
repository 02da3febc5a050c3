"""The environment of a multi-turn agent rollout (`topp_rl.rollout.agent_step.AgentLoopStep`).

An `Environment` starts one `Episode` per trajectory from a dataset record. The agent loop then alternates:
the model writes a turn (`ModelTurn`: its exact token ids and their text), the episode answers it with
environment output - text (tokenised once by the loop) or token ids (appended as they are) - or ends the
trajectory with `None`. When the trajectory has ended (by the episode, or by a budget) the loop asks the
episode for its reward: a float, or a mapping with a float `score` (its other entries are kept in the sample's
metadata). Every method may be a plain function or an `async def`: async ones run on an event loop of the step's
own (`EnvLoop`, a thread), sync ones on worker threads, each call bounded by the loop's timeout. Whatever goes
wrong in the environment's code is an `EnvFault` of a kind (`FAULT_KINDS`, `TIMEOUT`) that ends only its
trajectory; no signal is delivered off the main thread, so a KeyboardInterrupt raised there is the code's own.

Environment tokens are context, never trained on: they get loss mask 0 (docs/agents.md).
An environment is named in config like a reward function or an agent: `pkg.mod:Class` or `path/to/file.py:Class`
(`resolve_environment`, built with no arguments), or a `_target_` node with its arguments.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from omegaconf import DictConfig, OmegaConf

from topp_rl.data.prompt import PromptRecord
from topp_rl.tasks.reward_import import resolve_reward_fn
from topp_rl.tasks.rewards import reward_number, shown_reward

EnvOutput = str | Sequence[int] | None  # text, token ids, or None: the trajectory ends here
EnvReward = float | Mapping[str, Any]  # a float, or {"score": float, ...}


@dataclass(frozen=True, kw_only=True)
class ModelTurn:
    index: int  # 0 for the model's first turn
    ids: list[int]  # the exact ids the engine sampled
    text: str  # `ids` decoded (special tokens skipped)
    finished: bool  # ended on a stop id; False: cut by max_new_tokens


@runtime_checkable
class Episode(Protocol):
    """One trajectory's environment state. Either method may be `async def`."""

    def respond(self, turn: ModelTurn) -> EnvOutput | Awaitable[EnvOutput]: ...

    def reward(self) -> EnvReward | Awaitable[EnvReward]: ...


@runtime_checkable
class Environment(Protocol):
    """Starts an `Episode` per trajectory (`start` may be `async def`); lives for the whole run."""

    def start(self, record: PromptRecord) -> Episode | Awaitable[Episode]: ...


ENVIRONMENT_KEY = "rollout.step.environment"


def check_environment_config(step: Mapping[str, Any]) -> None:
    """At start, before any model loads: the agent loop's `environment` (a `rollout.step` config node) is set, and a
    named one imports (it is built with the step). A `_target_` node is checked with every other `_target_`."""
    missing = isinstance(step, DictConfig) and OmegaConf.is_missing(step, "environment")
    spec = "???" if missing else step.get("environment", "???")
    if spec == "???":
        raise ValueError(f"config {ENVIRONMENT_KEY}='???': must be an environment (a class with start(record) -> "
                         "Episode, topp_rl/tasks/environment.py); use a task that brings its environment "
                         f"(task=lookup), or set {ENVIRONMENT_KEY}=path/to/env.py:Class (or pkg.mod:Class)")
    if isinstance(spec, str):
        resolve_reward_fn(spec, key=ENVIRONMENT_KEY)


def resolve_environment(spec: str, *, key: str = ENVIRONMENT_KEY) -> Environment:
    """`pkg.mod:Class` or `path/to/file.py:Class` (a relative path from the working directory, as for rewards and
    agents) -> the environment, built with no arguments; refused naming `key` when it does not import, does not
    build or has no `start(record)`."""
    if not spec or spec == "???":
        raise ValueError(f"config {key}={spec!r}: must name an environment class, pkg.mod:Class or "
                         "path/to/file.py:Class (start(record) -> Episode; docs/agents.md)")
    factory = resolve_reward_fn(spec, key=key)
    try:
        environment = factory()
    except Exception as e:
        raise ValueError(f"config {key}={spec!r}: building it with no arguments raised {describe(e)}; give its "
                         f"arguments defaults, or name it in a task config as {key}: {{_target_: pkg.mod.Class, "
                         "<argument>: <value>}") from e
    if not isinstance(environment, Environment):
        raise ValueError(f"config {key}={spec!r} built a {type(environment).__name__}, which has no start(record); "
                         "an environment's start(record) returns an Episode (respond(turn), reward()): "
                         "docs/agents.md")
    return environment


# Faults of user code (an environment's or an agent's), each ending only its trajectory, counted per kind
# (`rollout/env_errors/<kind>`; a timeout in `rollout/env_timeouts`):
EXCEPTION = "exception"  # it raised (any exception, SystemExit / KeyboardInterrupt / GeneratorExit included)
BAD_RETURN = "bad_return"  # `start` returned no Episode, or `respond` something other than text, token ids or None
BAD_REWARD = "bad_reward"  # a reward / score that is not a finite number within the cap (`reward_number`)
FOREIGN_TRAJECTORY = "foreign_trajectory"  # an agent's client sent a request to another trajectory's URL
NO_REQUEST = "no_request"  # an agent returned without asking the endpoint
BAD_REQUEST = "bad_request"  # an agent failed after the endpoint refused its request (HTTP 400: what it asked)
FAULT_KINDS = (EXCEPTION, BAD_RETURN, BAD_REWARD, FOREIGN_TRAJECTORY, NO_REQUEST, BAD_REQUEST)
TIMEOUT = "timeout"  # a call ran past its timeout


class EnvFault(Exception):
    """User code in an environment or an agent failed (`kind`: one of `FAULT_KINDS`, or `TIMEOUT`). An Exception
    whatever the user's code raised, so that nothing but a real signal leaves the step as a BaseException."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class EnvTimeout(EnvFault):
    """An environment call ran past its timeout."""

    def __init__(self, message: str) -> None:
        super().__init__(TIMEOUT, message)


def raised(fn: Callable[..., Any], error: BaseException) -> EnvFault:
    """The fault of `fn` raising `error`: user code runs on threads other than the main one, where no signal is
    delivered, so a KeyboardInterrupt or SystemExit there is the code's own."""
    return EnvFault(EXCEPTION, f"{_name(fn)} raised {describe(error)}")


def describe(error: BaseException) -> str:
    """`KeyError: 'x'`, or the bare type when the error has no message (`KeyboardInterrupt`)."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


async def contained(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """`await fn(*args)` with whatever it raises as an `EnvFault`: asyncio re-raises a task's KeyboardInterrupt /
    SystemExit out of the event loop itself, so they are turned into a fault before they reach the task. A
    cancellation of this call (its timeout) goes through, and so does GeneratorExit: it is also how a coroutine is
    closed (the awaiting side turns the code's own into a fault, `faulted`)."""
    try:
        return await fn(*args)
    except GeneratorExit:
        raise
    except BaseException as e:
        if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
            raise
        raise raised(fn, e) from e


@contextlib.contextmanager
def faulted(fn: Callable[..., Any]) -> Iterator[None]:
    """Around the await of a `contained` call: a GeneratorExit it raised (the code's own) becomes its fault."""
    try:
        yield
    except GeneratorExit as e:
        raise raised(fn, e) from e


class EnvLoop:
    """A step's event loop for async environment methods, on a daemon thread of its own (started at the first
    call): the step's loop waits on each call with its timeout, so an async method that blocks its loop (a sync
    sleep in an `async def`) times out its calls instead of the step; the blocked thread is left behind (`close`).
    A SystemExit / KeyboardInterrupt raised in a task the environment's code started stops the loop (asyncio lets
    them out of it): the calls in flight fail with it, and the next call gets a new loop."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[concurrent.futures.Future, Coroutine] = {}  # in flight on `loop`, with their coroutines
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> asyncio.Future:
        """`fn(*args)` on this loop, as a future of the calling loop."""
        with self._lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self._serve, args=(self.loop,), name="topp_rl-env-loop", daemon=True).start()
            coro = contained(fn, *args)
            call = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._calls[call] = coro
        calls = self._calls
        call.add_done_callback(lambda done: calls.pop(done, None))
        return asyncio.wrap_future(call)

    def close(self) -> None:
        """Stop the loop once it is free (now, unless a call blocks it; a blocked thread stays behind)."""
        with self._lock:
            if self.loop is not None and not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self.loop.stop)

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        except BaseException as e:  # out of a task the environment's code started
            self._lost(loop, e)
            return
        tasks = asyncio.all_tasks(loop)  # the calls that timed out: cancelled, let unwind
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()

    def _lost(self, loop: asyncio.AbstractEventLoop, error: BaseException) -> None:
        """The stopped loop's calls fail; its coroutines are closed now (never run or left suspended, they would
        warn whenever they are collected)."""
        with self._lock:
            if self.loop is loop:
                self.loop = None
            calls, self._calls = list(self._calls.items()), {}
        for call, _ in calls:
            if not call.done():
                call.set_exception(EnvFault(EXCEPTION, f"the environment's event loop stopped on {describe(error)}, "
                                            "raised in a task its code started (every async call in flight fails)"))
        for coro in [c for _, c in calls] + [task.get_coro() for task in asyncio.all_tasks(loop)]:
            try:
                coro.close()
            except BaseException:  # the code's own, while it unwinds: nothing is waiting for it
                pass
        loop.close()


async def call_env(fn: Callable[..., Any], *args: Any, timeout_s: float, loop: EnvLoop, key: str) -> Any:
    """`fn(*args)` bounded by `timeout_s` (named by the config `key` in the message): on `loop` when it is
    `async def`, else on a daemon worker thread (`_WORKERS`); past the timeout the call is left behind. Whatever
    the call raises comes back as an `EnvFault`."""
    if inspect.iscoroutinefunction(fn):
        future, hint = loop.submit(fn, *args), (" (an async method that blocks its event loop, e.g. with time.sleep "
                                                "or sync I/O, stalls every async call of the step)")
    else:
        future, hint = _on_worker(fn, *args), ""
    try:
        with faulted(fn):
            return await asyncio.wait_for(future, timeout_s)
    except TimeoutError as e:
        raise EnvTimeout(f"{_name(fn)} took longer than {key}={timeout_s} s{hint}") from e


def _on_worker(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """`fn(*args)` on a worker thread, as a future of the calling loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():  # it may have timed out (and been cancelled) meanwhile
            setter(value)

    def post(setter: Callable[[Any], None], value: Any) -> None:
        try:
            loop.call_soon_threadsafe(deliver, setter, value)
        except RuntimeError:  # the loop has closed: the call timed out and its step is over
            pass

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # the code's own, whatever it is (no signal reaches this thread)
            post(future.set_exception, raised(fn, e))
        else:
            post(future.set_result, result)

    _WORKERS.submit(work)
    return future


class _Workers:
    """Daemon threads for sync environment calls, reused: a call goes to an idle worker, or to a new one when none
    is idle. Not a fixed pool: a call that hangs cannot be stopped, and in a pool it would hold a worker for good
    (and the interpreter would wait for it at exit); here it holds only its own daemon thread, left behind. Not a
    thread per call either: 16 threads starting at once were a visible share of a step of cheap turns on this
    2-core machine (docs/agents.md "Speed")."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle:  # an idle worker is (or is about to be) waiting on the queue
                self._idle -= 1
                self._jobs.put(job)
                return
        threading.Thread(target=self._work, args=(job,), name="topp_rl-env", daemon=True).start()

    def _work(self, job: Callable[[], None]) -> None:
        while True:
            job()  # never raises: `work` hands every outcome to its future
            with self._lock:
                self._idle += 1
            job = self._jobs.get()


_WORKERS = _Workers()


def reward_value(reward: EnvReward) -> tuple[float, dict[str, Any]]:
    """(score, other entries) of an episode's reward or an agent's return value: a number, or a mapping with a
    number under 'score'; an `EnvFault` (bad_reward) naming the rule it breaks otherwise (`reward_number`)."""
    score, info = reward, {}
    if isinstance(reward, Mapping):
        if "score" not in reward:
            raise EnvFault(BAD_REWARD, f"the reward mapping {dict(reward)!r:.200} has no 'score'; return a number, "
                           "or a mapping with a number under 'score'")
        score, info = reward["score"], {k: v for k, v in reward.items() if k != "score"}
    try:
        return reward_number(score), info
    except ValueError as e:
        what = "the reward's 'score'" if isinstance(reward, Mapping) else "the reward"
        raise EnvFault(BAD_REWARD, f"{what} is {shown_reward(score)}: {e}; return a finite number, or a mapping "
                       "with one under 'score'") from None


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)
