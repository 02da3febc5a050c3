"""Packing, advantages and RolloutDataModule (real EmbeddedEngine, tiny model, real Lightning Trainer)."""

import lightning as L
import pytest
import torch

from topp_rl.data import RolloutBatch
from topp_rl.engines.base import EngineWrapper, ReleasesMemory
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.ops import Candidates
from topp_rl.rollout import RolloutDataModule, RolloutEngine, Sample, SampleStatus, SamplingParams
from topp_rl.rollout.advantages import BatchAdvantage, GroupAdvantage, NoBaseline, RLOOAdvantage
from topp_rl.rollout.datamodule import RolloutTicket
from topp_rl.rollout.packing import pack_samples, plan_micro_batches, plan_step
from topp_rl.rollout.refill import RefillPlan, continue_indices
from topp_rl.tasks import CopyDigitTask

TOK = build_char_tokenizer()


def _sample(prompt, response, *, cands=None, reward=0.0, group=0, index=0, tool=None):
    s = Sample(prompt_ids=prompt, reward=reward, group_index=group, index=index)
    s.append_response_tokens(
        response, [-0.5] * len(response), Candidates.from_lists(cands) if cands else None
    )
    if tool:
        s.append_response_tokens(tool, trainable=False)
    return s


def test_pack_layout_and_candidates():
    a = _sample([1, 2], [5, 6], cands=[[5, 7], [6]], reward=1.0, index=0)
    b = _sample([1], [8], reward=0.0, group=1, index=1)  # no candidate data
    c = _sample([3, 4, 4], [9], cands=[[9, 1]], tool=[10, 11], reward=0.5, group=1, index=2)
    (mb,) = pack_samples([a, b, c], [0.5, -1.0, 2.0], max_tokens=100)
    assert mb.tokens.tolist() == [1, 2, 5, 6, 1, 8, 3, 4, 4, 9, 10, 11]
    assert mb.cu_seqlens.tolist() == [0, 4, 6, 12] and mb.cu_seqlens.dtype == torch.int32
    assert mb.seq_lengths.tolist() == [4, 2, 6] and mb.response_lengths.tolist() == [2, 1, 3]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5]
    assert mb.response_tokens.tolist() == [5, 6, 8, 9, 10, 11]
    assert mb.loss_mask.tolist() == [1, 1, 1, 1, 0, 0]
    assert mb.advantages.tolist() == [0.5, 0.5, -1.0, 2.0, 2.0, 2.0]
    assert mb.rollout_log_probs.tolist() == [-0.5, -0.5, -0.5, -0.5, 0.0, 0.0]
    assert mb.candidates.to_lists() == [[5, 7], [6], [], [9, 1], [], []]
    assert mb.rewards.tolist() == [1.0, 0.0, 0.5] and mb.group_index.tolist() == [0, 1, 1]
    assert mb.sample_index.tolist() == [0, 1, 2]
    assert mb.num_loss_tokens_global == 4.0 and mb.num_sequences_global == 3
    assert pack_samples([b], [0.0], max_tokens=10)[0].candidates is None


def test_pack_blanks_sets_on_non_trainable_tokens():
    s = Sample(
        prompt_ids=[1],
        response_ids=[4, 5],
        loss_mask=[1, 0],
        rollout_log_probs=[-1.0, 0.0],
        candidates=Candidates.from_lists([[4, 3], [5, 6]]),
    )
    (mb,) = pack_samples([s], [1.0], max_tokens=10)
    assert mb.candidates.to_lists() == [[4, 3], []]


def test_plan_reaches_another_ranks_micro_batch_count_by_halving_the_fullest():
    # Every data-parallel rank runs as many forwards (FSDP gathers weights in each): the greedy plan is split.
    assert plan_micro_batches([1, 1, 1, 1, 1], max_tokens=10, min_count=3) == [[0, 1], [2], [3, 4]]
    assert plan_micro_batches([3, 4, 2], max_tokens=7, min_count=2) == [[0, 1], [2]]  # already enough
    with pytest.raises(ValueError, match=r"2 samples cannot fill the 3 micro-batches .*max_tokens_per_micro_batch"):
        plan_micro_batches([1, 1], max_tokens=10, min_count=3)


def test_plan_step_is_the_greedy_plan_split_to_the_most_micro_batches_of_any_rank():
    samples = [_sample([1] * 3, [2] * 2, index=i) for i in range(5)]  # 5 tokens each: 2 per budget of 10
    assert plan_step(samples, max_tokens=10) == [[0, 1], [2, 3], [4]]
    assert plan_step(samples, max_tokens=10, most=lambda count: count) == [[0, 1], [2, 3], [4]]
    assert plan_step(samples, max_tokens=10, most=lambda count: count + 1) == [[0], [1], [2, 3], [4]]
    micro = pack_samples(samples, [0.0] * 5, max_tokens=10, most=lambda count: 5)
    assert [mb.sample_index.tolist() for mb in micro] == [[0], [1], [2], [3], [4]]


def test_budget_plan_is_greedy_in_order_and_never_splits():
    assert plan_micro_batches([3, 4, 2, 5, 1], max_tokens=7) == [[0, 1], [2, 3], [4]]
    assert plan_micro_batches([7, 7], max_tokens=7) == [[0], [1]]
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens .* max_tokens=8; .* at least 9"):
        plan_micro_batches([2, 9], max_tokens=8)
    samples = [_sample([1] * 3, [2] * (i + 1), index=i) for i in range(5)]
    micro = pack_samples(
        samples, [0.0] * 5, max_tokens=9, num_loss_tokens_global=40.0, num_sequences_global=9
    )
    assert [mb.sample_index.tolist() for mb in micro] == [[0, 1], [2], [3], [4]]
    assert all(mb.num_loss_tokens_global == 40.0 and mb.num_sequences_global == 9 for mb in micro)


def test_advantages():
    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 3.0])
    g = torch.tensor([0, 0, 0, 1, 1, 5])
    grp = GroupAdvantage(normalize_std=True, eps=0.0)(r, g)
    ref0 = (r[:3] - r[:3].mean()) / r[:3].std()
    torch.testing.assert_close(grp[:3], ref0)
    assert grp[3:].tolist() == [0.0, 0.0, 0.0]  # zero variance and a group of one -> 0
    dr = GroupAdvantage(normalize_std=False)(r, g)
    torch.testing.assert_close(dr[:3], r[:3] - 0.5)
    loo = RLOOAdvantage()(r, g)
    torch.testing.assert_close(loo[:3], torch.tensor([1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5]))
    assert loo[5] == 0.0
    batch = BatchAdvantage(eps=0.0)(r, g)
    torch.testing.assert_close(batch, (r - r.mean()) / r.std())
    doubled = BatchAdvantage(eps=0.0)(r, g, reduce=lambda t: 2 * t)  # two DP ranks holding the same data
    torch.testing.assert_close(doubled, (r - r.mean()) / (r.std() * (10 / 11) ** 0.5))  # n=12 pooled
    # Config validation reads this to demand n_samples >= 2.
    assert [c.group_relative for c in (GroupAdvantage, RLOOAdvantage, BatchAdvantage, NoBaseline)] == [
        True, True, False, False]


class _LengthTask(CopyDigitTask):
    """Reward = response length in characters: varies even under a random model (copy_digit is ~all zero)."""

    def reward(self, response, record):
        return float(len(response))


def _datamodule(engine, *, prompts=4, n=4, seed=0, task=None, **kwargs):
    return RolloutDataModule(
        engine=engine,
        task=task or CopyDigitTask(),
        tokenizer=TOK,
        params=SamplingParams(top_p=0.9, max_new_tokens=3, n=n),
        prompts_per_step=prompts,
        max_tokens_per_micro_batch=24,
        seed=seed,
        **kwargs,
    )


@pytest.fixture(scope="module")
def engine():
    model = build_tiny_model(tokenizer=TOK, seed=0, initializer_range=0.2)
    return EmbeddedEngine(model, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id, progress=False)


def test_rollout_step(engine):
    dm = _datamodule(engine, advantage=GroupAdvantage(normalize_std=False))
    ticket = dm.ticket(0)
    batch = dm.on_before_batch_transfer(ticket, 0)
    assert isinstance(batch, RolloutBatch) and batch.step == 0 and dm.step == 1
    assert len(batch.samples) == 16 and [s.index for s in batch.samples] == list(range(16))
    assert [s.group_index for s in batch.samples] == [g for g in range(4) for _ in range(4)]
    rewards = torch.tensor([s.reward for s in batch.samples])
    assert set(rewards.tolist()) <= {0.0, 0.2, 1.0}
    for rec in ticket.records:
        assert rec.prompt_ids == [TOK.bos_token_id, *TOK.encode(rec.text, add_special_tokens=False)]
    # Micro-batches cover every sample once, in order, within the budget; advantages are reward - group mean.
    order = torch.cat([mb.sample_index for mb in batch.micro_batches]).tolist()
    assert order == list(range(16)) and all(int(mb.seq_lengths.sum()) <= 24 for mb in batch.micro_batches)
    adv = torch.cat([mb.advantages[torch.cumsum(mb.response_lengths, 0) - 1] for mb in batch.micro_batches])
    torch.testing.assert_close(adv, (rewards - rewards.view(4, 4).mean(1).repeat_interleave(4)).float())
    total = sum(sum(s.loss_mask) for s in batch.samples)
    assert all(
        mb.num_loss_tokens_global == total and mb.num_sequences_global == 16 for mb in batch.micro_batches
    )
    cands = Candidates.concat([mb.candidates for mb in batch.micro_batches])
    assert cands.to_lists() == Candidates.concat([s.candidates for s in batch.samples]).to_lists()
    assert batch.stats["rollout/dropped_group_frac"] == (0.0, 4.0)


def test_drop_zero_variance_groups(engine):
    dm = _datamodule(engine, prompts=8, n=2, drop_zero_variance_groups=True)
    batch = dm.rollout(dm.ticket(3))
    by_group = {}
    for s in batch.samples:
        by_group.setdefault(s.group_index, []).append(s.reward)
    flat = [g for g, r in by_group.items() if len(set(r)) == 1]
    trained = {int(g) for mb in batch.micro_batches for g in mb.group_index}
    assert flat and trained == set(by_group) - set(flat)
    assert batch.stats["rollout/dropped_group_frac"] == (float(len(flat)), 8.0)


def test_dp_ranks_get_disjoint_slices(engine):
    whole = _datamodule(engine, prompts=4)
    ranks = [_datamodule(engine, prompts=4, dp_rank=r, dp_size=2) for r in range(2)]
    texts = [r.text for dm in ranks for r in dm.ticket(5).records]
    assert texts == [r.text for r in whole.ticket(5).records]
    assert ranks[0].ticket(5).seed != ranks[1].ticket(5).seed
    batch = ranks[1].rollout(ranks[1].ticket(5))
    assert [s.group_index for s in batch.samples[::4]] == [2, 3] and batch.samples[0].index == 8
    with pytest.raises(
        ValueError, match=r"prompts_per_step \(4\) is not divisible by the data-parallel size \(3\)"
    ):
        _datamodule(engine, prompts=4, dp_rank=0, dp_size=3).ticket(0)


def test_aborted_samples_are_not_trained(engine):
    class Aborting(RolloutEngine):
        vocab_size = engine.vocab_size

        def update_weights(self, named_tensors):
            pass

        def close(self):
            pass

        def generate(self, prompts, params, *, seed=None):
            samples = engine.generate(prompts, params, seed=seed)
            samples[1] = Sample(
                prompt_ids=samples[1].prompt_ids,
                status=SampleStatus.ABORTED,
                group_index=samples[1].group_index,
                index=1,
            )
            return samples

    dm = _datamodule(Aborting(), prompts=2, n=2)
    batch = dm.rollout(dm.ticket(0))
    assert batch.samples[1].status == "aborted" and batch.samples[1].reward is None
    assert torch.cat([mb.sample_index for mb in batch.micro_batches]).tolist() == [0, 2, 3]


class _Recorder(L.LightningModule):
    """Records what training_step receives (the real PolicyModule is tested elsewhere)."""

    def __init__(self):
        super().__init__()
        self.seen: list[RolloutBatch] = []
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        self.seen.append(batch)
        return (self.w * 0).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(dm, steps, ckpt=None):
    module = _Recorder()
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
    return trainer, module.seen


def test_trainer_resume_continues_identically(engine, tmp_path):
    trainer, first = _fit(_datamodule(engine), 2)
    assert all(isinstance(b, RolloutBatch) for b in first) and [b.step for b in first] == [0, 1]
    ckpt = tmp_path / "two.ckpt"
    trainer.save_checkpoint(ckpt)
    _, resumed = _fit(_datamodule(engine), 4, ckpt=str(ckpt))
    _, straight = _fit(_datamodule(engine), 4)
    assert [b.step for b in resumed] == [2, 3]
    for a, b in zip(resumed, straight[2:], strict=True):
        assert [s.tokens for s in a.samples] == [s.tokens for s in b.samples]
        assert [s.rollout_log_probs for s in a.samples] == [s.rollout_log_probs for s in b.samples]
    assert isinstance(_datamodule(engine).ticket(0), RolloutTicket)


def _dp_rollout(rank: int) -> dict:
    """On each of 2 gloo ranks: a DP=2 rollout step (batch-normalised advantages) and a DP=1 one (replicas)."""
    torch.manual_seed(0)
    model = build_tiny_model(tokenizer=TOK, seed=0, initializer_range=0.2)
    engine = EmbeddedEngine(
        model, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id, progress=False
    )
    out = {}
    for name, dp_rank, dp_size in (("dp2", rank, 2), ("dp1", 0, 1)):
        dm = _datamodule(
            engine,
            prompts=4,
            n=3,
            task=_LengthTask(),
            advantage=BatchAdvantage(),
            dp_rank=dp_rank,
            dp_size=dp_size,
        )
        batch = dm.rollout(dm.ticket(1))
        ends = [torch.cumsum(mb.response_lengths, 0) - 1 for mb in batch.micro_batches]
        out[name] = {
            "rewards": [s.reward for s in batch.samples],
            "loss_tokens": sum(sum(s.loss_mask) for s in batch.samples),
            "denominators": {
                (mb.num_loss_tokens_global, mb.num_sequences_global) for mb in batch.micro_batches
            },
            "advantages": torch.cat(
                [mb.advantages[e] for mb, e in zip(batch.micro_batches, ends, strict=True)]
            ),
            "indices": [s.index for s in batch.samples],
        }
    return out


@pytest.mark.distributed
def test_dp_denominators_and_batch_advantages_span_ranks():
    from dist_utils import run_distributed

    ranks = run_distributed(_dp_rollout, 2)
    dp2 = [r["dp2"] for r in ranks]
    assert dp2[0]["indices"] == list(range(6)) and dp2[1]["indices"] == list(range(6, 12))
    total = float(dp2[0]["loss_tokens"] + dp2[1]["loss_tokens"])
    assert dp2[0]["denominators"] == dp2[1]["denominators"] == {(total, 12)}
    rewards = torch.tensor(dp2[0]["rewards"] + dp2[1]["rewards"], dtype=torch.float64)
    assert rewards.std() > 0  # otherwise the advantage check below would be vacuous
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    torch.testing.assert_close(torch.cat([dp2[0]["advantages"], dp2[1]["advantages"]]), expected.float())
    # DP=1 on 2 ranks: both hold the same data; the sums divide the replica out.
    dp1 = [r["dp1"] for r in ranks]
    assert dp1[0]["rewards"] == dp1[1]["rewards"]
    assert dp1[0]["denominators"] == {(float(dp1[0]["loss_tokens"]), 12)}


# ----- dynamic sampling (data.refill) -----
F0, F1 = [0.0] * 8, [1.0] * 8  # zero-variance groups
ONE_SUCCESS, ONE_FAILURE = [1.0] + [0.0] * 7, [1.0] * 7 + [0.0]  # a row-wise leave-one-out filter splits these
ONE_LOSER = [0.0] + [0.95] * 7  # seven identical winners once the loser's row is dropped
BALANCED = [1.0] * 4 + [0.0] * 4


class _ScriptedTask(CopyDigitTask):
    """Rewards from a table, whatever the model answers: the group of data position i gets `patterns[i % len]`,
    its sample j the pattern's j-th value (single-turn numbering: sample index = group * n + j)."""

    def __init__(self, patterns):
        super().__init__()
        self.patterns = patterns

    def score(self, samples, records, tokenizer):
        for s in samples:
            pattern = self.patterns[records[s.group_index].index % len(self.patterns)]
            s.reward = pattern[s.index % len(pattern)]
        return [s.reward for s in samples]


def _trained(batch):
    """{group: [(sample index, advantage)]} of the trained samples."""
    out = {}
    for mb in batch.micro_batches:
        ends = torch.cumsum(mb.response_lengths, 0) - 1
        for g, i, a in zip(mb.group_index.tolist(), mb.sample_index.tolist(), mb.advantages[ends].tolist(),
                           strict=True):
            out.setdefault(g, []).append((i, a))
    return out


def _reference(estimator, rewards):
    """The estimator's advantages over one whole group, written out: GRPO (r - mean) / (std + eps), RLOO
    r - mean of the others."""
    r = torch.tensor(rewards, dtype=torch.float64)
    if isinstance(estimator, RLOOAdvantage):
        return (r - (r.sum() - r) / (len(r) - 1)).tolist()
    return ((r - r.mean()) / (r.std() + estimator.eps)).tolist()


@pytest.mark.parametrize("estimator", [GroupAdvantage(), RLOOAdvantage()], ids=["grpo", "rloo"])
def test_refill_trains_whole_groups_against_the_baselines_that_split_them(engine, estimator):
    """Refill keeps whole groups and computes each baseline over all of a group's rollouts. Baselines that break
    this (NeMo-RL #3469, #4158): a row-wise leave-one-out filter drops the one differing rollout of
    [1, 0, 0, 0, ...] or [0, .95, .95, ...] and recomputes the baseline over the identical rest (advantages all
    zero); a refill round numbering its groups like the step's first ones merges rollouts of different prompts into
    one baseline; trimming the surplus by rows cuts a group in two. Each fails the checks below."""
    patterns = [F0, ONE_LOSER, F1, ONE_SUCCESS, ONE_FAILURE, F0, BALANCED, ONE_LOSER]
    dm = _datamodule(engine, prompts=4, n=8, task=_ScriptedTask(patterns), advantage=estimator,
                     drop_zero_variance_groups=True, refill=True)
    batch = dm.rollout(dm.ticket(0))
    # Round 0 (positions 0-3) holds 2 informative groups: round 1 draws 2 x 4 / 2 = 4 more (positions 4-7).
    assert [s.group_index for s in batch.samples] == [g for g in range(8) for _ in range(8)]
    assert [s.index for s in batch.samples] == list(range(64))
    trained = _trained(batch)
    assert sorted(trained) == [1, 3, 4, 6]  # the first 4 informative groups in data order; group 7 is surplus
    for g, rows in trained.items():
        assert [i for i, _ in rows] == [g * 8 + j for j in range(8)], g  # every rollout of the group
        torch.testing.assert_close(torch.tensor([a for _, a in rows]),
                                   torch.tensor(_reference(estimator, patterns[g]), dtype=torch.float32))
    if isinstance(estimator, RLOOAdvantage):  # the group #4158 zeroed: the loser -0.95, each winner 0.95 / 7
        assert [a for _, a in trained[1]] == pytest.approx([-0.95] + [0.95 / 7] * 7)
    assert batch.stats["rollout/groups_generated"] == (8.0, 1.0)
    assert batch.stats["rollout/groups_filtered"] == (3.0, 1.0)
    assert batch.stats["rollout/groups_trained"] == (4.0, 1.0)
    assert batch.stats["rollout/groups_surplus"] == (1.0, 1.0)
    assert batch.stats["rollout/refill_rounds"] == (1.0, 1.0)
    assert batch.stats["rollout/refill_capped"] == (0.0, 1.0)
    assert batch.stats["rollout/dropped_group_frac"] == (3.0, 8.0)
    # The next step's prompts follow the refill's: data positions 8-11.
    assert dm.refill_prompts == 4 and [r.index for r in dm.ticket(1).records] == [8, 9, 10, 11]
    assert dm.state_dict()["refill_prompts"] == 4


def test_refill_stops_at_the_factor_and_trains_what_it_has(engine):
    # Step 0: positions 0-1 hold one informative group; round 1 draws 2 more (the budget: 2 x 2), both flat.
    dm = _datamodule(engine, prompts=2, n=8, task=_ScriptedTask([F0, ONE_SUCCESS, F1, F0]),
                     drop_zero_variance_groups=True, refill=True, max_refill_factor=2)
    batch = dm.rollout(dm.ticket(0))
    assert sorted(_trained(batch)) == [1]
    assert {k: v[0] for k, v in batch.stats.items() if "groups_" in k or "refill_" in k} == {
        "rollout/groups_generated": 4.0, "rollout/groups_filtered": 3.0, "rollout/groups_trained": 1.0,
        "rollout/groups_surplus": 0.0, "rollout/refill_rounds": 1.0, "rollout/refill_capped": 1.0}
    # No informative group at all: the step's own groups train (advantages zero), as without refill.
    dm = _datamodule(engine, prompts=2, n=8, task=_ScriptedTask([F0]), drop_zero_variance_groups=True,
                     refill=True, max_refill_factor=2.5)  # budget: 5 groups
    batch = dm.rollout(dm.ticket(0))
    trained = _trained(batch)
    assert sorted(trained) == [0, 1] and all(a == 0.0 for rows in trained.values() for _, a in rows)
    assert batch.stats["rollout/groups_generated"] == (5.0, 1.0) and batch.stats["rollout/refill_rounds"] == (1.0, 1.0)
    assert batch.stats["rollout/groups_trained"] == (2.0, 1.0) and batch.stats["rollout/refill_capped"] == (1.0, 1.0)
    # Refill off: the same metric names as before, no refill keys, no data position moved.
    dm = _datamodule(engine, prompts=2, n=8, task=_ScriptedTask([F0, ONE_SUCCESS]), drop_zero_variance_groups=True)
    batch = dm.rollout(dm.ticket(0))
    assert not any("refill" in k or "surplus" in k for k in batch.stats) and dm.refill_prompts == 0
    assert batch.stats["rollout/groups_generated"] == (2.0, 1.0) and batch.stats["rollout/groups_filtered"] == (1.0, 1.0)


class _Releasing(EngineWrapper, ReleasesMemory):
    """An engine on the trainer's devices (as colocated SGLang servers are), logging its calls."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner, self.vocab_size, self.calls = inner, inner.vocab_size, []

    def generate(self, prompts, params, *, seed=None):
        self.calls.append("generate")
        return self.inner.generate(prompts, params, seed=seed)

    def update_weights(self, named_tensors) -> None:
        self.calls.append("update")

    def release_memory(self) -> None:
        self.calls.append("release")

    def close(self) -> None:
        pass


def test_an_engine_on_the_trainers_devices_releases_its_memory_once_after_the_steps_last_generation(engine):
    releasing = _Releasing(engine)
    dm = _datamodule(releasing, prompts=2, n=8, task=_ScriptedTask([F0, ONE_SUCCESS, F1, F0]),
                     drop_zero_variance_groups=True, refill=True, max_refill_factor=2)
    dm.rollout(dm.ticket(0))  # the step's own groups, then one refill round
    assert releasing.calls == ["generate", "generate", "release"]


def test_refill_round_sizes():
    plan = RefillPlan(target=4, max_factor=4)
    assert plan.budget == 16
    assert plan.next_round(informative=4, generated=4) == 0  # full
    assert plan.next_round(informative=2, generated=4) == 4  # 2 missing at 1 in 2 informative
    assert plan.next_round(informative=3, generated=12) == 4  # 1 missing at 1 in 4
    assert plan.next_round(informative=0, generated=4) == 12  # none seen: at most the budget
    assert plan.next_round(informative=1, generated=16) == 0  # budget spent
    assert RefillPlan(target=10, max_factor=2.3).budget == 23  # not 22: 2.3 * 10 is 22.999... in floats
    assert RefillPlan(target=3, max_factor=1).next_round(informative=0, generated=3) == 0


def test_a_refill_round_numbers_its_samples_past_a_split_trajectory():
    """A multi-turn step numbers samples from first_group * n on, more than n per group where a trajectory split:
    round 0's 2 groups x n=2 gave 5 samples (0-4), round 1 starts at group 2 (index 4): moved on to 5."""
    earlier = [_sample([1], [2], index=i) for i in range(5)]
    new = [_sample([1], [2], index=i) for i in (4, 5)]
    continue_indices(earlier, new)
    assert [s.index for s in new] == [5, 6]
    apart = [_sample([1], [2], index=i) for i in (8, 9)]  # single-turn numbering never collides: left as it is
    continue_indices(earlier, apart)
    assert [s.index for s in apart] == [8, 9]


def test_refill_settings_are_refused_at_construction(engine):
    with pytest.raises(ValueError, match=r"data.refill=True: must be false while data.drop_zero_variance_groups"):
        _datamodule(engine, refill=True)
    with pytest.raises(ValueError, match=r"data.max_refill_factor=0.5: must be a finite number >= 1"):
        _datamodule(engine, drop_zero_variance_groups=True, refill=True, max_refill_factor=0.5)
    with pytest.raises(ValueError, match=r"data.refill=True: must be false with rollout.max_staleness=1 \(or rollout.overlap=true\)"):
        _datamodule(engine, drop_zero_variance_groups=True, refill=True, overlap=True)


def test_refill_resume_continues_identically(engine, tmp_path):
    """A checkpoint after refilled steps holds the prompts they drew: the resumed run draws the same prompts and
    seeds as the uninterrupted one."""
    patterns = [F0[:4], [1.0, 0.0, 0.0, 0.0], F1[:4]]  # a third of the groups informative: every step refills

    def make():
        return _datamodule(engine, prompts=2, n=4, task=_ScriptedTask(patterns), drop_zero_variance_groups=True,
                           refill=True)

    trainer, first = _fit(make(), 2)
    ckpt = tmp_path / "two.ckpt"
    trainer.save_checkpoint(ckpt)
    assert trainer.datamodule.refill_prompts > 0
    _, resumed = _fit(make(), 4, ckpt=str(ckpt))
    _, straight = _fit(make(), 4)
    assert [b.step for b in resumed] == [2, 3]
    for a, b in zip(resumed, straight[2:], strict=True):
        assert b.stats["rollout/refill_rounds"][0] > 0
        assert [s.tokens for s in a.samples] == [s.tokens for s in b.samples]
        assert [s.rollout_log_probs for s in a.samples] == [s.rollout_log_probs for s in b.samples]
        assert a.stats["rollout/groups_generated"] == b.stats["rollout/groups_generated"]


def _dp_refill(rank: int) -> dict:
    """On each of 2 gloo ranks: a refilled step where rank 0's own groups are all informative and rank 1's are not."""
    torch.manual_seed(0)
    model = build_tiny_model(tokenizer=TOK, seed=0, initializer_range=0.2)
    engine = EmbeddedEngine(model, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id, progress=False)
    patterns = [ONE_SUCCESS, ONE_FAILURE, F0, ONE_SUCCESS, F0, F0, F1, BALANCED]
    dm = _datamodule(engine, prompts=4, n=8, task=_ScriptedTask(patterns), drop_zero_variance_groups=True,
                     refill=True, max_refill_factor=3, dp_rank=rank, dp_size=2)
    batch = dm.rollout(dm.ticket(0))
    return {"groups": [s.group_index for s in batch.samples[::8]],
            "trained": sorted(_trained(batch)), "stats": batch.stats, "refill_prompts": dm.refill_prompts,
            "next": [r.index for r in dm.ticket(1).records]}


@pytest.mark.distributed
def test_refill_ranks_run_the_same_rounds():
    """Rank 0 needs no refill, rank 1 two rounds: rank 0 joins both (generating nothing), so no collective hangs;
    each rank trains its share, and the step's counts are the same on both ranks."""
    from dist_utils import run_distributed

    ranks = run_distributed(_dp_refill, 2)
    # Rank 1 (positions 2-3: one informative group) draws 2 (positions 4-5, both flat), then 2 more (the
    # budget, 3 x 2: positions 6-7); its groups are numbered as their data positions.
    assert ranks[0]["groups"] == [0, 1] and ranks[1]["groups"] == [2, 3, 4, 5, 6, 7]
    assert ranks[0]["trained"] == [0, 1] and ranks[1]["trained"] == [3, 7]
    expected = {"rollout/groups_generated": 8.0, "rollout/groups_filtered": 4.0, "rollout/groups_trained": 4.0,
                "rollout/groups_surplus": 0.0, "rollout/refill_rounds": 2.0, "rollout/refill_capped": 0.0}
    for r in ranks:
        assert {k: v for k, v in r["stats"].items() if k in expected} == {k: (v, 1.0) for k, v in expected.items()}
        assert r["refill_prompts"] == 4
    assert ranks[0]["next"] == [8, 9] and ranks[1]["next"] == [10, 11]
