"""The OpenAI-compatible endpoint (`topp_rl.rollout.endpoint`) with the real tiny model, the embedded engine, a real
aiohttp server on 127.0.0.1 and the real openai SDK client: what the responses carry, the join / split rule, the
refusals, per-trajectory advantages over split trajectories, and bad agent functions (counted, nothing hangs).
The agents are in tests/endpoint_agents.py, named by file path like a user's."""

import json
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg

from topp_rl.config import validate_config
from topp_rl.data import PromptRecord, SamplingParams
from topp_rl.data.sample import SampleStatus
from topp_rl.engines.base import RolloutEngine
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.rollout.advantages import GroupAdvantage, RLOOAdvantage, trajectory_advantages
from topp_rl.rollout.agent_step import AgentLoopStep
from topp_rl.rollout.endpoint import step as endpoint_step
from topp_rl.rollout.endpoint.step import EndpointStep
from topp_rl.rollout.endpoint.wire import (
    CHAT_KEYS,
    MINIMAL_CHAT_TEMPLATE,
    Refused,
    chat_response,
    check_request,
    parse_tool_calls,
)
from topp_rl.rollout.packing import pack_samples
from topp_rl.tasks.agent_task import AgentTask, resolve_agent
from topp_rl.tasks.lookup import LookupTask
from topp_rl.tasks.rewards import RewardError

TOK = build_char_tokenizer()
AGENTS = Path(__file__).parent / "endpoint_agents.py"
PARAMS = SamplingParams(top_p=0.9, max_new_tokens=3, n=2)


def agent(name: str) -> str:
    return f"{AGENTS}:{name}"


@pytest.fixture(scope="module")
def engine():
    return EmbeddedEngine(build_tiny_model(tokenizer=TOK, seed=3, initializer_range=0.3), progress=False)


def records(k: int = 2) -> list[PromptRecord]:
    texts = ["?a", "?bc", "?d", "?ef"][:k]
    return [PromptRecord(index=i, text=t, prompt_ids=[TOK.bos_token_id, *TOK.encode(t, add_special_tokens=False)])
            for i, t in enumerate(texts)]


def run(engine, name: str, *, params=PARAMS, recs=None, **kwargs):
    recs = recs or records()
    step = EndpointStep(agent=agent(name), max_turns=kwargs.pop("max_turns", 4),
                        max_trajectory_tokens=kwargs.pop("max_trajectory_tokens", 64), **kwargs)
    samples = step.generate(engine, recs, params, seed=11, tokenizer=TOK)
    step.score(samples, recs, params, task=None, tokenizer=TOK, first_group=0)
    return step, samples


def test_chat_turns_join_or_split_by_their_exact_ids(engine):
    """The second chat request re-renders the first reply: it joins the first turn's sample when the rendered ids
    extend it exactly, and starts a second sample when they do not (the reply held an id the text drops: a special
    id, or one past the char tokenizer's 84)."""
    step, samples = run(engine, "chat_two_turns", recs=records(4))
    by_traj = {}
    for s in samples:
        by_traj.setdefault(s.metadata["trajectory"], []).append(s)
    joined = 0
    for parts in by_traj.values():
        (p1, c1), (p2, c2) = parts[0].metadata["env_reward_info"]["turns"]
        assert TOK.decode(p1).startswith("<bos>u:?") and TOK.decode(p1).endswith("<eos>a:")
        assert parts[0].prompt_ids == p1  # the chat template's ids, exactly what the engine was given
        assert {s.reward for s in parts} == {float(len(parts[0].metadata["answer"] or "")) or parts[0].reward}
        if p2[: len(p1) + len(c1)] == p1 + c1:
            joined += 1
            (s,) = parts
            env = p2[len(p1) + len(c1):]
            assert s.tokens == p2 + c2
            assert s.loss_mask == [1] * len(c1) + [0] * len(env) + [1] * len(c2)
            assert s.metadata["env_tokens"] == len(env) and s.metadata["prefix_breaks"] == 0
        else:
            first, second = parts
            assert first.tokens == p1 + c1 and second.tokens == p2 + c2 and all(second.loss_mask)
            assert first.metadata["prefix_breaks"] == 1
            assert TOK.decode(c1, skip_special_tokens=True) != TOK.decode(c1)[: len(c1)] or any(
                t >= len(TOK) or t in TOK.all_special_ids for t in c1)
        assert parts[0].metadata["turns"] == 2
        assert all(s.candidates is not None and s.candidates.num_rows == s.response_length for s in parts)
    assert 0 < joined < len(by_traj)  # both cases occur in this step (fixed seed)
    assert {s.reward for s in samples} == {2.0, 3.0}  # the agent's return value: len(record.text)
    stats = step.stats(samples)
    assert stats["rollout/prefix_breaks"] == (float(len(by_traj) - joined), 1.0)
    assert stats["rollout/samples_per_trajectory_mean"] == (float(len(samples)), 8.0)


def test_completions_with_token_ids_and_max_tokens(engine):
    _, samples = run(engine, "completion_ids")
    for s in samples:
        (p1, c1), (p2, c2) = s.metadata["env_reward_info"]["turns"]
        assert p2 == p1 + c1 + [5, 6, 7] and len(c2) == 1  # max_tokens=1 honoured by cutting
        assert s.prompt_ids == p1 and s.response_ids == c1 + [5, 6, 7] + c2
        assert s.loss_mask == [1] * len(c1) + [0, 0, 0] + [1]
        assert s.metadata["env_reward_info"]["texts"][1] == TOK.decode(c2, skip_special_tokens=True)


def test_rewritten_history_starts_a_second_sample_with_the_trajectory_reward(engine):
    step, samples = run(engine, "rewrites_history")
    assert len(samples) == 8  # 4 trajectories x 2 samples
    for first, second in zip(samples[::2], samples[1::2], strict=True):
        (p1, c1), (p2, c2) = first.metadata["env_reward_info"]["turns"]
        assert first.tokens == p1 + c1 and second.prompt_ids == p2 == p1[:1] + [9, 9] and second.response_ids == c2
        assert first.metadata["trajectory"] == second.metadata["trajectory"]
        assert first.reward == second.reward == first.group_index  # record index = group here
        assert [first.metadata["trajectory_sample"], second.metadata["trajectory_sample"]] == [0, 1]
        assert first.metadata["prefix_breaks"] == 1 and all(second.loss_mask)
    stats = step.stats(samples)
    assert stats["rollout/samples_per_trajectory_mean"] == (8.0, 4.0)
    assert stats["rollout/prefix_breaks"] == (4.0, 1.0)
    assert stats["rollout/turns_mean"] == (8.0, 4.0)


def test_split_trajectories_count_once_in_the_group_and_train_with_its_advantage(engine):
    """Rewards differ per trajectory (record 0: 1 and 3 samples...), so the group statistics would change if a
    split trajectory counted twice; the packed per-token advantages of both its samples are the trajectory's."""
    _, samples = run(engine, "rewrites_history", recs=records(2), params=SamplingParams(top_p=0.9, max_new_tokens=3,
                                                                                          n=3))
    # Give the trajectories distinct rewards (the agent's are per record) to make the statistics informative.
    for s in samples:
        s.reward = float(s.metadata["trajectory"] ** 2 % 5)
    for estimator in (GroupAdvantage(), RLOOAdvantage()):
        adv = trajectory_advantages(estimator, samples)
        firsts = [s for s in samples if s.metadata["trajectory_sample"] == 0]
        per_traj = estimator(torch.tensor([s.reward for s in firsts], dtype=torch.float64),
                             torch.tensor([s.group_index for s in firsts]))
        expected = torch.stack([per_traj[s.metadata["trajectory"]] for s in samples])
        assert torch.equal(adv, expected)
        # Counting every sample instead would give other values (the test could fail):
        naive = estimator(torch.tensor([s.reward for s in samples], dtype=torch.float64),
                          torch.tensor([s.group_index for s in samples]))
        assert not torch.allclose(naive, adv)
    adv = trajectory_advantages(GroupAdvantage(), samples)
    (batch,) = pack_samples(samples, adv, max_tokens=10_000)
    per_token = torch.repeat_interleave(adv, batch.response_lengths)
    assert torch.equal(batch.advantages, per_token)
    by_traj = {}
    for s, a in zip(samples, adv.tolist(), strict=True):
        by_traj.setdefault(s.metadata["trajectory"], set()).add(a)
    assert all(len(v) == 1 for v in by_traj.values()) and len(by_traj) == 6


def test_other_sampling_settings_are_refused_naming_the_run_values(engine, caplog):
    """A request at other sampling settings gets a 400 saying what to send; the console hears of the first one of
    the run only; every refusal is counted, and an agent that fails on one fails as bad_request, with advice about
    its requests (not about the agent timeout)."""
    step, samples = run(engine, "refusal_message")
    info = samples[0].metadata["env_reward_info"]
    assert info["status"] == 400.0
    assert ("top_p=1.0: this run samples at temperature=1.0 top_p=0.9 top_k=0 min_p=0.0 max_tokens<=3 n=1"
            in info["message"] and "leave top_p out or send 0.9" in info["message"])
    stats = step.stats(samples)
    assert stats["rollout/bad_requests"] == (4.0, 1.0)  # one refused request per trajectory, caught by the agent
    assert stats["rollout/env_errors/bad_request"] == stats["rollout/trajectories_failed"] == (0.0, 1.0)
    caplog.clear()
    step, samples = run(engine, "other_temperature")
    samples += step.generate(engine, records(), PARAMS, seed=12, tokenizer=TOK)  # a second step of the same run
    lines = [r.getMessage() for r in caplog.records if "refused a request" in r.getMessage()]
    assert len(lines) == 1 and "(HTTP 400): temperature=0.5: this run samples at temperature=1.0 top_p=0.9" in lines[0]
    assert "leave temperature out or send 1.0" in lines[0]
    firsts = [s for s in samples if s.metadata["trajectory_sample"] == 0]
    assert [s.metadata["env_error_kind"] for s in firsts] == ["bad_request"] * 8
    assert step.stats(samples)["rollout/env_errors/bad_request"] == (8.0, 1.0)
    assert step.stats(samples)["rollout/env_errors/exception"] == (0.0, 1.0)
    with pytest.raises(RuntimeError, match=r"8 of 8 trajectories failed .*first failure: bad_request: the agent "
                       r".*other_temperature raised on the endpoint's HTTP 400: temperature=0.5: this run samples at "
                       r"temperature=1.0 top_p=0.9 .*; fix the agent .*other_temperature's requests: send what the "
                       r"endpoint serves") as info:
        step.check(samples)
    assert "agent_timeout_s" not in str(info.value)


def test_a_max_tokens_above_the_runs_is_served_capped_reported_and_counted(engine, caplog):
    step, samples = run(engine, "asks_many_tokens")
    infos = [s.metadata["env_reward_info"] for s in samples]
    assert [i["served"] for i in infos] == [3] * 4  # the run's max_new_tokens, not the 64 asked
    assert all(i["usage"] == i["ids"] == s.response_length for i, s in zip(infos, samples, strict=True))
    assert all((i["finish"] == "length") == (i["ids"] == 3) for i in infos)
    assert "length" in {i["finish"] for i in infos}  # (fixed seed) a turn that reached the cap says so
    assert step.stats(samples)["rollout/max_tokens_capped"] == (4.0, 1.0)
    lines = [r.getMessage() for r in caplog.records if "max_tokens=64" in r.getMessage()]
    assert lines == ["a request asked max_tokens=64, more than this run's rollout.max_new_tokens=3: served up to 3 "
                     "tokens a turn (finish_reason \"length\" where a turn reaches it; counted in "
                     "rollout/max_tokens_capped); raise rollout.max_new_tokens for longer turns"]  # once, of 4
    _, samples = run(engine, "completion_ids")  # max_tokens=1, under the run's: not capped
    assert [s.metadata["capped_requests"] for s in samples] == [0] * 4


def test_a_step_whose_trajectories_mostly_split_warns_once_naming_the_template(engine, caplog):
    step, samples = run(engine, "rewrites_history")  # every trajectory splits
    assert step.stats(samples)["rollout/prefix_breaks"] == (4.0, 1.0)
    step.generate(engine, records(), PARAMS, seed=12, tokenizer=TOK)  # again: no second line
    lines = [r.getMessage() for r in caplog.records if "split into several samples" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("4 of 4 trajectories this step split into several samples "
                                                   "(rollout/prefix_breaks)")
    assert "a chat template re-renders the history" in lines[0] and "send token ids to /v1/completions" in lines[0]
    caplog.clear()
    run(engine, "completion_ids")  # token ids extending the previous turn: no split, no line
    assert not [r for r in caplog.records if "split into several samples" in r.getMessage()]


def test_budgets_end_the_trajectory_truncated(engine):
    """too_many_turns re-sends its first prompt each time (each request after the first is a prefix break)."""
    step, samples = run(engine, "too_many_turns", max_turns=3)
    assert len(samples) == 12  # 4 trajectories x 3 turns, each its own sample
    firsts = samples[::3]
    assert all(s.status == SampleStatus.TRUNCATED and s.metadata["end"] == "max_turns" and s.reward == 0.0
               for s in samples)
    assert all(s.metadata["turns"] == 3 and s.metadata["prefix_breaks"] == 2 for s in firsts)
    assert "rollout.max_turns=3 model turns" in firsts[0].metadata["env_error"]
    assert step.stats(samples)["rollout/max_turns_ended"] == (4.0, 1.0)
    assert step.stats(samples)["rollout/trajectories_failed"] == (0.0, 1.0)
    _, samples = run(engine, "too_many_turns", max_trajectory_tokens=8)  # 3 tokens a turn: the third is cut
    by_traj = {}
    for s in samples:
        by_traj.setdefault(s.metadata["trajectory"], []).append(s)
    for parts in by_traj.values():
        assert parts[0].metadata["end"] == "max_tokens" and sum(s.response_length for s in parts) == 8
        assert parts[-1].response_length == 2


@pytest.mark.parametrize(("name", "kind", "message"), [
    ("raises", "exception", r"raised KeyError: 'no such tool'"),
    ("exits", "exception", r"raised SystemExit: 3$"),
    ("interrupts", "exception", r"raised KeyboardInterrupt$"),
    ("raises_generator_exit", "exception", r"raised GeneratorExit$"),
    ("exits_in_a_task_of_its_own", "exception", r"exits_in_a_task_of_its_own's event loop stopped \(SystemExit: 4\)"),
    ("returns_text", "bad_reward", r"returned 'great': the reward is 'great' \(str\): a reward must be a number, "
     r"not a str"),
    ("score_none", "bad_reward", r"the reward's 'score' is None \(NoneType\): a reward must be a number"),
    ("score_list", "bad_reward", r"the reward's 'score' is \[1\] \(list\): a reward must be a number"),
    ("score_nan", "bad_reward", r"returned nan: the reward is nan: rewards must be finite"),
    ("score_huge", "bad_reward", r"returned 1e\+300: the reward is 1e\+300: rewards must lie in \[-1e\+06, 1e\+06\]"),
    ("no_request", "no_request", r"returned without a request to the endpoint"),
    ("hangs", "timeout", r"took longer than rollout.step.agent_timeout_s=1.0 s"),
])
def test_bad_agents_fail_their_trajectories_counted(engine, name, kind, message):
    """Whatever the agent does wrong (raises anything, SystemExit and KeyboardInterrupt included, even from a task of
    its own; returns no finite number within the cap; never asks; hangs) fails its trajectory, counted by kind."""
    step, samples = run(engine, name, agent_timeout_s=1.0, max_failed_frac=1.0)
    firsts = [s for s in samples if s.metadata["trajectory_sample"] == 0]
    end = "env_timeout" if kind == "timeout" else "env_error"
    assert len(firsts) == 4 and all(s.metadata["end"] == end and s.metadata["env_error_kind"] == kind
                                    for s in firsts)
    assert all(__import__("re").search(message, s.metadata["env_error"]) for s in firsts), firsts[0].metadata
    stats = step.stats(samples)
    assert stats["rollout/trajectories_failed"] == (4.0, 1.0)
    if kind == "timeout":
        assert stats["rollout/env_timeouts"] == (4.0, 1.0) and stats["rollout/env_errors"] == (0.0, 1.0)
    else:
        assert stats["rollout/env_errors"] == stats[f"rollout/env_errors/{kind}"] == (4.0, 1.0)
    trained = [s for s in samples if s.status != SampleStatus.ABORTED]
    assert all(s.reward == 0.0 for s in trained)
    if name != "hangs":  # (whether a hanging agent's request was answered before its timeout depends on the load)
        assert (len(trained) == 0) == (name == "no_request")  # model tokens of a failed trajectory still train
    if name != "no_request":
        step.check(samples)  # max_failed_frac=1.0: a step may fail whole (while it has tokens to train on)
    step.max_failed_frac = 0.75
    with pytest.raises(RuntimeError, match=rf"^4 of 4 trajectories failed this step \(share 1.00 > "
                                           rf"rollout.step.max_failed_frac=0.75\); first failure: {kind}: .*fix the "
                                           rf"agent .*{name}"):
        step.check(samples)


def test_a_request_to_another_trajectorys_url_fails_the_sender(engine):
    """Odd trajectories send their one request to the previous trajectory's URL: refused (403), and the sender's
    trajectory fails, counted, whatever its agent returns; the even ones are untouched."""
    step, samples = run(engine, "odd_ones_ask_a_neighbour", max_failed_frac=1.0)
    assert [s.metadata["trajectory"] for s in samples] == [0, 1, 2, 3]
    assert [s.metadata["end"] for s in samples] == ["env", "env_error"] * 2
    assert [s.metadata.get("env_error_kind") for s in samples] == [None, "foreign_trajectory"] * 2
    assert samples[1].metadata["env_error"] == ("trajectory 1's client sent a request to trajectory 0's URL; each "
                                                "agent call talks to its own trajectory (the client it was handed, or "
                                                "its base URL)")
    assert [s.reward for s in samples[::2]] == [1.0, 1.0] and [s.metadata["turns"] for s in samples] == [1, 0] * 2
    assert [s.status for s in samples[1::2]] == [SampleStatus.ABORTED] * 2  # it sent nothing that trains
    assert step.stats(samples)["rollout/env_errors/foreign_trajectory"] == (2.0, 1.0)


def test_a_trajectory_that_reaches_the_models_context_ends_truncated():
    context = 24
    small = EmbeddedEngine(build_tiny_model(tokenizer=TOK, seed=3, initializer_range=0.3, max_positions=context),
                           progress=False)
    step, samples = run(small, "grows_until_refused", max_turns=50, max_trajectory_tokens=context - 1)
    for s in samples:
        assert s.metadata["end"] == "context" and s.status == SampleStatus.TRUNCATED and s.reward == 1.0
        # The refused prompt (the sample's ids + the agent's two) had no room for a turn of max_new_tokens=3.
        assert len(s.tokens) <= context < len(s.tokens) + 2 + 3
        assert "and a turn of rollout.max_new_tokens=3 pass the model's context of 24 tokens" in (
            s.metadata["env_reward_info"]["refusal"])
    assert step.stats(samples)["rollout/context_ended"] == (4.0, 1.0)
    with pytest.raises(ValueError, match=r"rollout.max_trajectory_tokens=24 does not fit the model's context of 24"):
        run(small, "grows_until_refused", max_trajectory_tokens=context)


@pytest.mark.parametrize("seconds", [0, 86400.5, float("inf"), float("nan"), "120"])
def test_agent_timeouts_must_be_finite_and_positive(seconds):
    with pytest.raises(ValueError, match=r"rollout.step.agent_timeout_s=.* must be a finite number of seconds in "
                                         r"\(0, 86400\]"):
        EndpointStep(agent=agent("raises"), max_turns=2, max_trajectory_tokens=8, agent_timeout_s=seconds)


def test_a_blocked_agent_loop_is_abandoned(engine, monkeypatch):
    monkeypatch.setattr(endpoint_step, "GRACE_S", 0.2)
    _, samples = run(engine, "blocks_its_loop", agent_timeout_s=0.5, max_failed_frac=1.0)
    assert all(s.metadata["end"] == "env_timeout" and "did not answer within" in s.metadata["env_error"]
               for s in samples)


def test_a_mixed_step_keeps_its_good_trajectories(engine):
    step, samples = run(engine, "odd_ones_fail", recs=records(4), params=SamplingParams(top_p=0.9, max_new_tokens=2,
                                                                                          n=1))
    assert [s.metadata["end"] for s in samples] == ["env", "env_error", "env", "env_error"]
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]


def test_unimportable_or_sync_agents_are_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match=r"rollout.step.agent 'no_such_pkg.agents:solve' cannot be imported: no "
                       r"module named 'no_such_pkg'"):
        EndpointStep(agent="no_such_pkg.agents:solve", max_turns=2, max_trajectory_tokens=8)
    with pytest.raises(ValueError, match=r"task.agent=.*not_async'?: must be an `async def` function"):
        resolve_agent(agent("not_async"))
    with pytest.raises(ValueError, match=r"task.agent .*: .*has no attribute 'missing'"):
        resolve_agent(agent("missing"))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "?a", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"task.reward_fn='m:f' .* must be unset with task=agent"):
        AgentTask(agent=agent("chat_two_turns"), path=str(data), reward_fn="m:f")
    task = AgentTask(agent=agent("chat_two_turns"), path=str(data))
    with pytest.raises(RewardError, match="the agent function's return value is the reward"):
        task.reward("x", task.prompt(0, TOK))


def test_tool_calls_parse_into_openai_tool_calls():
    text = 'Let me look.<tool_call>{"name": "lookup", "arguments": {"key": "c"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert calls == [{"id": "call_0", "type": "function",
                      "function": {"name": "lookup", "arguments": '{"key": "c"}'}}]
    for bad in ('<tool_call>{"name": "lookup", "arguments": {</tool_call>', "<tool_call>[1]</tool_call>",
                '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_tool_calls(bad) == (bad, [])
    body = chat_response(model="m", prompt_ids=[1], ids=[5, 2], text=text, reason="stop")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"] == calls
    assert choice["prompt_token_ids"] == [1] and choice["completion_token_ids"] == [5, 2]
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def test_the_minimal_chat_template_uses_only_the_char_tokenizers_characters():
    ids = TOK.apply_chat_template([{"role": "user", "content": "?c"}, {"role": "assistant", "content": "c"}],
                                  add_generation_prompt=True, tokenize=True, chat_template=MINIMAL_CHAT_TEMPLATE)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert TOK.unk_token_id not in ids
    assert TOK.decode(ids) == "<bos>u:?c<eos>a:c<eos>a:"


def test_config_refuses_a_missing_or_bad_agent_at_start(tmp_path):
    with pytest.raises(ValueError, match=r"config task.agent='\?\?\?': must be an agent function"):
        validate_config(compose_cfg(tmp_path, "task=agent"))
    with pytest.raises(ValueError, match=r"task.agent 'no_such_pkg.mod:f' cannot be imported"):
        validate_config(compose_cfg(tmp_path, "task=agent", "task.agent=no_such_pkg.mod:f"))
    with pytest.raises(ValueError, match=r"config task.agent=.*not_async'?: must be an `async def` function"):
        validate_config(compose_cfg(tmp_path, "task=agent", f"task.agent={agent('not_async')}"))
    validate_config(compose_cfg(tmp_path, "task=agent", "task.agent=topp_rl.tasks.agents.lookup:lookup_agent"))


class DropsLastId(RolloutEngine):
    """The real engine, answering a prompt longer than `keep` ids on the prompt less its last id (as a server that
    re-tokenises might): its output is conditioned on other ids than those sent."""

    def __init__(self, inner: EmbeddedEngine, keep: int) -> None:
        self.inner, self.keep = inner, keep
        self.vocab_size, self.shares_trainer_weights, self.shared_by_ranks = inner.vocab_size, False, False
        self.max_candidates, self.records_routes = None, False

    def generate(self, prompts, params, *, seed=None):
        return self.inner.generate([p[:-1] if len(p) > self.keep else p for p in prompts], params, seed=seed)

    def update_weights(self, named_tensors) -> None: ...

    def close(self) -> None: ...


class TwoTurns:
    """Answers the first model turn with "=1", ends after the second; reward: the record's index."""

    def start(self, record):
        return TwoTurnsEpisode(record)


class TwoTurnsEpisode:
    def __init__(self, record) -> None:
        self.record, self.turns = record, 0

    def respond(self, turn):
        self.turns += 1
        return "=1" if self.turns == 1 else None

    def reward(self):
        return float(self.record.index)


def test_the_agent_loop_starts_a_new_sample_where_the_engine_answered_other_ids(engine):
    task = LookupTask(seed=0)
    recs = [task.prompt(i, TOK) for i in range(3)]
    params = SamplingParams(top_p=0.9, max_new_tokens=1, n=2)
    step = AgentLoopStep(environment=TwoTurns(), max_turns=2, max_trajectory_tokens=16)
    samples = step.generate(DropsLastId(engine, keep=len(recs[0].prompt_ids)), recs, params, seed=5, tokenizer=TOK)
    step.score(samples, recs, params, task=task, tokenizer=TOK)
    by_traj = {}
    for s in samples:
        by_traj.setdefault(s.metadata["trajectory"], []).append(s)
    assert len(by_traj) == 6
    for first, second in by_traj.values():  # turn 2 was answered on its ids less the last: a second sample
        assert first.metadata["turns"] == 2 and len(first.response_ids) == 3  # the model's id, then "=1"
        assert second.prompt_ids == first.tokens[:-1]  # what the engine conditioned on: the sample it trains in
        assert first.loss_mask == [1, 0, 0] and second.loss_mask == [1] and first.metadata["prefix_breaks"] == 1
        assert first.reward == second.reward == first.group_index and first.metadata["end"] == "env"
    stats = step.stats(samples)
    assert stats["rollout/prefix_breaks"] == (6.0, 1.0)
    assert stats["rollout/samples_per_trajectory_mean"] == (12.0, 6.0)
    assert stats["rollout/trajectories_failed"] == (0.0, 1.0)


def test_check_request_serves_the_run_settings_only():
    run = SamplingParams(top_p=0.9, max_new_tokens=8)
    ok = {"model": "m", "messages": [], "temperature": 1, "top_p": 0.9, "top_k": -1, "min_p": 0.0,
          "frequency_penalty": 0.0, "n": 1, "stream": False, "tool_choice": "auto"}
    assert check_request(ok, run, allowed=CHAT_KEYS) == 8
    assert check_request({"max_tokens": 3, "max_completion_tokens": 5}, run, allowed=CHAT_KEYS) == 3
    assert check_request({"max_tokens": 30}, run, allowed=CHAT_KEYS) == 8  # capped at the run's max_new_tokens
    for key, value in (("temperature", 0.7), ("top_p", 1.0), ("top_k", 5), ("min_p", 0.1), ("top_p", "0.9"),
                       ("presence_penalty", 0.5), ("repetition_penalty", 1.1), ("n", 2), ("stream", True),
                       ("logprobs", True), ("seed", 3), ("stop", ["\n"]), ("tool_choice", "none"),
                       ("parallel_tool_calls", False), ("max_tokens", 0), ("best_of", 2)):
        with pytest.raises(Refused) as info:
            check_request({key: value}, run, allowed=CHAT_KEYS)
        assert info.value.param == key and "temperature=1.0 top_p=0.9 top_k=0 min_p=0.0" in str(info.value) or (
            key == "max_tokens" and "must be an integer >= 1" in str(info.value)), (key, str(info.value))
