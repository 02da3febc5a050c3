"""Built-in reward checkers (also importable from `topp_rl.tasks.rewards`, the name configs use).

- `math_answer`: 1.0 when the response's final answer equals the reference under math-verify (symbolic
  equality: `\\boxed{1/2}` == `0.5`), else 0.0. The response's answer is its last `\\boxed{}`, else the text
  after its last `####` (GSM8K's marker), else its last number ("The answer is 18."). The reference may be
  GSM8K's full solution ("reasoning #### 18"): the part after its last `####` is the answer.
- `leading_number`: a format reward, 1.0 when the response starts with a number.
- `countdown_score`: the Countdown rule (each given number used exactly once, or at most once; + - * / and
  parentheses), checked with `ast` and exact `Fraction` arithmetic, never `eval`.
"""

import ast
import functools
import logging
import operator
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from topp_rl.data import PromptRecord


# ----- math answers (math-verify) -----
def math_answer(response: str, record: "PromptRecord", *, signal_timeout: bool = True) -> float:
    """1.0 when the response's final answer equals `record.answer` under math-verify, else 0.0.
    `signal_timeout=False` runs math-verify without its SIGALRM timeouts, which work on the main thread only: for
    callers on other threads that bound the text themselves (e.g. a bare number)."""
    from math_verify import verify

    if record.answer is None:
        raise ValueError("the record has no reference answer; set the task's answer_key to the answer column")
    seconds = 5 if signal_timeout else None  # math-verify's defaults
    if not signal_timeout:
        _quiet_known_no_timeout()
    return float(verify(_gold(record.answer, seconds), _parse(_final_part(response), seconds),
                        timeout_seconds=seconds))


_LEADING_NUMBER = re.compile(r"\s*[-+]?\$?\d")


def leading_number(response: str, record: "PromptRecord") -> float:
    """1.0 when the response starts with a number ("14", "14 apples", "-3.5"), else 0.0: a format reward that
    gives a small model asked for a bare number a signal before its answers are right."""
    return float(_LEADING_NUMBER.match(response) is not None)


@functools.cache
def _quiet_known_no_timeout() -> None:
    """math-verify warns that it runs without a timeout (once per thread race, so often); the caller chose it."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith("Timeout is disabled"))


@functools.lru_cache(maxsize=65536)
def _gold(answer: str, seconds: int | None = 5):
    text = _final_part(answer)
    parsed = _parse(text, seconds)
    if not parsed and _LATEX.search(text):  # bare LaTeX ("x^2+1") parses only between $ signs; prose never
        parsed = _parse(f"${text}$", seconds)
    if not parsed:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}; fix the answer column")
    return parsed


_LATEX = re.compile(r"[\\^_{}]")


def _parse(text: str, seconds: int | None = 5):
    from math_verify import parse

    return parse(text, parsing_timeout=seconds)


def _final_part(text: str) -> str:
    """The first line after the last GSM8K "####" marker, unless the text has a \\boxed{} answer."""
    if "\\boxed" in text or "####" not in text:
        return text
    tail = text.rpartition("####")[2].strip()
    return tail.splitlines()[0] if tail else ""


# ----- Countdown -----
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_EXPRESSION_CHARS = 256


def countdown_expression(response: str) -> str:
    """The expression a response gives: the last `<answer>...</answer>`, else its first non-empty line;
    a trailing "= value" is dropped."""
    tagged = _ANSWER_TAG.findall(response)
    text = tagged[-1] if tagged else next((line for line in response.splitlines() if line.strip()), "")
    return text.partition("=")[0].strip()


def countdown_score(
    response: str, numbers: Sequence[int], target: int, *, use_all: bool = True, format_credit: float = 0.0
) -> float:
    """1.0 when the response's expression uses `numbers` by the rule and equals `target` exactly;
    `format_credit` when it is well formed (parses, only + - * / and parentheses over the given numbers, each
    used by the rule) but has another value (or divides by zero); 0.0 otherwise.

    Rule: `use_all` -> every number exactly once (the Countdown game's and TinyZero's rule); else each number
    at most once. A number given twice may be used twice.
    """
    expr = countdown_expression(response)
    if not expr or len(expr) > MAX_EXPRESSION_CHARS:
        return 0.0
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return 0.0
    used = _literals(tree.body)
    if used is None or not _uses_numbers(used, numbers, use_all=use_all):
        return 0.0
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        return format_credit
    return 1.0 if value == target else format_credit


def _literals(node: ast.AST) -> list[int] | None:
    """The integer literals of an expression made only of + - * / over non-negative integers, else None."""
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _literals(node.left), _literals(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value]
    return None  # unary minus, names, calls, floats, **, ...: not allowed


def _uses_numbers(used: list[int], numbers: Sequence[int], *, use_all: bool) -> bool:
    available = sorted(int(n) for n in numbers)
    if use_all:
        return sorted(used) == available
    pool = list(available)
    for n in used:
        if n not in pool:
            return False
        pool.remove(n)
    return True


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.BinOp):
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    return Fraction(node.value)
