"""`PromptRecord`: one prompt as a task produced it (its example index, text, token ids, reference answer and
extra fields); every reward function receives it."""

from dataclasses import dataclass, field
from typing import Any

Messages = list[dict[str, str]]  # a chat conversation: [{"role": ..., "content": ...}]


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
