"""Tasks: prompts and rewards (config: `task._target_` names the class, e.g. `topp_rl.rollout.tasks.ArithmeticTask`).

A task produces prompt records deterministically from an index (`example(index)`), so the datamodule's data
position is one integer and a resumed run draws the same prompts. Prompts and responses cross the tokenizer
through the plain HF tokenizer API (`encode(text, add_special_tokens=False)`, `decode(ids,
skip_special_tokens=True)`, optional `apply_chat_template`), which the offline char tokenizer and real HF
tokenizers share.

Built in:
- `arithmetic`: "12+7=" -> "19", operands drawn from a seeded RNG, verified exactly (leading integer of the
  response); options: digits, ops, optional modulus (`mod=10`: one-character answers).
- `copy_digit`: "7:" -> "7" with partial credit for answering with some other digit. Learnable by a tiny
  random-init model in a few CPU minutes (the default run's task).
- `jsonl`: prompts from a JSONL file, reward function named by import path "pkg.mod:fn", called as
  `fn(response: str, record: dict) -> float` (record = the JSONL line).
"""

import importlib
import json
import math
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topp_rl.rollout.sample import Sample

_LEADING_INT = re.compile(r"\s*(-?\d+)")


class RewardError(RuntimeError):
    """A reward function raised; the message names the sample and the function."""


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    index: int  # the task's example index (the data position)
    text: str
    prompt_ids: list[int]
    answer: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


class Task(ABC):
    """Base class: subclasses define `example` and `reward`; encoding and scoring live here."""

    reward_name: str = ""

    def __init__(self, *, add_bos: bool = True, chat_template: bool = False, seed: int = 0) -> None:
        self.add_bos, self.chat_template, self.seed = add_bos, chat_template, seed

    @property
    def num_examples(self) -> int | None:
        """Distinct examples, or None when the task generates without end."""
        return None

    @abstractmethod
    def example(self, index: int) -> tuple[str, str | None, dict[str, Any]]:
        """(prompt text, reference answer, extra data) of example `index`; deterministic in (seed, index)."""

    @abstractmethod
    def reward(self, response: str, record: PromptRecord) -> float: ...

    def prompt(self, index: int, tokenizer) -> PromptRecord:
        text, answer, data = self.example(index)
        return PromptRecord(
            index=index, text=text, prompt_ids=self.encode(text, tokenizer), answer=answer, data=data
        )

    def encode(self, text: str, tokenizer) -> list[int]:
        if self.chat_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            # transformers 5 returns a BatchEncoding (a Mapping, not a dict subclass); older ones a list.
            return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        bos = getattr(tokenizer, "bos_token_id", None)
        return [bos, *ids] if self.add_bos and bos is not None else ids

    def score(self, samples: list[Sample], records: list[PromptRecord], tokenizer) -> list[float]:
        """Set `sample.reward` for every sample (its record is `records[sample.group_index]`)."""
        rewards = []
        for s in samples:
            record = records[s.group_index]
            response = tokenizer.decode(s.response_ids, skip_special_tokens=True)
            try:
                value = float(self.reward(response, record))
            except Exception as err:
                raise RewardError(
                    f"reward function {self.reward_name or type(self).__name__} raised on sample {s.index} "
                    f"(group {s.group_index}, prompt {record.text!r}, response {response!r}): "
                    f"{type(err).__name__}: {err}"
                ) from err
            if not math.isfinite(value):
                raise RewardError(
                    f"reward function {self.reward_name} returned {value} for sample {s.index}; rewards must be finite"
                )
            s.reward = value
            s.metadata.setdefault("answer", record.answer)
            rewards.append(value)
        return rewards

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


class JsonlTask(Task):
    def __init__(
        self,
        *,
        path: str | Path,
        reward_fn: str,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        shuffle: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.path = Path(path)
        self.records = _read_jsonl(self.path, prompt_key)
        self.prompt_key, self.answer_key, self.shuffle = prompt_key, answer_key, shuffle
        self.reward_name = reward_fn
        self._reward_fn = resolve_reward_fn(reward_fn)

    @property
    def num_examples(self) -> int:
        return len(self.records)

    def example(self, index: int) -> tuple[str, str | None, dict[str, Any]]:
        epoch, pos = divmod(index, len(self.records))
        order = list(range(len(self.records)))
        if self.shuffle:  # a fresh permutation per pass over the file, fixed by (seed, epoch)
            random.Random(f"jsonl:{self.seed}:{epoch}").shuffle(order)
        record = self.records[order[pos]]
        answer = record.get(self.answer_key)
        return str(record[self.prompt_key]), None if answer is None else str(answer), record

    def reward(self, response: str, record: PromptRecord) -> float:
        return self._reward_fn(response, record.data)


def resolve_reward_fn(spec: str) -> Callable[[str, dict[str, Any]], float]:
    """ "pkg.mod:fn" -> the function."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward_fn ({spec!r}) must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"reward_fn {spec!r} cannot be imported ({err}); check the module path and name"
        ) from err
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def _read_jsonl(path: Path, prompt_key: str) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ValueError(f"JSONL prompt file {path} does not exist; pass an existing file as path")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno} is not valid JSON ({err})") from None
        if not isinstance(record, dict) or prompt_key not in record:
            raise ValueError(
                f"{path}:{lineno} has no {prompt_key!r} field; set prompt_key to the prompt's field"
            )
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records; a JSONL task needs at least one prompt")
    return records
