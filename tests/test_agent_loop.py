"""The multi-turn agent loop (`topp_rl.rollout.agent_step.AgentLoopStep`) with the real tiny model and the
embedded engine: the token rule (each turn's engine prompt is the exact ids so far; environment tokens appear
once, untrained), budgets, failing environments (sync and async; hung in start, an answer or the reward),
concurrency (one engine call per round for every live trajectory; a round's environment calls all in flight at
once), and the lookup task's rewards."""

import asyncio
import contextlib
import copy
import dataclasses
import threading

import pytest
import torch

from topp_rl.data import PromptRecord, SamplingParams
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.engines.base import RolloutEngine
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.losses import GRPOLoss
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.models.moe import moe_routing
from topp_rl.rollout.agent_step import AgentLoopStep
from topp_rl.rollout.packing import pack_samples
from topp_rl.rollout.step import RolloutStep
from topp_rl.tasks.environment import ModelTurn
from topp_rl.tasks.lookup import LookupEnvironment, LookupTask
from topp_rl.trainer.backbone import HFBackbone
from topp_rl.trainer.hook import ToppLogProb
from topp_rl.trainer.module import PolicyModule
from topp_rl.trainer.timer import PhaseTimer

TOK = build_char_tokenizer()
PARAMS = SamplingParams(top_p=0.9, max_new_tokens=3, n=2)


@pytest.fixture(scope="module")
def engine():
    return EmbeddedEngine(build_tiny_model(tokenizer=TOK, seed=3, initializer_range=0.3), progress=False)


class Spy(RolloutEngine):
    """The real engine, recording the prompts of every `generate` call (one call per round)."""

    def __init__(self, inner: EmbeddedEngine) -> None:
        self.inner, self.calls, self.outputs = inner, [], []
        self.vocab_size, self.shares_trainer_weights, self.shared_by_ranks = inner.vocab_size, False, False
        self.max_candidates, self.records_routes = None, inner.records_routes

    def generate(self, prompts, params, *, seed=None):
        self.calls.append(([list(p) for p in prompts], params))
        self.outputs.append(self.inner.generate(prompts, params, seed=seed))
        return self.outputs[-1]

    def holding_weights(self):
        return self.inner.holding_weights()

    def update_weights(self, named_tensors) -> None: ...

    def close(self) -> None: ...


class Echo:
    """Answers every turn with "<k>;" (k its turn number) as text, or as ids on odd turns; reward = turns."""

    def __init__(self, *, turns: int | None = None) -> None:
        self.turns = turns  # end after this many model turns (None: never)

    def start(self, record):
        return EchoEpisode(self.turns)


class EchoEpisode:
    def __init__(self, turns):
        self.turns, self.seen = turns, []

    def respond(self, turn: ModelTurn):
        self.seen.append(turn)
        if self.turns is not None and len(self.seen) >= self.turns:
            return None
        text = f"{turn.index};"
        return text if turn.index % 2 == 0 else TOK.encode(text, add_special_tokens=False)

    def reward(self):
        return {"score": float(len(self.seen)), "turns": len(self.seen)}


def records(count: int = 3) -> list[PromptRecord]:
    task = LookupTask()
    return [task.prompt(i, TOK) for i in range(count)]


def test_each_turn_extends_the_exact_ids_and_env_tokens_appear_once(engine):
    spy = Spy(engine)
    step = AgentLoopStep(environment=Echo(turns=3), max_turns=5, max_trajectory_tokens=64)
    assert isinstance(step, RolloutStep)
    recs = records()
    samples = step.generate(spy, recs, PARAMS, seed=11, tokenizer=TOK)
    assert len(spy.calls) == 3 and all(p.n == 1 for _, p in spy.calls)  # one engine call per round
    assert all(len(prompts) == 6 for prompts, _ in spy.calls)  # every trajectory's turn in each round
    for j, s in enumerate(samples):
        assert s.prompt_ids == recs[j // 2].prompt_ids and s.metadata["turns"] == 3 and s.metadata["end"] == "env"
        # Round k's engine prompt for this trajectory is exactly the prompt + every earlier turn's ids.
        mask = s.loss_mask
        model_runs = _runs(mask, 1)
        assert len(model_runs) == 3
        for k, (a, _) in enumerate(model_runs):
            assert spy.calls[k][0][j] == s.prompt_ids + s.response_ids[:a]
        # Environment output "0;" and "1;" between the turns, once each, untrained and unrestricted.
        env = _runs(mask, 0)
        assert [s.response_ids[a:b] for a, b in env] == [TOK.encode(f"{k};", add_special_tokens=False)
                                                         for k in range(2)]
        assert s.metadata["env_tokens"] == sum(b - a for a, b in env) == 4
        rows = s.candidates.row_lengths()
        for a, b in env:
            assert s.rollout_log_probs[a:b] == [0.0] * (b - a) and bool((rows[a:b] == 0).all())
        for a, b in model_runs:
            assert bool((rows[a:b] > 0).all()) and all(x < 0 or x == 0.0 for x in s.rollout_log_probs[a:b])


def _runs(mask: list[int], value: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of `value` in `mask`."""
    out, start = [], None
    for i, m in enumerate([*mask, -1]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


def test_rewards_come_from_the_episodes_and_stats_count_turns(engine):
    step = AgentLoopStep(environment=Echo(turns=2), max_turns=4, max_trajectory_tokens=64)
    result = step.run(engine, records(2), PARAMS, task=LookupTask(), tokenizer=TOK, seed=1, first_group=3)
    samples = result.samples
    assert [s.index for s in samples] == [6, 7, 8, 9] and [s.reward for s in samples] == [2.0] * 4
    assert all(s.metadata["env_reward_info"] == {"turns": 2} for s in samples)
    stats = step.stats(samples)
    assert stats["rollout/turns_mean"] == (8.0, 4.0)
    env = sum(s.metadata["env_tokens"] for s in samples)
    assert env == 8 and stats["rollout/env_tokens_frac"] == (8.0, float(sum(s.response_length for s in samples)))
    assert stats["rollout/samples_per_trajectory_mean"] == (4.0, 4.0)
    for key in ("prefix_breaks", "env_errors", "env_timeouts", "trajectories_failed", "max_turns_ended",
                "max_tokens_ended"):
        assert stats[f"rollout/{key}"] == (0.0, 1.0), key


def test_budgets_end_trajectories_and_are_counted(engine):
    by_turns = AgentLoopStep(environment=Echo(), max_turns=2, max_trajectory_tokens=64)
    samples = by_turns.generate(engine, records(2), PARAMS, seed=2, tokenizer=TOK)
    assert all(s.metadata["turns"] == 2 and s.metadata["end"] == "max_turns" for s in samples)
    assert all(s.status == SampleStatus.TRUNCATED for s in samples)
    assert all(s.loss_mask[-1] == 1 for s in samples)  # the last turn's answer is dropped, not appended
    assert by_turns.stats(samples)["rollout/max_turns_ended"] == (4.0, 1.0)
    by_tokens = AgentLoopStep(environment=Echo(), max_turns=10, max_trajectory_tokens=7)
    samples = by_tokens.generate(engine, records(2), PARAMS, seed=2, tokenizer=TOK)
    assert all(s.response_length <= 7 and s.metadata["end"] == "max_tokens" for s in samples)
    assert by_tokens.stats(samples)["rollout/max_tokens_ended"] == (4.0, 1.0)


class Flaky:
    """Episodes of record 0 hang (or raise) in `respond`; the others answer once, then end. Sync or async."""

    def __init__(self, *, fail: str, asynchronous: bool, release: threading.Event) -> None:
        self.fail, self.asynchronous, self.release = fail, asynchronous, release

    def start(self, record):
        bad = record.index == 0
        cls = AsyncFlakyEpisode if self.asynchronous else FlakyEpisode
        return cls(bad=bad, fail=self.fail, release=self.release)


class FlakyEpisode:
    def __init__(self, *, bad, fail, release):
        self.bad, self.fail, self.release, self.turns = bad, fail, release, 0

    def respond(self, turn):
        self.turns += 1
        if self.bad and self.fail == "raise":
            raise RuntimeError("tool crashed")
        if self.bad:
            self.release.wait(30)  # hangs past the timeout (released at the test's end)
        return "=1;" if self.turns == 1 else None

    def reward(self):
        return 1.0


class AsyncFlakyEpisode(FlakyEpisode):
    async def respond(self, turn):
        self.turns += 1
        if self.bad and self.fail == "raise":
            raise RuntimeError("tool crashed")
        if self.bad:
            await asyncio.sleep(30)
        return "=1;" if self.turns == 1 else None

    async def reward(self):
        return 1.0


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fail", ["hang", "raise"])
def test_a_failing_env_call_ends_only_its_trajectory(engine, fail, asynchronous):
    release = threading.Event()
    try:
        env = Flaky(fail=fail, asynchronous=asynchronous, release=release)
        step = AgentLoopStep(environment=env, max_turns=4, max_trajectory_tokens=64, env_timeout_s=0.5)
        samples = step.run(engine, records(3), PARAMS, task=LookupTask(), tokenizer=TOK, seed=0).samples
    finally:
        release.set()
    kind = "env_timeout" if fail == "hang" else "env_error"
    assert [s.metadata["end"] for s in samples] == [kind] * 2 + ["env"] * 4
    assert [s.reward for s in samples] == [0.0] * 2 + [1.0] * 4
    assert [s.metadata["turns"] for s in samples] == [1] * 2 + [2] * 4
    assert all(s.status == SampleStatus.COMPLETED for s in samples)  # kept: the model's turn trains, reward 0
    episode = "AsyncFlakyEpisode" if asynchronous else "FlakyEpisode"
    message = ("respond took longer than rollout.step.env_timeout_s=0.5 s" if fail == "hang" else
               "respond raised RuntimeError: tool crashed")
    assert samples[0].metadata["env_error"].startswith(f"{episode}.{message}")
    stats = step.stats(samples)
    assert stats["rollout/trajectories_failed"] == (2.0, 1.0)
    assert stats[f"rollout/{'env_timeouts' if fail == 'hang' else 'env_errors'}"] == (2.0, 1.0)
    assert stats[f"rollout/{'env_errors' if fail == 'hang' else 'env_timeouts'}"] == (0.0, 1.0)


def test_more_failures_than_allowed_raise(engine):
    step = AgentLoopStep(environment=Flaky(fail="raise", asynchronous=False, release=threading.Event()),
                         max_turns=4, max_trajectory_tokens=64, max_failed_frac=0.25)
    samples = step.generate(engine, records(3), PARAMS, seed=0, tokenizer=TOK)
    with pytest.raises(RuntimeError, match=r"2 of 6 trajectories failed this step \(share 0.33 > "
                                           r"rollout.step.max_failed_frac=0.25\); first failure: exception: "
                                           r"FlakyEpisode.respond raised RuntimeError: tool crashed; fix the "
                                           r"environment"):
        step.check(samples)
    # Decided on the step's counts summed over DP ranks (here: another rank with 10 clean trajectories) ...
    step.check(samples, reduce_sum=lambda t: t + torch.tensor([0.0, 10.0, 0.0], dtype=t.dtype))
    # ... so a rank whose own trajectories are fine raises too when the step's share is over.
    clean = [s for s in samples if s.metadata["end"] == "env"]
    with pytest.raises(RuntimeError, match=r"5 of 9 trajectories failed this step .* first failure: on another "
                                           r"data-parallel rank"):
        step.check(clean, reduce_sum=lambda t: t + torch.tensor([5.0, 5.0, 0.0], dtype=t.dtype))


class FailingStart:
    def start(self, record):
        raise ValueError("no such record")


def test_a_trajectory_that_fails_to_start_is_aborted_and_counted(engine):
    step = AgentLoopStep(environment=FailingStart(), max_turns=2, max_trajectory_tokens=64, max_failed_frac=1.0)
    samples = step.generate(engine, records(1), PARAMS, seed=0, tokenizer=TOK)
    assert [s.status for s in samples] == [SampleStatus.ABORTED] * 2 and all(s.response_length == 0 for s in samples)
    assert step.stats(samples)["rollout/env_errors"] == (2.0, 1.0)


def test_bad_settings_are_refused():
    with pytest.raises(TypeError, match="environment is a dict; pass a topp_rl.tasks.environment.Environment"):
        AgentLoopStep(environment={"_target_": "x"}, max_turns=2, max_trajectory_tokens=8)
    with pytest.raises(ValueError, match=r"rollout.step.max_turns=0 must be an integer >= 1"):
        AgentLoopStep(environment=Echo(), max_turns=0, max_trajectory_tokens=8)
    for frac in (1.5, float("nan"), "abc"):
        with pytest.raises(ValueError, match=r"rollout.step.max_failed_frac=.* must be a number in \[0, 1\]"):
            AgentLoopStep(environment=Echo(), max_turns=2, max_trajectory_tokens=8, max_failed_frac=frac)
    for seconds in (0, -1.0, 86400.5, float("inf"), float("nan"), "30", True):
        with pytest.raises(ValueError, match=r"rollout.step.env_timeout_s=.* must be a finite number of seconds in "
                                             r"\(0, 86400\]"):
            AgentLoopStep(environment=Echo(), max_turns=2, max_trajectory_tokens=8, env_timeout_s=seconds)


def test_lookup_rewards_calls_and_repeats():
    task = LookupTask()
    record = task.prompt(5, TOK)
    key, value = record.data["key"], record.answer
    assert record.text == f"?{key}" and record.data["table"][key] == value
    episode = LookupEnvironment().start(record)
    assert episode.respond(ModelTurn(index=0, ids=[], text=key, finished=False)) == f"={value}"
    assert episode.respond(ModelTurn(index=1, ids=[], text=value, finished=False)) is None
    assert episode.reward() == 1.0 == task.reward(f"{key}={value}{value}", record)
    other = next(k for k in record.data["table"] if k != key)
    wrong_call = LookupEnvironment().start(record)
    shown = wrong_call.respond(ModelTurn(index=0, ids=[], text=other, finished=False))
    assert shown == f"={record.data['table'][other]}"
    wrong_call.respond(ModelTurn(index=1, ids=[], text=shown[1], finished=False))
    assert wrong_call.reward() == 0.5  # repeated what the tool said, after calling the wrong key
    other_digit = str((int(value) + 1) % 10)
    assert task.reward(f"{key}={value}{other_digit}", record) == 0.5  # digit_credit 0 by default
    credit = LookupTask(digit_credit=0.2)
    assert credit.reward(f"{key}={value}{other_digit}", credit.prompt(5, TOK)) == pytest.approx(0.6)  # 0.2 of 0.5
    assert credit.reward(f"{key}={value}x", credit.prompt(5, TOK)) == 0.5  # a letter earns nothing for the answer
    no_key = LookupEnvironment().start(record)
    assert no_key.respond(ModelTurn(index=0, ids=[], text="?", finished=False)) is None and no_key.reward() == 0.0


def test_env_token_ids_outside_the_vocabulary_fail_the_trajectory(engine):
    class BadIds(Echo):
        def start(self, record):
            episode = EchoEpisode(None)
            episode.respond = lambda turn: [10**6]
            return episode

    step = AgentLoopStep(environment=BadIds(), max_turns=3, max_trajectory_tokens=64, max_failed_frac=1.0)
    samples = step.generate(engine, records(1), PARAMS, seed=0, tokenizer=TOK)
    assert all(s.metadata["end"] == "env_error" and "outside the vocabulary" in s.metadata["env_error"]
               for s in samples)
    assert torch.tensor([s.response_length for s in samples]).min() >= 1


def test_moe_routes_cover_the_whole_trajectory_from_the_last_turns_call():
    """An MoE engine records routes per call; a trajectory keeps its last model turn's call's routes, which cover
    the prompt, every earlier turn and the environment's tokens. The embedded engine recomputes the prefix in every
    call, in other batches: each earlier call's routes equal the trajectory's on the tokens that call fed, so one
    route set fits every turn's log-probs. Replayed, the trainer's log-probs equal the rollout's over trained
    tokens; a budget cut cuts the routes with the sample."""
    model = build_tiny_model("qwen3_moe", tokenizer=TOK, seed=3, initializer_range=0.3)
    spy = Spy(EmbeddedEngine(model, progress=False))
    assert spy.records_routes
    step = AgentLoopStep(environment=Echo(turns=3), max_turns=3, max_trajectory_tokens=64)
    samples = step.run(spy, records(2), PARAMS, task=LookupTask(), tokenizer=TOK, seed=4).samples
    routing = moe_routing(model)
    for j, s in enumerate(samples):
        s.check_routes(routing)  # [prompt + response - 1, layers, k]
        assert s.metadata["turns"] == 3 and s.metadata["env_tokens"] > 0
        for outs in spy.outputs:
            fed = outs[j].routes.shape[0]
            assert torch.equal(s.routes[:fed], outs[j].routes)
    assert torch.equal(samples[0].routes, spy.outputs[-1][0].routes)  # the last call fed the whole trajectory
    (batch,) = pack_samples(samples, torch.zeros(len(samples)), max_tokens=4096)
    module = PolicyModule(policy=HFBackbone(copy.deepcopy(model), routing_replay=True), loss=GRPOLoss(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), hook=ToppLogProb(use_mask=True))
    _, record = module.onpolicy_pass(batch)
    trained = batch.loss_mask == 1
    gap = (record.logprobs - record.rollout_logprobs).abs()[trained]
    assert float(gap.max()) <= 1e-5 and float(record.routing_agreement[0]) == float(record.routing_agreement[1])
    cut = AgentLoopStep(environment=Echo(), max_turns=10, max_trajectory_tokens=7)
    for s in cut.generate(spy, records(1), PARAMS, seed=2, tokenizer=TOK):
        assert s.metadata["end"] == "max_tokens"
        s.check_routes(routing)


def test_a_sharded_engine_gathers_once_per_step_not_per_turn():
    """FSDP's shared, sharded module gathers its weights in every `generate` (a collective); the agent loop's rounds
    differ in number between data-parallel ranks, so the step holds the weights once for all its turns."""
    gathers = []

    @contextlib.contextmanager
    def gathered():
        gathers.append(len(gathers))
        yield

    sharded = EmbeddedEngine(build_tiny_model(tokenizer=TOK, seed=3), share_weights=True, progress=False)
    sharded.sample_sharded(gathered)
    sharded.generate([[1, 2]], PARAMS, seed=0)
    assert len(gathers) == 1  # one gather per call outside a step
    spy = Spy(sharded)
    step = AgentLoopStep(environment=Echo(turns=3), max_turns=3, max_trajectory_tokens=64)
    step.generate(spy, records(1), PARAMS, seed=0, tokenizer=TOK)
    assert len(spy.calls) == 3 and len(gathers) == 2  # three rounds, one gather


def _grads(module, micro):
    module.policy.zero_grad(set_to_none=True)
    old = [module.onpolicy_pass(mb)[0] for mb in micro]
    metrics, _ = module.accumulate_gradients(micro, module.reference_pass(micro), old=old, timer=PhaseTimer())
    return [p.grad.clone() for p in module.policy.parameters()], metrics


def test_environment_tokens_change_nothing_in_the_loss_or_gradients(engine):
    """Every per-token field of the environment's tokens, and the ids of environment tokens no trained token
    comes after, changed: the loss and every gradient stay bit for bit the same (a KL term and TIS included)."""
    step = AgentLoopStep(environment=Echo(turns=3), max_turns=3, max_trajectory_tokens=64)
    samples = step.run(engine, records(2), PARAMS, task=LookupTask(), tokenizer=TOK, seed=5).samples
    tail = TOK.encode("9;", add_special_tokens=False)
    for s in samples:  # environment output after the last turn: nothing trained sees it
        s.append_response_tokens(tail, trainable=False)
    (batch,) = pack_samples(samples, torch.linspace(-1.0, 1.5, len(samples)), max_tokens=4096)
    env = batch.loss_mask == 0
    assert 0 < int(env.sum()) < env.numel() and batch.candidates.row_lengths()[env].eq(0).all()
    changed = dataclasses.replace(batch, tokens=batch.tokens.clone(), response_tokens=batch.response_tokens.clone(),
                                  rollout_log_probs=batch.rollout_log_probs.clone(), advantages=batch.advantages.clone())
    changed.rollout_log_probs[env] = -3.7
    changed.advantages[env] = 9.0
    ends_r = torch.cumsum(batch.response_lengths, 0)
    ends_t = batch.cu_seqlens[1:].long()
    for back in (1, 2):  # the tail's two ids in every sequence, in the tokens and the response tokens alike
        changed.response_tokens[ends_r - back] = 40 + back
        changed.tokens[ends_t - back] = 40 + back
    assert not torch.equal(changed.tokens, batch.tokens)
    policy = build_tiny_model(tokenizer=TOK, seed=3, initializer_range=0.3)
    module = PolicyModule(policy=HFBackbone(policy), loss=GRPOLoss(kl_coef=0.1, tis_cap=2.0),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          hook=ToppLogProb(use_mask=True, temperature=1.0))
    # The on-policy record the metric callbacks read: trained tokens agree with the rollout; environment tokens
    # (rollout log-prob 0, no candidate row) would not, so the callbacks' loss-mask weighting is what keeps them out.
    _, record = module.onpolicy_pass(batch)
    assert torch.equal(record.loss_mask, batch.loss_mask)
    gap = (record.logprobs - record.rollout_logprobs).abs()
    assert float(gap[~env].max()) <= 1e-5 and float(gap[env].min()) > 0.5
    assert bool((record.support_size[env] == 0).all()) and bool((record.support_size[~env] > 0).all())
    grads, metrics = _grads(module, [batch])
    grads_changed, metrics_changed = _grads(module, [changed])
    assert any(float(g.abs().max()) > 1e-4 for g in grads), "the test needs a non-zero gradient"
    assert metrics["train/loss"] == metrics_changed["train/loss"]
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_changed, strict=True))
    # ... while a model token's advantage does change them (the comparison can see a difference).
    model_token = int((~env).nonzero()[0])
    changed.advantages[model_token] += 1.0
    assert _grads(module, [changed])[1]["train/loss"] != metrics["train/loss"]


class Staggered(Echo):
    """Record j's episodes end after j + 1 turns: the trajectories of a step finish in different rounds."""

    def start(self, record):
        return EchoEpisode(record.index + 1)


def test_turns_of_all_live_trajectories_share_one_engine_call_per_round(engine):
    spy = Spy(engine)
    step = AgentLoopStep(environment=Staggered(), max_turns=8, max_trajectory_tokens=64)
    samples = step.generate(spy, records(3), PARAMS, seed=4, tokenizer=TOK)
    turns = [s.metadata["turns"] for s in samples]
    assert turns == [1, 1, 2, 2, 3, 3]
    # Rounds = the longest trajectory's turns (3 engine calls), not one call per turn (12) or per trajectory (6);
    # each call carries every trajectory still live in that round.
    assert len(spy.calls) == max(turns) == 3 and [len(p) for p, _ in spy.calls] == [6, 4, 2]


class Gathered(Echo):
    """Every episode's first answer waits until all `parties` episodes are answering at once (a barrier): it
    can only pass when the loop runs a round's environment calls concurrently (sync ones on threads of their
    own, async ones on the event loop); run one at a time, the first would wait out the timeout."""

    def __init__(self, *, parties: int, asynchronous: bool) -> None:
        super().__init__(turns=2)
        self.asynchronous = asynchronous
        self.barrier = asyncio.Barrier(parties) if asynchronous else threading.Barrier(parties)

    def start(self, record):
        episode = EchoEpisode(self.turns)
        answer = episode.respond

        def first_waits(turn):
            if turn.index == 0:
                self.barrier.wait(timeout=30)
            return answer(turn)

        async def first_waits_async(turn):
            if turn.index == 0:
                await self.barrier.wait()
            return answer(turn)

        episode.respond = first_waits_async if self.asynchronous else first_waits
        return episode


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_environment_calls_of_a_round_run_concurrently(engine, asynchronous):
    env = Gathered(parties=6, asynchronous=asynchronous)
    step = AgentLoopStep(environment=env, max_turns=4, max_trajectory_tokens=64, env_timeout_s=30.0)
    samples = step.generate(engine, records(3), PARAMS, seed=6, tokenizer=TOK)
    assert [s.metadata["end"] for s in samples] == ["env"] * 6 and all(s.metadata["turns"] == 2 for s in samples)


class HangsAt(Echo):
    """Record 0's episodes hang in `start` or in `reward` (sync, released at the test's end); the others run."""

    def __init__(self, *, stage: str, release: threading.Event) -> None:
        super().__init__(turns=2)
        self.stage, self.release = stage, release

    def start(self, record):
        if record.index == 0 and self.stage == "start":
            self.release.wait(30)
        episode = EchoEpisode(self.turns)
        if record.index == 0 and self.stage == "reward":
            episode.reward = lambda: self.release.wait(30)
        return episode


@pytest.mark.parametrize("stage", ["start", "reward"])
def test_a_hung_start_or_reward_ends_only_its_trajectory(engine, stage):
    release = threading.Event()
    try:
        step = AgentLoopStep(environment=HangsAt(stage=stage, release=release), max_turns=4,
                             max_trajectory_tokens=64, env_timeout_s=0.5)
        samples = step.run(engine, records(3), PARAMS, task=LookupTask(), tokenizer=TOK, seed=0).samples
    finally:
        release.set()
    assert [s.metadata["end"] for s in samples] == ["env_timeout"] * 2 + ["env"] * 4
    hung_status = SampleStatus.ABORTED if stage == "start" else SampleStatus.COMPLETED  # no tokens / its turns
    assert [s.status for s in samples] == [hung_status] * 2 + [SampleStatus.COMPLETED] * 4
    hung_reward = None if stage == "start" else 0.0  # aborted: never scored (nor trained on)
    assert [s.reward for s in samples] == [hung_reward] * 2 + [2.0] * 4
    assert [s.metadata["turns"] for s in samples] == [0 if stage == "start" else 2] * 2 + [2] * 4
    assert step.stats(samples)["rollout/env_timeouts"] == (2.0, 1.0)


def test_a_step_never_formats_its_samples(engine, monkeypatch):
    """asyncio.run on the main thread formats its task's repr, result included, when it restores the SIGINT
    handler: the loop's task returns None, or every step would format up to 6 samples, every tensor of each."""
    formatted = []
    monkeypatch.setattr(Sample, "__repr__", lambda self: formatted.append(self) or "Sample(...)")
    assert threading.current_thread() is threading.main_thread()  # where asyncio.run installs the handler
    samples = AgentLoopStep(environment=Echo(turns=2), max_turns=2, max_trajectory_tokens=64).generate(
        engine, records(2), PARAMS, seed=0, tokenizer=TOK)
    assert len(samples) == 4 and formatted == []
    repr(samples[0])  # the spy sees a repr when there is one
    assert formatted == [samples[0]]
