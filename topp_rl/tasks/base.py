"""Tasks: prompts and rewards (config: `task._target_` names the class, e.g. `topp_rl.tasks.ArithmeticTask`).

A task produces prompt records deterministically from an index (`example(index)`), so the datamodule's data
position is one integer and a resumed run draws the same prompts. Prompts and responses cross the tokenizer
through the plain HF tokenizer API (`encode(text, add_special_tokens=False)`, `decode(ids,
skip_special_tokens=True)`, optional `apply_chat_template`), which the offline char tokenizer and real HF
tokenizers share. A prompt is a string or a chat message list (`[{"role": ..., "content": ...}]`); with
`chat_template=true` a string becomes one user message, and `system_prompt` is put first unless the
conversation already starts with a system message.

Built in: `topp_rl.tasks.generated` (arithmetic, copy_digit, countdown) and `topp_rl.tasks.datasets`
(`dataset` / `jsonl` / `gsm8k`: rows of a jsonl / json / parquet file or a saved HF dataset).
"""

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from topp_rl.data.prompt import Messages, PromptRecord, prompt_text
from topp_rl.data.sample import Sample
from topp_rl.tasks.rewards import RewardSet, RewardTerm

HELD_OUT_OFFSET = 10**9  # a generated task's held-out examples start here, past every training step's index


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

    def describe(self) -> str:
        """The task's name on the console (a dataset task adds its file and split)."""
        return type(self).__name__

    def held_out(self, split: str) -> tuple["Task", int]:
        """(task, first example index) that evaluation on `split` (`eval.split`) reads. A generated task has one
        held-out split, `test`: its own examples from index 10**9 on, drawn like the training ones but at indices
        no training step reaches (a task with few distinct prompts, such as copy_digit, repeats them)."""
        name = type(self).__name__
        if self.num_examples is not None:
            raise ValueError(
                f"eval.split={split!r}: the task {name} has a fixed set of {self.num_examples} examples and no other "
                "split; set eval.task to the task to evaluate (e.g. its test data) instead"
            )
        if split != "test":
            raise ValueError(
                f"eval.split={split!r}: the task {name} generates its examples, and its one held-out split is "
                "'test' (examples at indices no training step reaches); set eval.split=test"
            )
        return self, HELD_OUT_OFFSET

    def check_tokenizer(self, tokenizer, *, key: str = "task") -> None:
        """Refuse at start what `encode` would fail on at the first rollout: `chat_template=true` with a
        tokenizer that has no chat template (`key` is the task's config node, named in the message)."""
        if self.chat_template and tokenizer.chat_template is None:
            where = tokenizer.name_or_path or f"{type(tokenizer).__name__} built in memory (no path)"
            raise ValueError(
                f"{key}.chat_template=true, but the tokenizer of {where} has no chat template; set "
                f"{key}.chat_template=false to encode prompts as plain text, or use a model whose tokenizer has a "
                "chat template (e.g. model=smollm2, or model=hf_path model.path=<an instruct model's dir>)"
            )

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

    def score(self, samples: list[Sample], records: Mapping[int, PromptRecord] | Sequence[PromptRecord],
              tokenizer) -> list[float]:
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
