"""Faults of an environment's code in the agent loop (`topp_rl.rollout.agent_step.AgentLoopStep`), with the real tiny
model and the embedded engine: whatever the code does wrong (raises anything, SystemExit and KeyboardInterrupt
included; returns a bad reward or a bad answer; blocks its event loop) ends only its trajectory, counted by kind,
and `max_failed_frac` sees it; a real Ctrl-C still reaches the run. A trajectory that reaches the model's context
ends truncated, and a budget the context cannot hold is refused."""

import asyncio
import math
import os
import signal
import threading
import types

import pytest
from helpers import compose_cfg, metric_columns
from test_agent_loop import FailingStart

from topp_rl.data import SamplingParams
from topp_rl.data.sample import SampleStatus
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.rollout.agent_step import AgentLoopStep
from topp_rl.rollout.trajectory import check_context
from topp_rl.run.stop import StopOnSignal
from topp_rl.tasks.environment import FAULT_KINDS
from topp_rl.tasks.lookup import LookupEnvironment, LookupTask
from topp_rl.train import train

TOK = build_char_tokenizer()
ONE = SamplingParams(top_p=0.9, max_new_tokens=3, n=1)


@pytest.fixture(scope="module")
def engine():
    return EmbeddedEngine(build_tiny_model(tokenizer=TOK, seed=3, initializer_range=0.3), progress=False)


def records(count: int):
    task = LookupTask()
    return [task.prompt(i, TOK) for i in range(count)]


class Episode:
    """Answers "=1;" once, then ends; reward 1. `respond` / `reward` replaced per fault."""

    def __init__(self) -> None:
        self.turns = 0

    def respond(self, turn):
        self.turns += 1
        return "=1;" if self.turns == 1 else None

    def reward(self):
        return 1.0


class FaultyEpisode(Episode):
    """Does `fault` wrong (a key of FAULTS) in `respond` or `reward`."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def respond(self, turn):
        match self.fault:
            case "exit":
                raise SystemExit(3)
            case "interrupt":
                raise KeyboardInterrupt
            case "generator_exit":
                raise GeneratorExit
            case "dict":
                return {"a": 1}
            case "bytes":
                return b"=1;"
            case "floats":
                return [1.5, 2]
        return super().respond(turn)

    def reward(self):
        return {"nan": float("nan"), "inf": float("inf"), "huge": 1e300, "score_none": {"score": None},
                "score_list": {"score": [1]}}.get(self.fault, 1.0)


class AsyncFaultyEpisode(FaultyEpisode):
    async def respond(self, turn):
        if self.fault == "async_exit":
            raise SystemExit("bye")
        if self.fault == "async_cancelled":  # the code's own, not a cancellation of the call
            raise asyncio.CancelledError("stop")
        if self.fault == "async_generator_exit":  # the code's own, not a close of the coroutine
            raise GeneratorExit
        return super().respond(turn)


# record index -> (fault, expected kind, expected message)
FAULTS = {
    0: ("exit", "exception", "FaultyEpisode.respond raised SystemExit: 3"),
    1: ("interrupt", "exception", "FaultyEpisode.respond raised KeyboardInterrupt"),
    2: ("async_exit", "exception", "AsyncFaultyEpisode.respond raised SystemExit: bye"),
    3: ("generator_exit", "exception", "FaultyEpisode.respond raised GeneratorExit"),
    4: ("nan", "bad_reward", "FaultyEpisode.reward: the reward is nan: rewards must be finite; return a finite "
        "number, or a mapping with one under 'score'"),
    5: ("inf", "bad_reward", "FaultyEpisode.reward: the reward is inf: rewards must be finite"),
    6: ("huge", "bad_reward", "FaultyEpisode.reward: the reward is 1e+300: rewards must lie in [-1e+06, 1e+06]"),
    7: ("score_none", "bad_reward", "FaultyEpisode.reward: the reward's 'score' is None (NoneType): a reward must be "
        "a number, not a NoneType"),
    8: ("score_list", "bad_reward", "FaultyEpisode.reward: the reward's 'score' is [1] (list): a reward must be a "
        "number, not a list"),
    9: ("dict", "bad_return", "FaultyEpisode.respond returned {'a': 1} (dict); answer text (a str), token ids (a list "
        "of ints) or None (the trajectory ends)"),
    10: ("bytes", "bad_return", "FaultyEpisode.respond returned b'=1;' (bytes)"),
    11: ("floats", "bad_return", "FaultyEpisode.respond returned [1.5, 2] (list)"),
    12: ("start", "bad_return", "Faulty.start returned 'not an episode' (str); return an Episode"),
    13: ("async_cancelled", "exception", "AsyncFaultyEpisode.respond raised CancelledError: stop"),
    14: ("async_generator_exit", "exception", "AsyncFaultyEpisode.respond raised GeneratorExit"),
}


class Faulty:
    """Record i's episode does FAULTS[i] wrong; records past FAULTS are fine."""

    def start(self, record):
        fault = FAULTS.get(record.index, ("none",))[0]
        if fault == "start":
            return "not an episode"
        return AsyncFaultyEpisode(fault) if fault.startswith("async") else FaultyEpisode(fault)


def test_every_fault_of_environment_code_fails_only_its_trajectory_counted_by_kind(engine):
    recs = records(len(FAULTS) + 2)  # two good records at the end
    step = AgentLoopStep(environment=Faulty(), max_turns=3, max_trajectory_tokens=64, max_failed_frac=1.0)
    samples = step.run(engine, recs, ONE, task=LookupTask(), tokenizer=TOK, seed=0).samples
    assert len(samples) == len(recs)
    for i, s in enumerate(samples):
        if i not in FAULTS:
            assert s.metadata["end"] == "env" and s.reward == 1.0 and "env_error" not in s.metadata
            continue
        _, kind, message = FAULTS[i]
        assert s.metadata["end"] == "env_error" and s.metadata["env_error_kind"] == kind, (i, s.metadata)
        assert s.metadata["env_error"].startswith(message), (i, s.metadata["env_error"])
        # Its model turn still trains, with reward 0 (a trajectory whose start failed has none: aborted).
        assert (s.status, s.reward) == ((SampleStatus.ABORTED, None) if i == 12 else (SampleStatus.COMPLETED, 0.0))
    stats = step.stats(samples)
    counts = {kind: sum(k == kind for _, k, _ in FAULTS.values()) for kind in FAULT_KINDS}
    assert counts == {"exception": 6, "bad_return": 4, "bad_reward": 5, "foreign_trajectory": 0, "no_request": 0,
                      "bad_request": 0}
    for kind in FAULT_KINDS:
        assert stats[f"rollout/env_errors/{kind}"] == (float(counts[kind]), 1.0), kind
    assert stats["rollout/env_errors"] == stats["rollout/trajectories_failed"] == (15.0, 1.0)
    assert stats["rollout/env_timeouts"] == (0.0, 1.0)
    step.max_failed_frac = 0.5
    with pytest.raises(RuntimeError, match=r"^15 of 17 trajectories failed this step \(share 0.88 > rollout.step."
                                           r"max_failed_frac=0.5\); first failure: exception: .*SystemExit: 3"):
        step.check(samples)


class BlocksItsLoop:
    """Record 0's episode answers from an `async def` that blocks its event loop (a sync wait, released at the
    test's end); the others answer at once, from async methods too."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def start(self, record):
        episode, answer = Episode(), Episode.respond
        blocks, release = record.index == 0, self.release

        async def respond(turn):
            if blocks:
                release.wait(60)  # blocks the loop: no await in it
            return answer(episode, turn)

        episode.respond = respond
        return episode


def test_an_async_environment_that_blocks_its_loop_times_out_naming_it(engine):
    release = threading.Event()
    try:
        step = AgentLoopStep(environment=BlocksItsLoop(release), max_turns=3, max_trajectory_tokens=64,
                             env_timeout_s=1.0, max_failed_frac=1.0)
        samples = step.generate(engine, records(2), ONE, seed=0, tokenizer=TOK)
        assert not release.is_set()  # the step ended while the environment still blocked its loop
    finally:
        release.set()
    # The blocked loop held every async call of its round: record 1's answer came from the same loop.
    assert samples[0].metadata["end"] == "env_timeout"
    assert samples[0].metadata["env_error"].startswith(
        "BlocksItsLoop.start.<locals>.respond took longer than rollout.step.env_timeout_s=1.0 s (an async method "
        "that blocks its event loop")
    assert step.stats(samples)["rollout/env_timeouts"][0] >= 1.0
    # The next step has a loop of its own: it runs while the previous one's thread may still be blocked.
    release.clear()
    fine = AgentLoopStep(environment=BlocksItsLoop(release), max_turns=3, max_trajectory_tokens=64, env_timeout_s=30)
    samples = fine.generate(engine, records(3)[1:], ONE, seed=0, tokenizer=TOK)
    assert [s.metadata["end"] for s in samples] == ["env", "env"]


class ExitsInATask:
    """Record 0's episodes answer from an `async def` that runs a tool in a task of its own, which raises
    SystemExit: asyncio lets it out of the event loop. Record 1's episodes answer synchronously and give their
    reward from an `async def`, after that loop stopped."""

    def start(self, record):
        episode = Episode()
        if record.index == 0:
            async def respond(turn):
                async def tool():
                    raise SystemExit(5)
                return await asyncio.gather(tool())
            episode.respond = respond
        else:
            async def reward():
                return 1.0
            episode.reward = reward
        return episode


def test_systemexit_in_a_task_of_the_environments_own_fails_the_calls_in_flight(engine):
    step = AgentLoopStep(environment=ExitsInATask(), max_turns=3, max_trajectory_tokens=64, max_failed_frac=1.0)
    samples = step.generate(engine, records(2), SamplingParams(top_p=0.9, max_new_tokens=3, n=2), seed=0,
                            tokenizer=TOK)
    assert [s.metadata["end"] for s in samples] == ["env_error"] * 2 + ["env"] * 2
    assert all(s.metadata["env_error_kind"] == "exception" and s.metadata["env_error"] == (
        "the environment's event loop stopped on SystemExit: 5, raised in a task its code started (every async call "
        "in flight fails)") for s in samples[:2])
    assert [s.metadata["env_reward"] for s in samples[2:]] == [1.0, 1.0]  # on a new loop, in the same step


class Interrupts(Episode):
    """The first answer sends the process a real SIGINT (as a Ctrl-C would), then answers normally."""

    def respond(self, turn):
        if self.turns == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return super().respond(turn)


class InterruptingEnv:
    def start(self, record):
        return Interrupts()


def test_a_real_ctrl_c_is_not_taken_for_an_environment_fault(engine, tmp_path):
    """The environment's own KeyboardInterrupt is a fault (above); a real SIGINT is not: under the training run's
    handler (`StopOnSignal`) the step finishes, nothing is counted as a fault, and the run's stop flag is set, so
    the run saves after this step. (Without a handler, Python raises KeyboardInterrupt wherever the main thread is,
    which no test can pin down: in a fresh clone's full run it broke CPython 3.11's ast.parse for the session.)"""
    step = AgentLoopStep(environment=InterruptingEnv(), max_turns=3, max_trajectory_tokens=64)
    stop = StopOnSignal(run_dir=tmp_path)
    stop.on_train_start(types.SimpleNamespace(global_rank=0, callbacks=[]), None)
    try:
        samples = step.generate(engine, records(1), ONE, seed=0, tokenizer=TOK)
    finally:
        stop.close()
    assert stop.received == signal.SIGINT
    assert [s.metadata["end"] for s in samples] == ["env"] and "env_error" not in samples[0].metadata


def test_an_environment_failing_at_start_is_named(engine):
    step = AgentLoopStep(environment=FailingStart(), max_turns=2, max_trajectory_tokens=64, max_failed_frac=1.0)
    samples = step.generate(engine, records(1), ONE, seed=0, tokenizer=TOK)
    (s,) = samples
    assert s.status == SampleStatus.ABORTED and s.metadata["env_error_kind"] == "exception"
    assert s.metadata["env_error"] == "FailingStart.start raised ValueError: no such record"
    # What a step left without a trainable sample names for its aborted samples:
    assert s.metadata["finish_reason"]["message"] == ("failed before its first model turn: FailingStart.start raised "
                                                      "ValueError: no such record")
    # Even when every trajectory may fail, a step left with nothing to train names the environment, not the engine.
    with pytest.raises(RuntimeError, match=r"^1 of 1 trajectories failed this step, and a data-parallel rank has no "
                                           r"model token left to train on .* first failure: exception: FailingStart."
                                           r"start raised ValueError: no such record; fix the environment"):
        step.check(samples)


class Growing:
    """Answers every turn with two characters, never ends: the trajectory grows until a budget or the context."""

    def start(self, record):
        episode = Episode()
        episode.respond = lambda turn: "=1"
        return episode


def test_a_trajectory_that_reaches_the_models_context_ends_truncated():
    context = 20
    small = EmbeddedEngine(build_tiny_model(tokenizer=TOK, seed=3, initializer_range=0.3, max_positions=context),
                           progress=False)
    assert small.max_context == context
    recs = records(2)
    step = AgentLoopStep(environment=Growing(), max_turns=50, max_trajectory_tokens=context - 1)
    samples = step.generate(small, recs, SamplingParams(top_p=0.9, max_new_tokens=3, n=2), seed=0, tokenizer=TOK)
    for s in samples:
        assert s.metadata["end"] == "context" and s.status == SampleStatus.TRUNCATED
        assert context - 3 < len(s.tokens) <= context  # no room left for a turn of max_new_tokens=3
    stats = step.stats(samples)
    assert stats["rollout/context_ended"] == (4.0, 1.0) and stats["rollout/trajectories_failed"] == (0.0, 1.0)
    # A budget the context cannot hold is refused before any turn, naming both numbers.
    too_big = AgentLoopStep(environment=Growing(), max_turns=50, max_trajectory_tokens=context)
    with pytest.raises(ValueError, match=r"rollout.max_trajectory_tokens=20 does not fit the model's context of 20 "
                                         r"tokens \(max_position_embeddings\)"):
        too_big.generate(small, recs, ONE, seed=0, tokenizer=TOK)
    check_context(max_trajectory_tokens=10**9, context=None)  # a context not known: nothing to refuse
    with pytest.raises(ValueError, match=r"rollout.max_trajectory_tokens=4096 does not fit the model's context of "
                                         r"2048 tokens .* set rollout.max_trajectory_tokens below 2048 less the "
                                         r"longest prompt"):
        check_context(max_trajectory_tokens=4096, context=2048)


class MixedFaults(LookupEnvironment):
    """The lookup environment, whose episodes of records 4k, 4k+1, 4k+2 raise SystemExit, raise KeyboardInterrupt
    and return a NaN reward; records 4k+3 play."""

    def start(self, record):
        episode = super().start(record)
        fault = record.index % 4
        if fault == 0:
            episode.respond = _raises(SystemExit(3))
        elif fault == 1:
            episode.respond = _raises(KeyboardInterrupt())
        elif fault == 2:
            episode.reward = lambda: float("nan")
        return episode


def _raises(error: BaseException):
    def respond(turn):
        raise error
    return respond


def test_a_run_trains_through_faults_counting_them_by_kind(tmp_path):
    """A whole run (`train`): every step, 3 of 4 records' environments fail (SystemExit, KeyboardInterrupt, a NaN
    reward); the run trains on, and the logged counts say which fault failed how many trajectories."""
    cfg = compose_cfg(tmp_path, "task=lookup", "logger=csv", "rollout.prompts_per_step=4", "rollout.n_samples=2",
                      "trainer.max_steps=2", f"rollout.step.environment._target_={__name__}.MixedFaults",
                      "rollout.step.max_failed_frac=0.8")
    summary = train(cfg)
    assert summary["steps"] == 2
    metrics = metric_columns(tmp_path)
    assert metrics["rollout/env_errors/exception"] == [4.0, 4.0]  # 2 records x 2 trajectories a step
    assert metrics["rollout/env_errors/bad_reward"] == [2.0, 2.0]
    assert metrics["rollout/env_errors"] == metrics["rollout/trajectories_failed"] == [6.0, 6.0]
    for kind in ("bad_return", "foreign_trajectory", "no_request", "bad_request"):
        assert metrics[f"rollout/env_errors/{kind}"] == [0.0, 0.0], kind
    assert metrics["rollout/context_ended"] == [0.0, 0.0]
    assert all(math.isfinite(v) for v in metrics["train/loss"])


def test_a_budget_the_models_context_cannot_hold_is_refused_at_start(tmp_path, monkeypatch):
    """Checked once the model is built, before any engine starts (none is built: `engine_for` must not run)."""
    import topp_rl.train as train_module

    context = build_tiny_model(tokenizer=TOK).config.max_position_embeddings
    monkeypatch.setattr(train_module, "engine_for", lambda *a, **k: pytest.fail("an engine was built"))
    for step in ("task=lookup", "task=agent task.agent=topp_rl.tasks.agents.lookup:lookup_agent"):  # loop, endpoint
        cfg = compose_cfg(tmp_path, *step.split(), f"rollout.max_trajectory_tokens={context}")
        with pytest.raises(ValueError, match=rf"rollout.max_trajectory_tokens={context} does not fit the model's "
                                             rf"context of {context} tokens"):
            train_module.build_run(cfg)
