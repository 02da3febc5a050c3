"""DatasetTask on the shipped GSM8K-format sample and on files written here (jsonl, json, parquet, save_to_disk):
columns, chat templates and system prompts (exact prompt ids), the prompt-length filter and its count, the
(seed, epoch) order, rewards in `sample.metadata`, and the errors for bad data."""

import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from topp_rl.models import build_char_tokenizer
from topp_rl.rollout import Sample
from topp_rl.tasks.datasets import DatasetTask, JsonlTask
from topp_rl.tasks.rewards import RewardError

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "data" / "gsm8k_sample.jsonl"
MATH = [{"fn": "topp_rl.tasks.rewards:math_answer", "name": "correct"}]
TOK = build_char_tokenizer()
# Renders <role-initial:content> per message, then "<a:" to prompt the assistant.
TEMPLATE = "{% for m in messages %}<{{ m['role'][0] }}:{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}<a:{% endif %}"


@pytest.fixture
def chat_tok():
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def _task(tmp_path, path, **kwargs) -> DatasetTask:
    kwargs.setdefault("rewards", MATH)
    return DatasetTask(path=path, cache_dir=str(tmp_path / "cache"), **kwargs)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sample(group: int, text: str, index: int) -> Sample:
    ids = TOK.encode(text, add_special_tokens=False)
    s = Sample(prompt_ids=[1], group_index=group, index=index)
    s.append_response_tokens(ids, [0.0] * len(ids))
    return s


def test_gsm8k_sample_filter_count_and_rewards(tmp_path, capsys):
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    assert len(rows) == 32 and all(r["answer"].splitlines()[-1].startswith("#### ") for r in rows)
    lengths = [len(TOK.encode(r["question"], add_special_tokens=False)) + 1 for r in rows]  # + BOS
    limit = 100
    task = _task(tmp_path, GSM8K, prompt_key="question", max_prompt_tokens=limit, seed=0)
    assert task.stats() == {}  # nothing counted before the tokenizer is known
    record = task.prompt(0, TOK)
    expected_dropped = sum(n > limit for n in lengths)
    assert 0 < expected_dropped < 32
    assert task.stats() == {"rollout/filtered_prompts": float(expected_dropped)}
    assert task.num_examples == 32 - expected_dropped
    out = capsys.readouterr().out
    assert out.count("[topp_rl] task:") == 1
    assert f"{32 - expected_dropped} prompts, {expected_dropped} longer than max_prompt_tokens=100 dropped" in out
    kept = [r for r, n in zip(rows, lengths, strict=True) if n <= limit]
    drawn = [task.prompt(i, TOK) for i in range(len(kept))]
    capsys.readouterr()
    assert sorted(r.text for r in drawn) == sorted(r["question"] for r in kept)  # one pass: each kept row once
    assert all(len(r.prompt_ids) <= limit for r in drawn)
    assert record.prompt_ids == [TOK.bos_token_id, *TOK.encode(record.text, add_special_tokens=False)]
    assert record.answer == record.data["answer"] and record.data["question"] == record.text
    final = record.answer.rpartition("####")[2].strip()
    samples = [_sample(0, f"so #### {final}", 3), _sample(0, f"The answer is {int(final) + 1}.", 4)]
    assert task.score(samples, [record], TOK) == [1.0, 0.0]
    assert [s.metadata["rewards"] for s in samples] == [{"correct": 1.0}, {"correct": 0.0}]
    assert "rewards" not in capsys.readouterr().out  # printed once only


def test_order_per_seed_and_epoch_and_resume(tmp_path):
    data = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)])
    task = _task(tmp_path, data, seed=1)
    texts = [task.prompt(i, TOK).text for i in range(15)]
    # Fixed expectations: numpy's PCG64 seeded with [seed, epoch] (np.random.default_rng([1, e]).permutation(5)).
    assert texts[:5] == ["q4", "q0", "q1", "q2", "q3"]
    assert texts[5:10] == ["q1", "q4", "q0", "q3", "q2"]
    for epoch in range(3):
        expected = np.random.Generator(np.random.PCG64(np.random.SeedSequence([1, epoch]))).permutation(5)
        assert texts[5 * epoch : 5 * epoch + 5] == [f"q{i}" for i in expected]
    resumed = _task(tmp_path, data, seed=1)  # a resumed run asks for position 12 first: the same prompt
    assert resumed.prompt(12, TOK).text == texts[12]
    assert [_task(tmp_path, data, seed=1, shuffle=False).prompt(i, TOK).text for i in range(7)] == [
        "q0", "q1", "q2", "q3", "q4", "q0", "q1"
    ]
    assert [_task(tmp_path, data, seed=2).prompt(i, TOK).text for i in range(5)] != texts[:5]


def test_chat_messages_column_and_system_prompt(tmp_path, chat_tok):
    data = _write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"messages": [{"role": "user", "content": "Add 2 and 3."}], "answer": "5"},
            {"messages": [{"role": "system", "content": "Own rule."}, {"role": "user", "content": "Hi"}],
             "answer": "1"},
        ],
    )
    task = _task(tmp_path, data, prompt_key="messages", chat_template=True, system_prompt="Be brief.", shuffle=False)
    first, second = task.prompt(0, chat_tok), task.prompt(1, chat_tok)
    assert first.prompt_ids == chat_tok.encode("<s:Be brief.><u:Add 2 and 3.><a:", add_special_tokens=False)
    assert second.prompt_ids == chat_tok.encode("<s:Own rule.><u:Hi><a:", add_special_tokens=False)  # kept its own
    assert (first.text, first.answer, second.text) == ("Add 2 and 3.", "5", "Hi")
    # A text column through the chat template, with the system prompt first.
    text = _write_jsonl(tmp_path / "text.jsonl", [{"prompt": "Add 2 and 3.", "answer": "5"}])
    record = _task(tmp_path, text, chat_template=True, system_prompt="Be brief.").prompt(0, chat_tok)
    assert record.prompt_ids == first.prompt_ids
    with pytest.raises(ValueError, match=r"column 'messages' of .*chat.jsonl holds chat conversations; set chat_template=true"):
        _task(tmp_path, data, prompt_key="messages")
    with pytest.raises(ValueError, match=r"system_prompt \('Be brief.'...\) needs chat_template=true"):
        _task(tmp_path, text, system_prompt="Be brief.")


def test_parquet_json_and_saved_splits(tmp_path):
    rows = {"problem": ["a", "b", "c", "d"], "solution": ["1", "2", "3", "4"]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.json").write_text(json.dumps([{"problem": p, "solution": s} for p, s in zip(*rows.values(), strict=True)]))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(rows), "test": datasets.Dataset.from_dict({"problem": ["t"], "solution": ["9"]})}
    ).save_to_disk(str(tmp_path / "saved"))
    answers = {"a": "1", "b": "2", "c": "3", "d": "4", "t": "9"}
    kw = {"prompt_key": "problem", "answer_key": "solution", "shuffle": False}
    for path, split, expected in [
        ("d.parquet", "train", ["a", "b", "c", "d"]),
        ("d.json", "train[1:3]", ["b", "c"]),
        ("saved", "train[:50%]", ["a", "b"]),
        ("saved", "test", ["t"]),
        ("saved", "train[-1:]+test", ["d", "t"]),
    ]:
        task = _task(tmp_path, tmp_path / path, split=split, **kw)
        got = [task.prompt(i, TOK) for i in range(len(expected))]
        assert [r.text for r in got] == expected, (path, split)
        assert task.num_examples == len(expected)
        assert [r.answer for r in got] == [answers[t] for t in expected]
    with pytest.raises(ValueError, match=r"split 'validation' is not in .*saved \(splits: \['test', 'train'\]\)"):
        _task(tmp_path, tmp_path / "saved", split="validation", **kw)


def test_bad_data_raises_naming_the_value_and_fix(tmp_path):
    def fails(rows_or_text, match, name="d.jsonl", **kwargs):
        path = tmp_path / name
        if isinstance(rows_or_text, str):
            path.write_text(rows_or_text)
        else:
            _write_jsonl(path, rows_or_text)
        with pytest.raises(ValueError, match=match):
            _task(tmp_path, path, **kwargs)

    # issue 9 defect 13: a non-string prompt used to be str()-ed silently
    fails([{"prompt": "ok", "answer": "1"}, {"prompt": 5, "answer": "2"}],
          r"prompt 1 of .*d.jsonl \('prompt': 5\) is a int, not a string; prompts must be strings")
    fails([{"prompt": 3, "answer": "1"}], r"prompt 0 of .* \('prompt': 3\) is a int, not a string")
    fails([{"prompt": ["a", "b"], "answer": "1"}], r"prompt 0 of .* \('prompt': \['a', 'b'\]\) is a list but no chat")
    fails([{"messages": [{"role": "user", "content": None}]}], r"prompt 0 .* is a list but no chat conversation \(each",
          prompt_key="messages", chat_template=True, answer_key=None)
    fails([{"prompt": "ok", "answer": "1"}, {"answer": "2"}], r"prompt 1 of .* \('prompt'\) is null or empty")
    fails([{"messages": [], "answer": "1"}], r"prompt 0 of .* \('messages'\) is null or empty",
          prompt_key="messages", chat_template=True)
    fails([{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "user", "content": None}]}],
          r"a conversation in column 'messages' of .* has a null message, role or content",
          prompt_key="messages", chat_template=True, answer_key=None)
    fails([{"question": "q", "answer": "1"}],
          r"has no column 'prompt'; its columns are \['question', 'answer'\]: set task.prompt_key to one of them")
    fails([{"prompt": "q", "solution": "1"}],
          r"has no column 'answer'; its columns are \['prompt', 'solution'\]: set task.answer_key .*or answer_key=null")
    fails("", r"d.jsonl is empty; a dataset task needs at least one prompt")
    fails("\n\n", r"d.jsonl is empty")
    fails("prompt,answer\n", r"holds no rows", name="d.csv")
    fails("x", r"unknown extension; use one of \['.csv', '.json', '.jsonl', '.parquet'\]", name="d.txt")
    fails('{"prompt": "x"', r"cannot be read as json")
    long = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": "a" * 50, "answer": "1"}])
    with pytest.raises(ValueError, match=r"all 1 prompts .* longer than max_prompt_tokens=10 tokens \(shortest: 51\)"):
        _task(tmp_path, long, max_prompt_tokens=10).prompt(0, TOK)  # lengths need the tokenizer: first prompt
    with pytest.raises(ValueError, match=r"dataset path .*nowhere.jsonl does not exist"):
        _task(tmp_path, tmp_path / "nowhere.jsonl")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match=r"emptydir is not a directory written by save_to_disk"):
        _task(tmp_path, tmp_path / "emptydir")
    data = _write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "q", "answer": "1"}])
    # Neither: the multi-turn steps' environment or agent gives the reward; a step that calls the task's gets this
    # (and a single-turn run is refused at start: tests/test_agent_docs.py).
    unset = _task(tmp_path, data, rewards=None)
    with pytest.raises(RewardError, match=r"task.reward_fn and task.rewards are unset, and this rollout step scores"):
        unset.reward("1", unset.prompt(0, TOK))
    with pytest.raises(ValueError, match=r"set exactly one of task.reward_fn \('json:loads'\)"):
        _task(tmp_path, data, reward_fn="json:loads")
    with pytest.raises(ValueError, match=r"max_prompt_tokens \(0\) must be >= 1"):
        _task(tmp_path, data, max_prompt_tokens=0)


def test_reward_fn_file_path_and_jsonl_alias(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def exact(response, record):\n    return float(response.strip() == record.answer)\n")
    data = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "answer": 7}])
    task = JsonlTask(path=data, reward_fn=f"{reward}:exact", cache_dir=str(tmp_path / "cache"))
    assert isinstance(task, DatasetTask) and task.reward_name == "1*exact"
    record = task.prompt(0, TOK)
    assert record.answer == "7"  # a number in the answer column reaches the reward as text
    samples = [_sample(0, " 7 ", 0), _sample(0, "8", 1)]
    assert task.score(samples, [record], TOK) == [1.0, 0.0]
    assert [s.metadata["rewards"] for s in samples] == [{"exact": 1.0}, {"exact": 0.0}]


@pytest.mark.parametrize("option", ["gsm8k", "countdown", "dataset", "jsonl"])
def test_task_configs_instantiate(option, tmp_path, monkeypatch):
    from helpers import compose_config
    from hydra.utils import instantiate

    monkeypatch.chdir(ROOT)  # the shipped configs name data/ relative to the working directory
    overrides = [f"task={option}"]
    if option != "countdown":
        overrides.append(f"task.cache_dir={tmp_path / 'cache'}")
    if option in ("dataset", "jsonl"):
        overrides += [f"task.path={GSM8K}", "task.prompt_key=question", "task.reward_fn=topp_rl.tasks.rewards:math_answer"]
    cfg = compose_config(tmp_path, *overrides)
    task = instantiate(cfg.task)
    record = task.prompt(0, TOK)
    if option == "countdown":
        assert task.reward(record.data["solution"], record) == 1.0 and task.reward("1+1", record) == 0.0
    else:
        final = record.answer.rpartition("####")[2].strip()
        assert record.text == record.data["question"] and task.num_examples == 32  # 512 tokens keeps every problem
        assert (task.reward(f"#### {final}", record), task.reward("#### 0.5", record)) == (1.0, 0.0)


def test_empty_prompts_null_answers_and_non_utf8_files_are_refused_naming_the_row(tmp_path):
    """Issue 18 parts 5c, 5d, 6j: an empty prompt string trained on a bare BOS, a null / missing answer reached the
    reward as None (and made a csv int column floats: "1" -> "1.0"), a latin-1 byte raised a bare
    UnicodeDecodeError naming neither file nor line."""
    def error(name: str, text: bytes, **kwargs) -> str:
        path = tmp_path / name
        path.write_bytes(text)
        with pytest.raises(ValueError) as info:
            _task(tmp_path, path, **kwargs)
        return str(info.value)

    rows = b'{"prompt": "1:", "answer": "1"}\n{"prompt": "", "answer": "2"}\n'
    assert error("e.jsonl", rows) == f"prompt 1 of {tmp_path}/e.jsonl ('prompt') is null or empty; every row needs a prompt"
    # the same message as an empty csv cell (read as null)
    assert error("e.csv", b"prompt,answer\n1:,1\n,2\n") == (
        f"prompt 1 of {tmp_path}/e.csv ('prompt') is null or empty; every row needs a prompt")
    assert error("e2.csv", b'prompt,answer\n1:,1\n"",2\n').startswith(f"prompt 1 of {tmp_path}/e2.csv ('prompt')")
    null_answer = (f"answer 1 of {tmp_path}/{{}} ('answer') is null or missing; every row needs a reference answer "
                   "for the reward (record.answer): fix the data, or set task.answer_key=null if the rewards use none")
    assert error("a.jsonl", b'{"prompt": "1:", "answer": "1"}\n{"prompt": "2:", "answer": null}\n') == (
        null_answer.format("a.jsonl"))
    assert error("m.jsonl", b'{"prompt": "1:", "answer": "1"}\n{"prompt": "2:"}\n') == null_answer.format("m.jsonl")
    assert error("a.csv", b"prompt,answer\n1:,1\n2:,\n") == null_answer.format("a.csv")
    # answer_key=null: no answers wanted, none checked
    ok = tmp_path / "ok.jsonl"
    ok.write_bytes(b'{"prompt": "1:"}\n')
    assert _task(tmp_path, ok, reward_fn="json:loads", rewards=None, answer_key=None).num_examples == 1
    latin1 = '{"prompt": "1:", "answer": "1"}\n{"prompt": "caf\u00e9", "answer": "2"}\n'.encode("latin-1")
    assert error("l.jsonl", latin1) == (
        f"{tmp_path}/l.jsonl line 2 is not UTF-8 (byte 0xe9 at column 16: invalid continuation byte); dataset files "
        "are read as UTF-8: re-encode the file (e.g. `iconv -f latin1 -t utf-8`)"
    )
    assert error("l.csv", "prompt,answer\n1:,1\ncaf\u00e9,2\n".encode("latin-1")).startswith(
        f"{tmp_path}/l.csv line 3 is not UTF-8 (byte 0xe9 at column 4: ")
