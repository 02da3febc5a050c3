"""`lookup`: a toy multi-turn tool task the tiny char model learns on CPU (`task=lookup`, the agent loop).

Example `index` draws a table of `num_keys` keys (the letters a, b, ...) to random digits and asks one key:
the prompt is "?c". The model's first turn is a tool call: its first character names a key. The environment
(`LookupEnvironment`) answers "=7" (that key's value), or ends the trajectory when the call names no key. The
model's second turn repeats the value: its first character. Reward in [0, 1]: `call_credit` for calling the
asked key, plus 1 - `call_credit` for repeating the value the environment answered (`digit_credit` of it for
answering another digit; 0 by default: in the default run it helped a seed stuck on letters less than it held
back the others, measured over seeds 0-2).
The value cannot be guessed from the key (drawn per example), so the model must call and then read. Both turns
repeat the token just before them (the key, the value): the random tiny model's greedy decode already does
(tied embeddings), training moves the sampled policy there; docs/agents.md has the curves and a harder variant.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Any

from topp_rl.data.prompt import PromptRecord
from topp_rl.tasks.base import Task
from topp_rl.tasks.environment import ModelTurn

_TRANSCRIPT = re.compile(r"^(.)(?:=(.)(.))?")  # call, then the environment's "=v" and the answer


def lookup_score(*, asked: str, call: str, shown: str | None, answer: str | None, call_credit: float,
                 digit_credit: float) -> float:
    """`call_credit` for calling the asked key, the rest for repeating the value shown (`digit_credit` of the rest
    for another digit)."""
    value = call_credit * (call == asked)
    if shown is None or answer is None or not answer.isdigit():
        return value
    return value + (1 - call_credit) * (1.0 if answer == shown else digit_credit)


class LookupTask(Task):
    reward_name = "lookup"

    def __init__(self, *, num_keys: int = 10, call_credit: float = 0.5, digit_credit: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 1 <= num_keys <= 26:
            raise ValueError(f"num_keys ({num_keys}) must be in [1, 26] (the keys are the letters a-z)")
        if not 0 <= call_credit < 1:
            raise ValueError(f"call_credit ({call_credit}) must be in [0, 1): repeating the value earns the rest")
        if not 0 <= digit_credit < 1:
            raise ValueError(f"digit_credit ({digit_credit}) must be in [0, 1): the right digit earns 1")
        self.num_keys, self.call_credit, self.digit_credit = num_keys, call_credit, digit_credit

    def example(self, index: int) -> tuple[str, str, dict[str, Any]]:
        rng = self._rng(index)
        table = {k: str(rng.randrange(10)) for k in string.ascii_lowercase[: self.num_keys]}
        key = rng.choice(sorted(table))
        credits = {"call_credit": self.call_credit, "digit_credit": self.digit_credit}
        return f"?{key}", table[key], {"key": key, "table": table, **credits}

    def reward(self, response: str, record: PromptRecord) -> float:
        """The same score from a decoded transcript ("c=77"), for a single-turn step or a check by hand."""
        match = _TRANSCRIPT.match(response)
        if match is None:
            return 0.0
        call, shown, answer = match.groups()
        return lookup_score(asked=record.data["key"], call=call, shown=shown, answer=answer,
                            call_credit=self.call_credit, digit_credit=self.digit_credit)


@dataclass(eq=False)
class LookupEpisode:
    record: PromptRecord
    calls: list[str] = field(default_factory=list)  # each model turn's first character
    shown: str | None = None

    def respond(self, turn: ModelTurn) -> str | None:
        self.calls.append(turn.text[:1])
        if len(self.calls) > 1:  # the answer: done
            return None
        self.shown = self.record.data["table"].get(self.calls[0])
        return None if self.shown is None else f"={self.shown}"

    def reward(self) -> float:
        answer = self.calls[1] if len(self.calls) > 1 else None
        data = self.record.data
        return lookup_score(asked=data["key"], call=self.calls[0] if self.calls else "", shown=self.shown,
                            answer=answer, call_credit=data["call_credit"], digit_credit=data["digit_credit"])


class LookupEnvironment:
    """The lookup tool: one `LookupEpisode` per trajectory, reading the table of the record."""

    def start(self, record: PromptRecord) -> LookupEpisode:
        return LookupEpisode(record)
