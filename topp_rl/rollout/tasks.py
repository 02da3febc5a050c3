"""Tasks: prompts and rewards (config: `task._target_` names the class, e.g. `topp_rl.rollout.tasks.ArithmeticTask`).

A task produces prompt records deterministically from an index (`example(index)`), so the datamodule's data
position is one integer and a resumed run draws the same prompts. Prompts and responses cross the tokenizer
through the plain HF tokenizer API (`encode(text, add_special_tokens=False)`, `decode(ids,
skip_special_tokens=True)`, optional `apply_chat_template`), which the offline char tokenizer and real HF
tokenizers share. A prompt is a string or a chat message list (`[{"role": ..., "content": ...}]`); with
`chat_template=true` a string becomes one user message, and `system_prompt` is put first unless the
conversation already starts with a system message.

Built in:
- `arithmetic`: "12+7=" -> "19", operands drawn from a seeded RNG, verified exactly (leading integer of the
  response); options: digits, ops, optional modulus (`mod=10`: one-character answers).
- `copy_digit`: "7:" -> "7" with partial credit for answering with some other digit. Learnable by a tiny
  random-init model in a few CPU minutes (the default run's task).
- `countdown`: "Use 3, 7, 25 to make 46 ..." -> an expression; see `rewards.countdown_score` for the rule.
- `dataset` / `jsonl` / `gsm8k`: rows of a jsonl / json / parquet file or a saved HF dataset
  (`topp_rl.rollout.datasets.DatasetTask`; `JsonlTask` is another name for it), rewards from `task.rewards`.
"""

import random
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from topp_rl.rollout.rewards import RewardError, RewardSet, RewardTerm, countdown_score, resolve_reward_fn
from topp_rl.rollout.sample import Sample

__all__ = [
    "ArithmeticTask", "CopyDigitTask", "CountdownTask", "Messages", "PromptRecord", "RewardError", "Task",
    "prompt_text", "resolve_reward_fn",
]

_LEADING_INT = re.compile(r"\s*(-?\d+)")
Messages = list[dict[str, str]]


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    index: int  # the task's example index (the data position)
    text: str  # the prompt text (a conversation's last message)
    prompt_ids: list[int]
    answer: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


def prompt_text(prompt: str | Messages) -> str:
    """What `PromptRecord.text` holds: the prompt itself, or a conversation's last message."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


class Task(ABC):
    """Base class: subclasses define `example` and `reward` (or `reward_set`); encoding and scoring live here."""

    reward_name: str = ""
    log_reward_parts: bool = False  # log each reward function's value apart (a lone `reward` is the reward)

    def __init__(
        self, *, add_bos: bool = True, chat_template: bool = False, system_prompt: str | None = None, seed: int = 0
    ) -> None:
        if system_prompt is not None and not chat_template:
            raise ValueError(
                f"system_prompt ({system_prompt[:40]!r}...) needs chat_template=true: without a chat template "
                "there is no system turn to put it in"
            )
        self.add_bos, self.chat_template, self.system_prompt, self.seed = add_bos, chat_template, system_prompt, seed

    @property
    def num_examples(self) -> int | None:
        """Distinct examples, or None when the task generates without end."""
        return None

    @abstractmethod
    def example(self, index: int) -> tuple[str | Messages, str | None, dict[str, Any]]:
        """(prompt text or messages, reference answer, extra data) of example `index`; deterministic in (seed, index)."""

    @abstractmethod
    def reward(self, response: str, record: PromptRecord) -> float: ...

    @cached_property
    def reward_set(self) -> RewardSet:
        """The functions `score` calls; by default `reward` alone (its value is the reward, not logged apart)."""
        return RewardSet([RewardTerm(name=self.reward_name or type(self).__name__, fn=self.reward)])

    def stats(self) -> dict[str, float]:
        """Figures about the task's data that `RolloutStats` logs every step (e.g. filtered prompts)."""
        return {}

    def prompt(self, index: int, tokenizer) -> PromptRecord:
        prompt, answer, data = self.example(index)
        return PromptRecord(
            index=index, text=prompt_text(prompt), prompt_ids=self.encode(prompt, tokenizer), answer=answer, data=data
        )

    def messages(self, prompt: str | Messages) -> Messages:
        """The conversation a chat template renders: the prompt as a user turn, `system_prompt` first."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def encode(self, prompt: str | Messages, tokenizer) -> list[int]:
        if self.chat_template:
            ids = tokenizer.apply_chat_template(self.messages(prompt), add_generation_prompt=True, tokenize=True)
            # transformers 5 returns a BatchEncoding (a Mapping, not a dict subclass); older ones a list.
            return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        if not isinstance(prompt, str):
            raise ValueError("a chat message list needs chat_template=true (the tokenizer's template renders it)")
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        bos = getattr(tokenizer, "bos_token_id", None)
        return [bos, *ids] if self.add_bos and bos is not None else ids

    def score(self, samples: list[Sample], records: Sequence[PromptRecord], tokenizer) -> list[float]:
        """Set `sample.reward` for every sample (its record is `records[sample.group_index]`); a configured
        reward set also leaves each function's value in `sample.metadata["rewards"]`."""
        mine = [records[s.group_index] for s in samples]
        responses = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        totals, parts = self.reward_set(responses, mine, [s.index for s in samples])
        for s, record, total, named in zip(samples, mine, totals, parts, strict=True):
            s.reward = total
            if self.log_reward_parts:
                s.metadata["rewards"] = named
            s.metadata.setdefault("answer", record.answer)
        return totals

    def _rng(self, index: int) -> random.Random:
        return random.Random(f"{type(self).__name__}:{self.seed}:{index}")


class ArithmeticTask(Task):
    reward_name = "arithmetic exact match"

    def __init__(
        self,
        *,
        digits: int = 2,
        ops: str = "+-",
        mod: int | None = None,
        partial_credit: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if digits < 1:
            raise ValueError(f"digits ({digits}) must be >= 1")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"ops ({ops!r}) must be a non-empty string of '+', '-', '*'")
        if mod is not None and mod < 2:
            raise ValueError(f"mod ({mod}) must be >= 2, or None for the plain result")
        self.digits, self.ops, self.mod, self.partial_credit = digits, ops, mod, partial_credit

    def example(self, index: int) -> tuple[str, str, dict[str, Any]]:
        rng = self._rng(index)
        a, b = (rng.randrange(10**self.digits) for _ in range(2))
        op = rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        if self.mod is not None:
            value %= self.mod
        return f"{a}{op}{b}=", str(value), {"a": a, "b": b, "op": op}

    def reward(self, response: str, record: PromptRecord) -> float:
        match = _LEADING_INT.match(response)
        if match is None:
            return 0.0
        return 1.0 if match.group(1) == record.answer else self.partial_credit


class CopyDigitTask(Task):
    """ "d:" -> "d": 1 when the response starts with d, `digit_credit` when it starts with another digit."""

    reward_name = "copy_digit first character"

    def __init__(self, *, digit_credit: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0 <= digit_credit < 1:
            raise ValueError(f"digit_credit ({digit_credit}) must be in [0, 1)")
        self.digit_credit = digit_credit

    def example(self, index: int) -> tuple[str, str, dict[str, Any]]:
        digit = str(self._rng(index).randrange(10))
        return f"{digit}:", digit, {}

    def reward(self, response: str, record: PromptRecord) -> float:
        first = response[:1]
        if first == record.answer:
            return 1.0
        return self.digit_credit if first.isdigit() else 0.0


class CountdownTask(Task):
    """Countdown: reach `target` from the given numbers with + - * / and parentheses (no download needed).

    Numbers are drawn from [1, max_number]; the target is the value of a random chain over all of them whose
    intermediate results are positive integers (so every puzzle has a solution, kept in `data["solution"]`),
    in [1, max_target]. Reward: `rewards.countdown_score` (1.0 right; `format_credit` for a well-formed
    expression with another value). `use_all`: every number exactly once (the game's rule), else at most once.
    """

    reward_name = "countdown"
    TEMPLATE = "Use {numbers} to make {target} with + - * / and (), {rule}. Answer:"

    def __init__(
        self,
        *,
        num_numbers: int = 3,
        max_number: int = 20,
        max_target: int = 100,
        use_all: bool = True,
        format_credit: float = 0.0,
        template: str = TEMPLATE,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if num_numbers < 2:
            raise ValueError(f"num_numbers ({num_numbers}) must be >= 2")
        if max_number < 1 or max_target < 1:
            raise ValueError(f"max_number ({max_number}) and max_target ({max_target}) must be >= 1")
        if not 0 <= format_credit < 1:
            raise ValueError(f"format_credit ({format_credit}) must be in [0, 1): a right answer earns 1")
        for key in ("{numbers}", "{target}"):
            if key not in template:
                raise ValueError(f"template ({template!r}) must contain {key}")
        self.num_numbers, self.max_number, self.max_target = num_numbers, max_number, max_target
        self.use_all, self.format_credit, self.template = use_all, format_credit, template

    def example(self, index: int) -> tuple[str, str, dict[str, Any]]:
        rng = self._rng(index)
        for _ in range(1000):
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            target, solution = _chain(rng, numbers)
            if 1 <= target <= self.max_target:
                break
        else:
            raise ValueError(
                f"no Countdown target in [1, {self.max_target}] found for {self.num_numbers} numbers up to "
                f"{self.max_number}; raise max_target"
            )
        rule = "each number exactly once" if self.use_all else "each number at most once"
        text = self.template.format(numbers=", ".join(map(str, numbers)), target=target, rule=rule)
        return text, str(target), {"numbers": numbers, "target": target, "solution": solution}

    def reward(self, response: str, record: PromptRecord) -> float:
        return countdown_score(
            response, record.data["numbers"], record.data["target"], use_all=self.use_all,
            format_credit=self.format_credit,
        )


def _chain(rng: random.Random, numbers: list[int]) -> tuple[int, str]:
    """(value, expression) of a left-to-right chain over a shuffled copy of `numbers`, each intermediate
    result a positive integer ("-" only when it stays positive, "/" only when it divides)."""
    order = rng.sample(numbers, len(numbers))
    value, expr = order[0], str(order[0])
    for n in order[1:]:
        ops = ["+", "*"] + (["-"] if value > n else []) + (["/"] if value % n == 0 else [])
        op = rng.choice(ops)
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
        expr = f"({expr}{op}{n})"
    return value, expr[1:-1] if expr.startswith("(") else expr


def __getattr__(name: str) -> Any:
    # `JsonlTask` moved to topp_rl.rollout.datasets (it is the dataset task); the old import path still works.
    if name == "JsonlTask":
        from topp_rl.rollout.datasets import JsonlTask

        return JsonlTask
    raise AttributeError(f"module 'topp_rl.rollout.tasks' has no attribute {name!r}")
