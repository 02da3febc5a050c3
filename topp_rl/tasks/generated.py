"""The built-in generated tasks (no data files), each drawing example `index` from a seeded RNG:

- `arithmetic`: "12+7=" -> "19", operands drawn from a seeded RNG, verified exactly (leading integer of the
  response); options: digits, ops, optional modulus (`mod=10`: one-character answers).
- `copy_digit`: "7:" -> "7" with partial credit for answering with some other digit. Learnable by a tiny
  random-init model in a few CPU minutes (the default run's task).
- `countdown`: "Use 3, 7, 25 to make 46 ..." -> an expression; see `rewards.countdown_score` for the rule.
"""

import random
import re
from typing import Any

from topp_rl.data.prompt import PromptRecord
from topp_rl.tasks.base import Task
from topp_rl.tasks.rewards import countdown_score

_LEADING_INT = re.compile(r"\s*(-?\d+)")


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
