"""task=python_tool (topp_rl/tasks/python_tool.py): the prompt through SmolLM2's chat template, tool output framed
by the template's convention, every kind of bad call answered with an error and counted, the reward."""

import asyncio
import json
import math
import threading

import pytest
from helpers import column, compose_config, read_metrics
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from topp_rl.data.prompt import PromptRecord
from topp_rl.models import load_smollm2
from topp_rl.tasks.environment import ModelTurn
from topp_rl.tasks.python_tool import (
    COUNTS,
    PythonToolEnvironment,
    PythonToolTask,
    chat_strings,
    final_answer_correct,
    parse_calls,
)
from topp_rl.train import train

CHAT = {"close": "<|im_end|>\n", "after_eos": "\n", "tool_open": "<|im_start|>tool\n",
        "tool_close": "<|im_end|>\n<|im_start|>assistant\n"}


@pytest.fixture(scope="module")
def tokenizer():
    return load_smollm2()[1]


def call(code: str, name: str = "python") -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"code": code}}) + "</tool_call>"


def record(answer: str = "85") -> PromptRecord:
    return PromptRecord(index=0, text="What is 37 + 48?", prompt_ids=[1], answer=answer, data={"chat": CHAT})


def play(env: PythonToolEnvironment, texts: list[str], *, finished: bool = True, answer: str = "85"):
    """The episode's answers to the model turns `texts`, and its reward."""
    async def go():
        episode = env.start(record(answer))
        outs = [await episode.respond(ModelTurn(index=i, ids=[], text=t, finished=finished))
                for i, t in enumerate(texts)]
        return outs, episode.reward()

    return asyncio.run(go())


def tool_message(content: str, *, finished: bool = True) -> str:
    return (CHAT["after_eos"] if finished else CHAT["close"]) + CHAT["tool_open"] + content + CHAT["tool_close"]


def test_smollm2_chat_strings_and_the_prompt(tokenizer):
    assert chat_strings(tokenizer) == CHAT
    task = PythonToolTask(chat_template=True, add_bos=False, digits=2, seed=0)
    rec = task.prompt(7, tokenizer)
    data = rec.data
    assert rec.text == f"What is {data['a']} {data['op']} {data['b']}?"
    assert rec.answer == str(data["a"] + data["b"] if data["op"] == "+" else data["a"] - data["b"])
    assert data["chat"] == CHAT
    text = tokenizer.decode(rec.prompt_ids)
    assert text.startswith("<|im_start|>system\nYou have a tool: python.")
    assert text.endswith(f"<|im_start|>user\n{rec.text}<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<tool_call>") == 2  # the format in the system message, and the worked example's call


def test_environment_tokens_are_what_the_chat_template_renders(tokenizer):
    """prompt + the model's call (ending on eos) + the environment's text, each tokenised on its own, are the ids
    of the whole conversation rendered by the template: the loop's running ids are the chat's ids."""
    task = PythonToolTask(chat_template=True, add_bos=False, digits=2, seed=0)
    rec = task.prompt(3, tokenizer)
    code = f"print({rec.data['a']} {rec.data['op']} {rec.data['b']})"
    model_ids = [*tokenizer.encode(call(code), add_special_tokens=False), tokenizer.eos_token_id]
    turn = ModelTurn(index=0, ids=model_ids, text=tokenizer.decode(model_ids, skip_special_tokens=True),
                     finished=True)

    async def answer():
        return await PythonToolEnvironment().start(rec).respond(turn)

    env_text = asyncio.run(answer())
    assert env_text == tool_message(f"{rec.answer}\n")
    running = [*rec.prompt_ids, *model_ids, *tokenizer.encode(env_text, add_special_tokens=False)]
    messages = [*task.messages(task.example(3)[0]), {"role": "assistant", "content": call(code)},
                {"role": "tool", "content": f"{rec.answer}\n"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert running == list(rendered)


def test_a_right_call_then_the_answer():
    outs, reward = play(PythonToolEnvironment(), [call("print(37 + 48)"), "The answer is 85."])
    assert outs == [tool_message("85\n"), None]
    assert reward == {"score": 1.0, "correct": 1.0, "answered": 1.0, "tool/calls": 1.0, "tool/ok": 1.0,
                      "tool/invalid": 0.0, "tool/unknown_tool": 0.0, "tool/exception": 0.0, "tool/timeout": 0.0,
                      "tool/output_limit": 0.0}
    _, wrong = play(PythonToolEnvironment(tool_credit=0.25), [call("print(37 + 48)"), "86"])
    assert (wrong["score"], wrong["correct"]) == (0.25, 0.0)  # the tool's credit alone
    _, no_tool = play(PythonToolEnvironment(tool_credit=0.25), ["85"])
    assert (no_tool["score"], no_tool["tool/calls"]) == (1.0, 0.0)


def test_each_bad_call_comes_back_as_an_error_and_is_counted():
    env = PythonToolEnvironment(cpu_s=1, wall_s=1.0, output_bytes=64, max_calls_per_turn=2)
    turns = [
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"</tool_call>',  # invalid JSON
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}',  # never closed (cut)
        call("print(1)", name="calculator"),  # unknown tool
        '<tool_call>{"name": "python", "arguments": {"source": "print(1)"}}</tool_call>',  # no code
        call("x = [1]\nprint(x[3])"),  # an exception
        call("import time\ntime.sleep(30)"),  # the wall timeout
        call("print('y' * 1000)"),  # too much output
        call("print(1)") + call("print(2)") + call("print(3)"),  # one call past max_calls_per_turn
        "I give up",
    ]
    outs, reward = play(env, turns, finished=False)
    bodies = [o[len(CHAT["close"]) + len(CHAT["tool_open"]):] for o in outs[:-1]]
    assert bodies[0].startswith("Error: the tool call is not valid JSON (Expecting ',' delimiter")
    assert bodies[1].startswith("Error: the <tool_call> is not closed with </tool_call>; write <tool_call>")
    assert bodies[2].startswith("Error: unknown tool 'calculator'; the only tool is 'python'")
    assert bodies[3].startswith('Error: python takes {"code": "<Python code>"}')
    # the traceback's end (stderr keeps its last output_bytes)
    assert bodies[4].startswith("Error:\n[output cut: its first ")
    assert "print(x[3])" in bodies[4] and "IndexError: list index out of range\n" in bodies[4]
    assert bodies[5].startswith("Error: the code ran past 1 s and was stopped")
    assert bodies[6].startswith("y" * 64 + "\n[output cut at 64 bytes]\nError: the code printed more than 64 bytes")
    assert outs[7] == CHAT["close"] + "".join(CHAT["tool_open"] + m + CHAT["tool_close"] for m in [
        "1\n", "2\n", "Error: at most 2 tool calls per turn; this one did not run"])
    assert outs[-1] is None
    assert {k: reward[k] for k in COUNTS} == {"tool/calls": 10.0, "tool/ok": 2.0, "tool/invalid": 4.0,
                                              "tool/unknown_tool": 1.0, "tool/exception": 1.0, "tool/timeout": 1.0,
                                              "tool/output_limit": 1.0}
    assert (reward["score"], reward["answered"]) == (0.0, 1.0)


def test_a_trajectory_ended_by_a_budget_has_no_answer():
    _, reward = play(PythonToolEnvironment(), [call("print(37 + 48)")])
    assert (reward["score"], reward["correct"], reward["answered"], reward["tool/ok"]) == (0.0, 0.0, 0.0, 1.0)


def test_the_final_answer_is_checked_off_the_main_thread():
    """Episodes run on threads (sync) or an event loop: math-verify's signal timeouts are not used there."""
    results = []
    texts = ["The answer is 85.", "85.0", "86", "no number", "37 + 48 = 85"]
    worker = threading.Thread(target=lambda: results.extend(final_answer_correct(t, record()) for t in texts))
    worker.start()
    worker.join()
    assert results == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_parse_calls_reads_each_block_and_openai_style_arguments():
    args = json.dumps({"code": "print(2)"})
    calls = parse_calls(f"think {call('print(1)')} then <tool_call>" + json.dumps(
        {"name": "python", "arguments": args}) + "</tool_call>")
    assert [c.code for c in calls] == ["print(1)", "print(2)"]
    assert parse_calls("85") == []


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match=r"task.chat_template=false: task=python_tool is a chat"):
        PythonToolTask(chat_template=False)
    with pytest.raises(ValueError, match=r"rollout.step.environment.max_parallel=0 must be an integer >= 1"):
        PythonToolEnvironment(max_parallel=0)
    with pytest.raises(ValueError, match=r"tool_credit=1.0 must be in \[0, 1\)"):
        PythonToolEnvironment(tool_credit=1.0)
    with pytest.raises(ValueError, match=r"the record has no 'chat' strings"):
        PythonToolEnvironment().start(PromptRecord(index=0, text="", prompt_ids=[1], answer="1"))


def test_a_call_past_its_total_memory_is_told_and_counted():
    """Two processes of 100 MB each: each fits the per-process bound, together they pass memory_mb."""
    code = ("import os, time\nfor _ in range(2):\n    if os.fork() == 0:\n        blob = b'x' * (100 * 2**20)\n"
            "        time.sleep(60)\n        os._exit(0)\nos.wait()")
    outs, reward = play(PythonToolEnvironment(memory_mb=160, wall_s=20.0), [call(code), "85"])
    assert outs[0] == tool_message("Error: the code used more than 160 MB of memory and was stopped")
    assert (reward["tool/exception"], reward["tool/ok"], reward["score"]) == (1.0, 0.0, 1.0)


def test_without_bwrap_the_run_is_refused_at_start_unless_unconfined(tmp_path, monkeypatch):
    """The environment is built when the run starts: without bwrap it is refused there, naming the install line
    and the key that opts into running the code unconfined; with that key the tool works."""
    cfg = compose_config(tmp_path, "experiment=smollm2_python_tool")
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without bwrap on it
    with pytest.raises(InstantiationException, match=r"needs bubblewrap \(bwrap\), which is not on PATH: apt-get "
                       r"install bubblewrap.*; or set rollout.step.environment.unconfined_sandbox=true") as refused:
        instantiate(cfg.rollout.step.environment)
    assert isinstance(refused.value.__cause__, ValueError)
    cfg.rollout.step.environment.unconfined_sandbox = True
    env = instantiate(cfg.rollout.step.environment)
    assert (env.limits.processes, env.limits.scratch_mb) == (16, 16)
    outs, reward = play(env, [call("print(37 + 48)"), "85"])
    assert outs[0] == tool_message("85\n") and reward["tool/ok"] == 1.0
    with pytest.raises(ValueError, match=r"rollout.step.environment.unconfined_sandbox='yes' must be true or false"):
        PythonToolEnvironment(unconfined_sandbox="yes")


@pytest.mark.slow
def test_the_smollm2_preset_trains_a_step_exactly(tmp_path):
    """experiment=smollm2_python_tool, one small step: the masked mismatch over trained tokens is float32 noise
    (the unmasked one far above), and the tool's counts are logged as reward entries."""
    cfg = compose_config(tmp_path, "experiment=smollm2_python_tool", "logger=csv", "trainer.max_steps=1",
                         "rollout.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=32",
                         "trainer.enable_progress_bar=false")
    assert train(cfg)["steps"] == 1
    rows = read_metrics(tmp_path)
    assert column(rows, "train/rollout_logprob_abs_diff")[0] <= 1e-5
    assert column(rows, "train/rollout_logprob_abs_diff_max")[0] <= 1e-4
    assert column(rows, "train/rollout_logprob_abs_diff_unmasked")[0] > 1e-2
    assert column(rows, "rollout/trajectories_failed") == [0.0]
    for key in ("correct", "answered", *COUNTS):
        (value,) = column(rows, f"rollout/reward/{key}_mean")
        assert math.isfinite(value) and value >= 0, key
