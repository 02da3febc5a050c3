"""DAPO's overlong handling (`algo.overlong`): the soft penalty and the filter against hand computations, through the
datamodule (real EmbeddedEngine, tiny model) and one short train.py run; refused settings."""

import pytest
import torch
from helpers import compose_cfg, metric_columns

from topp_rl.config import validate_config
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.rollout import RolloutDataModule, Sample, SampleStatus, SamplingParams
from topp_rl.rollout.advantages import GroupAdvantage, trajectory_advantages
from topp_rl.rollout.overlong import Overlong
from topp_rl.tasks import CopyDigitTask
from topp_rl.train import train

TOK = build_char_tokenizer()
STOPS = tuple(range(3, 30))  # stop ids a random model draws often: responses of every length up to the budget


def _sample(length: int, *, truncated: bool = False, reward: float = 0.0, group: int = 0, index: int = 0) -> Sample:
    s = Sample(prompt_ids=[1], reward=reward, group_index=group, index=index,
               status=SampleStatus.TRUNCATED if truncated else SampleStatus.COMPLETED)
    s.append_response_tokens([5] * length, [-0.5] * length)
    return s


def test_penalty_is_dapos_soft_penalty_by_hand():
    # B = 10, L = 4, P = 1: free up to 6 tokens, then -1/4 per token into the buffer, -1 at the budget.
    samples = [_sample(n, truncated=n == 10) for n in (3, 6, 7, 9, 10)]
    got = Overlong(buffer=4, penalty=1.0).penalties(samples, max_new_tokens=10)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0]
    assert Overlong(buffer=4, penalty=0.5).penalties(samples, max_new_tokens=10).tolist() == [0, 0, -0.125, -0.375, -0.5]
    assert Overlong().penalties(samples, max_new_tokens=10).tolist() == [0.0] * 5  # off


def test_penalty_enters_the_rewards_before_the_group_statistics():
    rewards = [1.0, 1.0, 0.0, 1.0]
    samples = [_sample(n, reward=r, group=i // 2, index=i) for i, (n, r) in enumerate(zip((2, 10, 9, 3), rewards, strict=True))]
    penalties = Overlong(buffer=4, penalty=1.0).penalties(samples, max_new_tokens=10)
    got = trajectory_advantages(GroupAdvantage(eps=0.0), samples, shaping=penalties)
    # Group 0: rewards 1 and 1 - 1 = 0 -> mean 0.5, std (Bessel) sqrt(0.5); group 1: 0 - 0.75 and 1.
    s0, s1 = 0.5 ** 0.5, (2 * (1.75 / 2) ** 2) ** 0.5
    torch.testing.assert_close(got, torch.tensor([0.5 / s0, -0.5 / s0, -0.875 / s1, 0.875 / s1]))
    assert trajectory_advantages(GroupAdvantage(), samples)[:2].tolist() == [0.0, 0.0]  # no shaping: equal rewards


def test_filter_zeroes_the_loss_mask_of_truncated_samples_only():
    samples = [_sample(4, truncated=True), _sample(2), _sample(4, truncated=True)]
    assert Overlong(filter=True).filter_truncated(samples) == 2
    assert [s.loss_mask for s in samples] == [[0] * 4, [1, 1], [0] * 4]
    assert Overlong().filter_truncated([kept := _sample(4, truncated=True)]) == 0 and kept.loss_mask == [1] * 4


@pytest.fixture(scope="module")
def engine():
    model = build_tiny_model(tokenizer=TOK, seed=0, initializer_range=0.2)
    return EmbeddedEngine(model, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id, progress=False)


class _LengthTask(CopyDigitTask):
    """Reward = response length in characters (varies under a random model)."""

    def reward(self, response, record):
        return float(len(response))


def _rollout(engine, overlong: Overlong, *, stops: tuple[int, ...] = STOPS):
    dm = RolloutDataModule(engine=engine, task=_LengthTask(), tokenizer=TOK, prompts_per_step=4, seed=0,
                           params=SamplingParams(top_p=0.9, max_new_tokens=4, n=4, stop_token_ids=stops),
                           max_tokens_per_micro_batch=64,
                           advantage=GroupAdvantage(normalize_std=False), overlong=overlong)
    batch = dm.rollout(dm.ticket(0))
    adv = torch.cat([mb.advantages[torch.cumsum(mb.response_lengths, 0) - 1] for mb in batch.micro_batches])
    return batch, adv


def _group_centred(values: torch.Tensor) -> torch.Tensor:
    return values - values.view(4, 4).mean(1).repeat_interleave(4)


def test_datamodule_filters_and_penalises_by_hand(engine):
    batch, adv = _rollout(engine, Overlong(filter=True, buffer=3, penalty=0.6))
    samples = batch.samples
    lengths = torch.tensor([s.response_length for s in samples], dtype=torch.float64)
    truncated = torch.tensor([s.status == SampleStatus.TRUNCATED for s in samples])
    assert 0 < int(truncated.sum()) < 16 and (lengths[truncated] == 4).all()  # the premise: a mix of both
    assert (lengths == 1).any() and (lengths == 2).any()
    # B = 4, L = 3, P = 0.6: 1 token -> 0, then -0.2 per token into the buffer.
    penalty = torch.tensor([{1: 0.0, 2: -0.2, 3: -0.4, 4: -0.6}[int(n)] for n in lengths], dtype=torch.float64)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    torch.testing.assert_close(adv, _group_centred(rewards + penalty).float())  # filtered ones keep their reward
    mask = torch.cat([mb.loss_mask for mb in batch.micro_batches])
    per_sample = torch.repeat_interleave(truncated, lengths.long())
    assert (mask[per_sample] == 0).all() and (mask[~per_sample] == 1).all()
    kept_tokens = float(lengths[~truncated].sum())
    assert all(mb.num_loss_tokens_global == kept_tokens and mb.num_sequences_global == 16
               for mb in batch.micro_batches)
    assert batch.stats["rollout/overlong_filtered_frac"] == (float(truncated.sum()), 16.0)
    assert batch.stats["rollout/overlong_penalty_mean"] == pytest.approx((float(penalty.sum()), 16.0))
    assert batch.stats["rollout/overlong_penalised_frac"] == (float((penalty < 0).sum()), 16.0)


def test_a_step_with_every_sample_filtered_trains_on_nothing(engine):
    batch, _ = _rollout(engine, Overlong(filter=True), stops=())  # EOS only: a random model reaches the budget
    assert all(s.status == SampleStatus.TRUNCATED for s in batch.samples)  # the premise
    assert all(not mb.loss_mask.any() and mb.num_loss_tokens_global == 1.0 for mb in batch.micro_batches)
    assert batch.stats["rollout/overlong_filtered_frac"] == (16.0, 16.0)
    assert batch.stats["rollout/trained_tokens"] == (0.0, 1.0)


def test_datamodule_off_by_default(engine):
    batch, adv = _rollout(engine, Overlong())
    rewards = torch.tensor([s.reward for s in batch.samples], dtype=torch.float64)
    torch.testing.assert_close(adv, _group_centred(rewards).float())
    assert all(s.loss_mask == [1] * s.response_length for s in batch.samples)
    assert not any(key.startswith("rollout/overlong") for key in batch.stats)


def test_short_run_logs_the_overlong_figures(tmp_path):
    # Four new tokens from a random model: most samples reach the budget, and every one that does is filtered.
    cfg = compose_cfg(tmp_path, "logger=csv", "algo.overlong.filter=true", "algo.overlong.buffer=2",
                      "algo.overlong.penalty=0.5")
    train(cfg)
    m = metric_columns(tmp_path)
    assert len(m["rollout/overlong_filtered_frac"]) == 2
    assert m["rollout/overlong_filtered_frac"] == pytest.approx(m["rollout/truncation_rate"])
    for penalty, truncated in zip(m["rollout/overlong_penalty_mean"], m["rollout/truncation_rate"], strict=True):
        assert -0.5 <= penalty <= -0.5 * truncated + 1e-9  # -0.5 per truncated sample, -0.25 at 3 tokens


@pytest.mark.parametrize(("overrides", "match"), [
    (["algo.overlong.buffer=4", "algo.overlong.penalty=1.0"], r"algo.overlong.buffer=4: must be < rollout.max_new_tokens \(4\)"),
    (["algo.overlong.buffer=2", "algo.overlong.penalty=-1.0"], r"algo.overlong.penalty=-1.0: must be a finite number >= 0"),
    (["algo.overlong.buffer=2"], r"buffer=2 with algo.overlong.penalty=0.0: the soft penalty needs both > 0"),
    (["algo.overlong.penalty=1.0"], r"buffer=0 with algo.overlong.penalty=1.0: the soft penalty needs both"),
    (["algo.overlong.buffer=1.5", "algo.overlong.penalty=1.0"], r"algo.overlong.buffer=1.5: must be an integer >= 0"),
    (["algo.overlong.filter=yes"], r"algo.overlong.filter='yes': must be true or false"),
    (["task=lookup", "rollout.max_turns=2", "algo.overlong.buffer=2", "algo.overlong.penalty=1.0"],
     r"algo.overlong.penalty=1.0: must be 0 with rollout.step=.*AgentLoopStep"),
])
def test_bad_settings_are_refused_at_start(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        validate_config(compose_cfg(tmp_path, *overrides))


def test_filter_runs_with_the_agent_loop_config(tmp_path):
    validate_config(compose_cfg(tmp_path, "task=lookup", "rollout.max_turns=2", "algo.overlong.filter=true"))
