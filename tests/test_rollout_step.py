"""The rollout step (`topp_rl.rollout.step`): `SingleTurnStep` equals generate -> number -> score done by hand,
and the step chosen in config (`rollout.step`) is the one training and evaluation both run."""

import pytest
from helpers import compose_cfg

from topp_rl.data.sample import number_samples
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.rollout import RolloutDataModule, SamplingParams
from topp_rl.rollout.step import RolloutStep, SingleTurnStep
from topp_rl.tasks import CopyDigitTask
from topp_rl.train import build_run, fit

TOK = build_char_tokenizer()


def test_single_turn_step_equals_generate_number_score_by_hand():
    engine = EmbeddedEngine(build_tiny_model(tokenizer=TOK, seed=3, initializer_range=0.3), progress=False)
    task = CopyDigitTask(digit_credit=0.2)
    params = SamplingParams(top_p=0.9, max_new_tokens=2, n=3)
    records = [task.prompt(10 + i, TOK) for i in range(4)]
    result = SingleTurnStep().run(engine, records, params, task=task, tokenizer=TOK, seed=7, first_group=5)
    expected = number_samples(engine.generate([r.prompt_ids for r in records], params, seed=7), prompts=4, n=3,
                              first_group=5)
    task.score(expected, {5 + j: r for j, r in enumerate(records)}, TOK)
    got = result.samples
    assert [s.index for s in got] == list(range(15, 27)) and [s.group_index for s in got] == [
        g for g in range(5, 9) for _ in range(3)]
    assert [s.response_ids for s in got] == [s.response_ids for s in expected]
    assert [s.rollout_log_probs for s in got] == [s.rollout_log_probs for s in expected]
    assert [s.reward for s in got] == [s.reward for s in expected]
    assert result.generate_s > 0


class CountingStep(SingleTurnStep):
    """The single-turn step, recording (prompts, n, first group) of every step it scores."""

    def __init__(self) -> None:
        self.scored: list[tuple[int, int, int]] = []

    def score(self, samples, records, params, *, task, tokenizer, first_group=0):
        self.scored.append((len(records), params.n, first_group))
        return super().score(samples, records, params, task=task, tokenizer=tokenizer, first_group=first_group)


def test_training_and_evaluation_run_the_step_the_config_names(tmp_path):
    run = build_run(compose_cfg(tmp_path, "rollout.step._target_=test_rollout_step.CountingStep",
                                "eval.every_n_steps=1", "eval.num_prompts=3", "eval.k=4", "logger=none"))
    step = run.datamodule.rollout_step
    assert type(step) is CountingStep
    fit(run)
    evaluation = [(3, 1, 0), (3, 4, 0)]  # greedy, then k samples per prompt
    training = [(2, 2, 0)]  # rollout.prompts_per_step=2, rollout.n_samples=2
    assert step.scored == evaluation + training + evaluation + training + evaluation


def test_a_rollout_step_that_is_not_one_is_refused():
    engine = EmbeddedEngine(build_tiny_model(tokenizer=TOK, seed=0), progress=False)
    with pytest.raises(TypeError, match=r"rollout_step is a dict; pass a topp_rl.rollout.step.RolloutStep such as "
                                        r"SingleTurnStep\(\) \(in config: rollout.step._target_\)"):
        RolloutDataModule(engine=engine, task=CopyDigitTask(), tokenizer=TOK, params=SamplingParams(),
                          prompts_per_step=1, rollout_step={"_target_": "x"})
    assert isinstance(SingleTurnStep(), RolloutStep)
