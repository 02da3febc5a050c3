"""`python_tool`: arithmetic with a Python tool for chat models (`task=python_tool`, the agent loop).

The prompt (through the tokenizer's chat template): a system message describing the `python` tool (code in,
what it prints out) and its call format, one worked example (a question, the call, the tool's answer, the final
answer), then the question "What is 37 + 48?" (`ArithmeticTask`'s operands). The model calls the tool with
`<tool_call>{"name": "python", "arguments": {"code": "print(37 + 48)"}}</tool_call>` (the Qwen / Hermes
format); `PythonToolEnvironment` runs the code in `topp_rl.tasks.sandbox` and answers with a tool message,
rendered by the chat template's own convention (the text between the model's end of turn and the next
assistant turn). A model turn without a tool call is the final answer: the trajectory ends. Reward: 1 when the
final answer's last number equals the result (math-verify, `checkers.math_answer`), plus `tool_credit` when a
call ran cleanly; the counts of calls and of each kind of failure are the reward's extra entries
(`rollout/reward/tool/<kind>_mean`), every failure told to the model as an error message.

Why this data for SmolLM2-135M-Instruct (measured: top_p 0.9, 8-12 samples per prompt): without the worked example
it never called the tool (0 of 48 samples: 24 with this system message, 24 with SmolLM2's own function-calling
prompt); with it, about half of its first turns on "What is 37 + 48?" are calls (a third of them well-formed python
calls, others name an unknown tool or hold no code), while a word problem of data/word_sums.jsonl drew no call (0 of
12). Alone it gets two-digit sums wrong (0 of 8), so the tool is what solves them.
"""

from __future__ import annotations

import asyncio
import json
import re
import weakref
from dataclasses import dataclass, field
from typing import Any

from topp_rl.data.prompt import Messages, PromptRecord
from topp_rl.tasks.checkers import math_answer
from topp_rl.tasks.environment import ModelTurn
from topp_rl.tasks.generated import ArithmeticTask
from topp_rl.tasks.sandbox import Outcome, SandboxLimits, SandboxResult, check_confinement, run_python

TOOL = {"name": "python", "description": "Runs Python code and returns what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python code"}},
                       "required": ["code"]}}
SYSTEM = ("You have a tool: python. It runs Python code and returns what the code prints.\n<tools>"
          + json.dumps([TOOL]) + "</tools>\nCall it like this:\n"
          '<tool_call>{"name": "python", "arguments": {"code": "print(12 + 30)"}}</tool_call>\n'
          "The tool's output comes back in a tool message. Then give the final answer as a number.")
EXAMPLE: Messages = [
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": '<tool_call>{"name": "python", "arguments": {"code": "print(12 + 30)"}}'
                                     "</tool_call>"},
    {"role": "tool", "content": "42\n"},
    {"role": "assistant", "content": "42"},
]
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# The reward's extra entries: per trajectory, how many calls, and how each came back.
COUNTS = ("tool/calls", "tool/ok", "tool/invalid", "tool/unknown_tool", "tool/exception", "tool/timeout",
          "tool/output_limit")


class PythonToolTask(ArithmeticTask):
    """`ArithmeticTask`'s operands asked as "What is a + b?" in a chat with the tool's description and one worked
    example (`example_shot=false` leaves the example out). Needs `chat_template=true`."""

    reward_name = "python_tool final answer"

    def __init__(self, *, example_shot: bool = True, system_prompt: str | None = SYSTEM, **kwargs: Any) -> None:
        if not kwargs.get("chat_template"):
            raise ValueError("task.chat_template=false: task=python_tool is a chat (system message, tool messages); "
                             "set task.chat_template=true with a chat model (e.g. model=smollm2)")
        super().__init__(system_prompt=system_prompt, **kwargs)
        self.example_shot = example_shot
        self._chat: dict[int, dict[str, str]] = {}  # per tokenizer (its id): the template's tool-turn strings

    def example(self, index: int) -> tuple[Messages, str, dict[str, Any]]:
        _, answer, data = super().example(index)
        question = {"role": "user", "content": f"What is {data['a']} {data['op']} {data['b']}?"}
        return [*(EXAMPLE if self.example_shot else []), question], answer, data

    def prompt(self, index: int, tokenizer) -> PromptRecord:
        record = super().prompt(index, tokenizer)
        chat = self._chat.get(id(tokenizer)) or self._chat.setdefault(id(tokenizer), chat_strings(tokenizer))
        return PromptRecord(index=record.index, text=record.text, prompt_ids=record.prompt_ids,
                            answer=record.answer, data={**record.data, "chat": chat})

    def reward(self, response: str, record: PromptRecord) -> float:
        """The final answer's score alone, from a response text (a single-turn step, or a check by hand)."""
        return final_answer_correct(response, record)


def chat_strings(tokenizer) -> dict[str, str]:
    """How the tokenizer's chat template closes an assistant turn and frames a tool message, read from its
    renderings: `close` follows an assistant message's content, `after_eos` is what of it follows the eos token,
    and a tool message with content C (then the next assistant turn's header) is `tool_open` + C + `tool_close`."""
    mark_a, mark_t = "\x00ASSISTANT\x00", "\x00TOOL\x00"
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": mark_a}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template([*base, {"role": "tool", "content": mark_t}], tokenize=False,
                                          add_generation_prompt=True)
    if not after.startswith(before) or before.count(mark_a) != 1 or after[len(before):].count(mark_t) != 1:
        raise ValueError(f"the chat template of {tokenizer.name_or_path} does not render a tool message by "
                         "appending to the conversation (it rewrites earlier turns), so tool output cannot be "
                         "added as environment tokens; use a model whose template appends turns")
    close = before.split(mark_a)[1]
    eos = tokenizer.eos_token or ""
    tool_open, tool_close = after[len(before):].split(mark_t)
    return {"close": close, "after_eos": close[len(eos):] if eos and close.startswith(eos) else close,
            "tool_open": tool_open, "tool_close": tool_close}


def final_answer_correct(text: str, record: PromptRecord) -> float:
    """1.0 when the last number of `text` equals the answer under math-verify. Only that number goes to
    math-verify, so its signal timeouts are not needed (they work on the main thread only, and episodes run on
    threads or an event loop)."""
    numbers = _NUMBER.findall(text)
    return math_answer(numbers[-1], record, signal_timeout=False) if numbers else 0.0


@dataclass(frozen=True)
class ToolCall:
    code: str | None  # None: the call is bad, `error` says why
    error: str | None = None
    kind: str | None = None  # the count it adds to when bad: "tool/invalid" or "tool/unknown_tool"


def parse_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block of a model turn (an unclosed one at the end counts as invalid)."""
    calls = []
    for body, closing in _CALL.findall(text):
        calls.append(_parse_call(body) if closing else _bad("the <tool_call> is not closed with </tool_call>"))
    return calls


def _parse_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return _bad(f"the tool call is not valid JSON ({e})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return _bad('the tool call must be one JSON object with a "name" and "arguments"')
    if call["name"] != TOOL["name"]:
        return ToolCall(None, f"unknown tool {call['name']!r}; the only tool is 'python'", "tool/unknown_tool")
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # OpenAI-style arguments: a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return _bad(f"the arguments are not valid JSON ({e})")
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        return _bad('python takes {"code": "<Python code>"}')
    return ToolCall(arguments["code"])


def _bad(why: str) -> ToolCall:
    return ToolCall(None, f"{why}; write <tool_call>{{\"name\": \"python\", \"arguments\": {{\"code\": \"...\"}}}}"
                          "</tool_call>", "tool/invalid")


class PythonToolEnvironment:
    """Runs the model's tool calls in `topp_rl.tasks.sandbox` (limits: `SandboxLimits`' fields), confined in
    bubblewrap: where this machine cannot (no bwrap), building it fails with the install line, unless
    `unconfined_sandbox=True` asks to run the code without any boundary. At most `max_parallel` sandboxes run at
    once (per event loop: each rollout step has its own); at most `max_calls_per_turn` calls of one turn run, later
    ones are answered with an error. The per-call wall timeout must sit well inside `rollout.step.env_timeout_s`,
    which bounds a whole turn's answer including the wait for a free sandbox."""

    def __init__(self, *, cpu_s: int = 2, memory_mb: int = 512, wall_s: float = 5.0, output_bytes: int = 1024,
                 processes: int = 16, scratch_mb: int = 16, max_parallel: int = 4, max_calls_per_turn: int = 2,
                 tool_credit: float = 0.0, unconfined_sandbox: bool = False) -> None:
        self.limits = SandboxLimits(cpu_s=cpu_s, memory_mb=memory_mb, wall_s=wall_s, output_bytes=output_bytes,
                                    processes=processes, scratch_mb=scratch_mb)
        if not isinstance(unconfined_sandbox, bool):
            raise ValueError(f"rollout.step.environment.unconfined_sandbox={unconfined_sandbox!r} must be true or "
                             "false")
        check_confinement(unconfined=unconfined_sandbox, opt_out="rollout.step.environment.unconfined_sandbox=true")
        self.unconfined_sandbox = unconfined_sandbox
        for name, value in (("max_parallel", max_parallel), ("max_calls_per_turn", max_calls_per_turn)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.step.environment.{name}={value!r} must be an integer >= 1")
        if not 0 <= tool_credit < 1:
            raise ValueError(f"rollout.step.environment.tool_credit={tool_credit!r} must be in [0, 1): a right "
                             "answer earns 1")
        self.max_parallel, self.max_calls_per_turn, self.tool_credit = max_parallel, max_calls_per_turn, tool_credit
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its semaphore

    def start(self, record: PromptRecord) -> PythonToolEpisode:
        if "chat" not in record.data:
            raise ValueError("the record has no 'chat' strings: the python_tool environment needs the prompts of "
                             "topp_rl.tasks.python_tool.PythonToolTask (task=python_tool)")
        return PythonToolEpisode(record, self)

    async def run(self, code: str) -> SandboxResult:
        loop = asyncio.get_running_loop()
        slots = self._slots.get(loop) or self._slots.setdefault(loop, asyncio.Semaphore(self.max_parallel))
        async with slots:
            return await run_python(code, self.limits, unconfined=self.unconfined_sandbox)


@dataclass(eq=False)
class PythonToolEpisode:
    record: PromptRecord
    env: PythonToolEnvironment
    final: str | None = None  # the final answer's text, once the model answered without a tool call
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    async def respond(self, turn: ModelTurn) -> str | None:
        calls = parse_calls(turn.text)
        if not calls:
            self.final = turn.text
            return None
        answers = []
        for i, call in enumerate(calls):
            self.counts["tool/calls"] += 1
            if i >= self.env.max_calls_per_turn:
                self.counts["tool/invalid"] += 1
                answers.append(f"Error: at most {self.env.max_calls_per_turn} tool calls per turn; this one did "
                               "not run")
            elif call.code is None:
                self.counts[call.kind] += 1
                answers.append(f"Error: {call.error}")
            else:
                answers.append(self._tell(await self.env.run(call.code)))
        chat = self.record.data["chat"]
        # The environment closes a turn the model did not end (cut by max_new_tokens) as the template would.
        text = chat["after_eos"] if turn.finished else chat["close"]
        return text + "".join(chat["tool_open"] + answer + chat["tool_close"] for answer in answers)

    def _tell(self, result: SandboxResult) -> str:
        """The tool message for a sandbox result, counted by its outcome."""
        limits = self.env.limits
        kind = {Outcome.OK: "tool/ok", Outcome.ERROR: "tool/exception", Outcome.TIMEOUT: "tool/timeout",
                Outcome.CPU_LIMIT: "tool/timeout", Outcome.MEMORY_LIMIT: "tool/exception",
                Outcome.OUTPUT_LIMIT: "tool/output_limit"}[result.outcome]
        self.counts[kind] += 1
        if result.outcome == Outcome.OK:
            return result.stdout or "(the code printed nothing: print the result)"
        if result.outcome == Outcome.ERROR:
            return f"{result.stdout}Error:\n{result.stderr or f'the code exited with status {result.exit_code}'}"
        if result.outcome == Outcome.TIMEOUT:
            return f"{result.stdout}Error: the code ran past {limits.wall_s:g} s and was stopped"
        if result.outcome == Outcome.CPU_LIMIT:
            return f"{result.stdout}Error: the code used up its {limits.cpu_s} s of CPU time and was stopped"
        if result.outcome == Outcome.MEMORY_LIMIT:
            return f"{result.stdout}Error: the code used more than {limits.memory_mb} MB of memory and was stopped"
        return f"{result.stdout}\nError: the code printed more than {limits.output_bytes} bytes and was stopped"

    def reward(self) -> dict[str, float]:
        correct = final_answer_correct(self.final, self.record) if self.final is not None else 0.0
        used_tool = float(self.counts["tool/ok"] > 0)
        return {"score": correct + self.env.tool_credit * used_tool, "correct": correct,
                "answered": float(self.final is not None), **{k: float(v) for k, v in self.counts.items()}}
