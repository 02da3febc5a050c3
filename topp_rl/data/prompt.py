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


def check_encodable(record: PromptRecord, tokenizer) -> None:
    """A prompt must reach the model whole: a character the tokenizer maps to its unknown token would be
    trained on as something else (or, without an unknown token, silently dropped)."""
    unk = tokenizer.unk_token_id
    # Some tokenizers reuse a real special token (BOS / EOS) as unk; those ids mean nothing unknown.
    if unk is None or unk in (tokenizer.bos_token_id, tokenizer.eos_token_id) or unk not in record.prompt_ids:
        return
    missing = sorted({c for c in record.text if tokenizer.encode(c, add_special_tokens=False) == [unk]})
    raise ValueError(
        f"prompt {record.index} ({record.text[:60]!r}) holds characters the tokenizer cannot encode: {missing}; "
        "remove them from the data, or use a model whose tokenizer covers them"
    )
