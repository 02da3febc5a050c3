"""Held-out evaluation of a multi-turn task through the agent loop (the datamodule's own `AgentLoopStep`): greedy
accuracy, response length, pass@k and mean@k equal a direct computation - greedy from a hand-written turn-by-turn
loop, one prompt at a time, scored from the decoded transcript; sampled from the step's trajectories scored from
their transcripts -, an episode's `correct` mark and a failed environment call decide correctness, and eval
records the environment cannot play stop the run naming the evaluation."""

import dataclasses
from types import SimpleNamespace

import pytest

from topp_rl.callbacks.evaluation import HELD_OUT_OFFSET, Evaluation
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.rollout import RolloutDataModule, SamplingParams
from topp_rl.rollout.agent_step import AgentLoopStep
from topp_rl.tasks import CopyDigitTask
from topp_rl.tasks.lookup import LookupEnvironment, LookupEpisode, LookupTask

TOK = build_char_tokenizer()
PARAMS = SamplingParams(top_p=0.9, temperature=0.2, max_new_tokens=1, n=8)  # lookup's turns; 0.2: some succeed
PROMPTS, K = 16, 4


def _setup(environment, *, correct_reward: float, max_failed_frac: float = 0.5):
    engine = EmbeddedEngine(build_tiny_model(tokenizer=TOK, seed=0), progress=False)  # conf/model/tiny.yaml
    task = LookupTask()
    step = AgentLoopStep(environment=environment, max_turns=2, max_trajectory_tokens=16,
                         max_failed_frac=max_failed_frac)
    dm = RolloutDataModule(engine=engine, task=task, tokenizer=TOK, params=PARAMS, prompts_per_step=2,
                           rollout_step=step)
    ev = Evaluation(every_n_steps=1, num_prompts=PROMPTS, k=K, correct_reward=correct_reward)
    ev.resolve(dm)
    records = [task.prompt(HELD_OUT_OFFSET + i, TOK) for i in range(PROMPTS)]
    return engine, task, step, dm, ev, records


def _greedy_transcript(engine, record) -> tuple[str, int]:
    """The lookup exchange by hand, one prompt alone: call, the tool's "=v", answer (top_k=1: no seed involved)."""
    greedy = dataclasses.replace(PARAMS, top_k=1, n=1)
    (call,) = engine.generate([record.prompt_ids], greedy)
    text = TOK.decode(call.response_ids)
    value = record.data["table"].get(text[:1])
    if value is None:  # no such key: the tool ends the trajectory
        return text, call.response_length
    shown = TOK.encode(f"={value}", add_special_tokens=False)
    (answer,) = engine.generate([record.prompt_ids + call.response_ids + shown], greedy)
    return text + f"={value}" + TOK.decode(answer.response_ids), call.response_length + len(shown) + 1


def test_lookup_eval_figures_equal_a_direct_computation():
    engine, task, step, dm, ev, records = _setup(LookupEnvironment(), correct_reward=1.0)
    sums, _ = ev._score(dm)
    greedy = [_greedy_transcript(engine, r) for r in records]
    greedy_ok = [task.reward(text, r) >= 1.0 for (text, _), r in zip(greedy, records, strict=True)]
    assert sums["val/accuracy"] == (sum(greedy_ok), PROMPTS)
    assert sums["val/response_length_mean"] == (sum(n for _, n in greedy), PROMPTS)
    # The k samples: the same step call as the callback's (seed 0), each trajectory scored from its transcript.
    samples = step.generate(engine, records, dataclasses.replace(PARAMS, n=K), seed=0, tokenizer=TOK)
    sampled = [task.reward(TOK.decode(s.response_ids), records[i // K]) >= 1.0 for i, s in enumerate(samples)]
    groups = [sampled[i : i + K] for i in range(0, len(sampled), K)]
    assert sums["val/pass@k"] == (sum(any(g) for g in groups), PROMPTS)
    assert sums["val/mean@k"] == (sum(sampled), PROMPTS * K)
    assert 0 < sum(sampled) < PROMPTS * K and 0 < sum(any(g) for g in groups) < PROMPTS  # both outcomes


class MarkedLookup(LookupEnvironment):
    """Episodes mark `correct` themselves (the right call, whatever the answer); odd held-out records' tool
    crashes (their trajectories fail: reward 0, never correct)."""

    def start(self, record):
        return MarkedEpisode(record)


class MarkedEpisode(LookupEpisode):
    def respond(self, turn):
        if self.record.index % 2:
            raise RuntimeError("tool crashed")
        return super().respond(turn)

    def reward(self):
        return {"score": super().reward(), "correct": self.calls[:1] == [self.record.data["key"]]}


def test_episode_marks_and_failures_decide_correctness():
    # correct_reward=0: by score alone every trajectory (reward >= 0) would be correct.
    engine, task, step, dm, ev, records = _setup(MarkedLookup(), correct_reward=0.0, max_failed_frac=1.0)
    sums, _ = ev._score(dm)
    samples = step.generate(engine, records, dataclasses.replace(PARAMS, n=K), seed=0, tokenizer=TOK)
    assert sum("env_error" in s.metadata for s in samples) == PROMPTS * K // 2
    sampled = [records[i // K].index % 2 == 0 and TOK.decode(s.response_ids)[:1] == records[i // K].data["key"]
               for i, s in enumerate(samples)]
    groups = [sampled[i : i + K] for i in range(0, len(sampled), K)]
    assert sums["val/pass@k"] == (sum(any(g) for g in groups), PROMPTS)
    assert sums["val/mean@k"] == (sum(sampled), PROMPTS * K)
    assert 0 < sum(sampled)
    greedy_ok = [r.index % 2 == 0 and _greedy_transcript(engine, r)[0][:1] == r.data["key"] for r in records]
    assert sums["val/accuracy"] == (sum(greedy_ok), PROMPTS) and 0 < sum(greedy_ok) < PROMPTS


def test_eval_records_the_environment_cannot_play_stop_naming_the_evaluation():
    engine, task, step, dm, _, _ = _setup(LookupEnvironment(), correct_reward=1.0)
    ev = Evaluation(every_n_steps=1, num_prompts=4, k=2, task=CopyDigitTask())  # no lookup table in its records
    ev.resolve(dm)
    trainer = SimpleNamespace(datamodule=dm, loggers=[], global_step=0, world_size=1)  # one process
    with pytest.raises(RuntimeError, match=r"^evaluation on CopyDigitTask: 12 of 12 trajectories failed "
                                           r"this step .*first failure: exception: LookupEpisode.respond raised "
                                           r"KeyError: 'table'"):
        ev.evaluate(trainer, None)
