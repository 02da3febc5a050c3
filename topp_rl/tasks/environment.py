"""The environment of a multi-turn agent rollout (`topp_rl.rollout.agent_step.AgentLoopStep`).

An `Environment` starts one `Episode` per trajectory from a dataset record. The agent loop then alternates:
the model writes a turn (`ModelTurn`: its exact token ids and their text), the episode answers it with
environment output - text (tokenised once by the loop) or token ids (appended as they are) - or ends the
trajectory with `None`. When the trajectory has ended (by the episode, or by a budget) the loop asks the
episode for its reward: a float, or a mapping with a float `score` (its other entries are kept in the sample's
metadata). Every method may be a plain function or an `async def`: async ones run on the loop's event loop,
sync ones on a thread of their own, each call bounded by the loop's timeout.

Environment tokens are context, never trained on: they get loss mask 0 (docs/agents.md).
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from topp_rl.data.prompt import PromptRecord

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


class EnvTimeout(Exception):
    """An environment call ran past its timeout."""


async def call_env(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """`fn(*args)` bounded by `timeout_s`: awaited when it is `async def`, else run on a daemon worker thread
    (`_WORKERS`); past the timeout the awaiting coroutine gives up and the call is left behind."""
    if inspect.iscoroutinefunction(fn):
        try:
            return await asyncio.wait_for(fn(*args), timeout_s)
        except TimeoutError as e:
            raise EnvTimeout(f"{_name(fn)} took longer than {timeout_s} s") from e
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
        except BaseException as e:  # handed to the awaiting coroutine, which decides
            post(future.set_exception, e)
        else:
            post(future.set_result, result)

    _WORKERS.submit(work)
    try:
        return await asyncio.wait_for(future, timeout_s)
    except TimeoutError as e:
        raise EnvTimeout(f"{_name(fn)} took longer than {timeout_s} s") from e


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
    """(score, other entries) of an episode's reward."""
    if isinstance(reward, Mapping):
        if "score" not in reward:
            raise ValueError(f"an episode's reward mapping {dict(reward)!r} has no 'score'; return a float, or "
                             "a mapping with a float 'score'")
        return float(reward["score"]), {k: v for k, v in reward.items() if k != "score"}
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise ValueError(f"an episode's reward is a {type(reward).__name__} ({reward!r}); return a float, or a "
                         "mapping with a float 'score'")
    return float(reward), {}


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)
