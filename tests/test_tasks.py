"""Tasks: deterministic prompts, exact rewards, JSONL + import-path reward functions, Countdown, error messages."""

import json
import sys
import textwrap

import pytest

from topp_rl.models import build_char_tokenizer
from topp_rl.rollout import Sample
from topp_rl.tasks import ArithmeticTask, CopyDigitTask, CountdownTask, JsonlTask, RewardError, Task

TOK = build_char_tokenizer()


def _sample(group: int, text: str, index: int = 0) -> Sample:
    ids = TOK.encode(text, add_special_tokens=False) + [TOK.eos_token_id]
    s = Sample(prompt_ids=[1], group_index=group, index=index)
    s.append_response_tokens(ids, [0.0] * len(ids))
    return s


def test_arithmetic_prompts_are_seeded_and_rewards_exact():
    task = ArithmeticTask(digits=2, ops="+-*", seed=3)
    records = [task.prompt(i, TOK) for i in range(50)]
    again = [ArithmeticTask(digits=2, ops="+-*", seed=3).prompt(i, TOK) for i in range(50)]
    assert [r.text for r in records] == [r.text for r in again]
    assert [r.text for r in records] != [
        ArithmeticTask(seed=4).prompt(i, TOK).text for i in range(50)
    ]
    for r in records:
        a, op, b = r.data["a"], r.data["op"], r.data["b"]
        assert r.text == f"{a}{op}{b}=" and 0 <= a < 100 and 0 <= b < 100
        assert int(r.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert r.prompt_ids == [TOK.bos_token_id, *TOK.encode(r.text, add_special_tokens=False)]
    assert {r.data["op"] for r in records} == {"+", "-", "*"}
    rec = records[0]
    wrong = str(int(rec.answer) + 1)
    samples = [_sample(0, rec.answer), _sample(0, f" {rec.answer}x"), _sample(0, wrong), _sample(0, "abc")]
    assert task.score(samples, [rec], TOK) == [1.0, 1.0, 0.0, 0.0]
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0]


def test_chat_template_prompt_ids():
    """transformers 5's apply_chat_template returns a BatchEncoding: the prompt must be its input ids."""
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    task = ArithmeticTask(digits=1, seed=0, chat_template=True)
    record = task.prompt(0, tok)
    assert record.prompt_ids == tok.encode(f"<{record.text}>", add_special_tokens=False)


def test_arithmetic_mod_and_partial_credit():
    task = ArithmeticTask(digits=1, ops="+", mod=10, partial_credit=0.1)
    rec = task.prompt(0, TOK)
    assert len(rec.answer) == 1 and int(rec.answer) == (rec.data["a"] + rec.data["b"]) % 10
    other = str((int(rec.answer) + 1) % 10)
    assert task.score([_sample(0, rec.answer), _sample(0, other), _sample(0, "+")], [rec], TOK) == [
        1.0,
        0.1,
        0.0,
    ]


def test_copy_digit_partial_credit():
    task = CopyDigitTask(digit_credit=0.25)
    rec = task.prompt(5, TOK)
    assert rec.text == f"{rec.answer}:" and rec.answer.isdigit()
    other = str((int(rec.answer) + 3) % 10)
    scored = task.score(
        [_sample(0, rec.answer + "1"), _sample(0, other), _sample(0, "a" + rec.answer)], [rec], TOK
    )
    assert scored == [1.0, 0.25, 0.0]
    assert len({CopyDigitTask().prompt(i, TOK).answer for i in range(100)}) == 10


def test_jsonl_task_reward_by_import_path(tmp_path, monkeypatch):
    module = tmp_path / "my_rewards.py"
    module.write_text(
        textwrap.dedent(
            """
            def exact(response, record):
                return float(response.strip() == record.answer == record.data["answer"])

            def broken(response, record):
                return 1 / 0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(5)) + "\n")
    task = JsonlTask(path=data, reward_fn="my_rewards:exact", seed=1, cache_dir=str(tmp_path / "cache"))
    first_pass = [task.example(i)[0] for i in range(5)]
    assert sorted(first_pass) == [f"q{i}" for i in range(5)]  # one full pass visits every record once
    assert first_pass != [task.example(i)[0] for i in range(5, 10)]  # the next pass is reshuffled
    rec = task.prompt(0, TOK)
    assert task.score([_sample(0, rec.answer, 0), _sample(0, "9", 1)], [rec], TOK) == [1.0, 0.0]
    broken = JsonlTask(path=data, reward_fn="my_rewards:broken", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(RewardError, match=r"reward function broken raised on sample 7 .*ZeroDivisionError"):
        broken.score([_sample(0, "1", index=7)], [broken.prompt(0, TOK)], TOK)
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reward_fn": "no_colon"}, "must look like 'package.module:function'"),
        ({"reward_fn": "no_such_module_xyz:fn"}, "cannot be imported"),
        ({"reward_fn": "json:nope"}, "has no attribute 'nope'"),
        ({"reward_fn": "missing/reward.py:fn"}, r"file .*missing/reward.py does not exist"),
        ({"reward_fn": "json:__doc__"}, "not a function"),
    ],
)
def test_jsonl_bad_reward_fn(tmp_path, kwargs, message):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=message):
        JsonlTask(path=data, answer_key=None, cache_dir=str(tmp_path / "cache"), **kwargs)


def test_jsonl_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        JsonlTask(path=tmp_path / "missing.jsonl", reward_fn="json:loads")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"question": "x"}\n')
    with pytest.raises(ValueError, match=r"prompt 1 of .*bad.jsonl \('prompt'\) is null or empty"):
        JsonlTask(path=bad, reward_fn="json:loads", answer_key=None, cache_dir=str(tmp_path / "cache"))


def test_nonfinite_rewards_raise():
    class Const(Task):
        def example(self, index):
            return "x", None, {}

        def reward(self, response, record):
            return float("nan")

    task = Const()
    with pytest.raises(RewardError, match="rewards must be finite"):
        task.score([_sample(0, "1")], [task.prompt(0, TOK)], TOK)


def test_nonfinite_and_bad_options():
    with pytest.raises(ValueError, match=r"ops \('/'\) must be"):
        ArithmeticTask(ops="/")
    with pytest.raises(ValueError, match=r"digits \(0\) must be >= 1"):
        ArithmeticTask(digits=0)


def test_countdown_puzzles_are_solvable_and_scored_by_the_rule():
    task = CountdownTask(num_numbers=3, max_number=20, max_target=100, seed=2, format_credit=0.1)
    records = [task.prompt(i, TOK) for i in range(40)]
    assert [r.text for r in records] == [CountdownTask(seed=2).prompt(i, TOK).text for i in range(40)]
    for r in records:
        numbers, target = r.data["numbers"], r.data["target"]
        assert r.text == (
            f"Use {', '.join(map(str, numbers))} to make {target} with + - * / and (), each number exactly once. "
            "Answer:"
        )
        assert 1 <= target <= 100 and len(numbers) == 3 and all(1 <= n <= 20 for n in numbers)
        assert r.answer == str(target) and task.reward(r.data["solution"], r) == 1.0
        assert r.prompt_ids == [TOK.bos_token_id, *TOK.encode(r.text, add_special_tokens=False)]  # no char lost
    rec = records[0]
    a, b, c = rec.data["numbers"]
    wrong = f"{a}+{b}+{c}" if a + b + c != rec.data["target"] else f"{a}*{b}*{c}"
    samples = [_sample(0, rec.data["solution"]), _sample(0, wrong), _sample(0, f"{a}+{b}"), _sample(0, "x")]
    assert task.score(samples, [rec], TOK) == [1.0, 0.1, 0.0, 0.0]  # right; well formed, wrong; c unused; junk
    assert all("rewards" not in s.metadata for s in samples)  # a task's own reward is not logged apart


def test_countdown_bad_options():
    with pytest.raises(ValueError, match=r"num_numbers \(1\) must be >= 2"):
        CountdownTask(num_numbers=1)
    with pytest.raises(ValueError, match=r"format_credit \(1.0\) must be in \[0, 1\)"):
        CountdownTask(format_credit=1.0)
    with pytest.raises(ValueError, match=r"must contain \{target\}"):
        CountdownTask(template="Use {numbers}")
