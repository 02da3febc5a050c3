"""Reward functions: weighted sets of named functions (config `task.rewards`) and two built-in checkers.

A reward function is called `fn(response: str, record: PromptRecord) -> float | dict[str, float]`:
`record.answer` is the reference answer (the task's answer column), `record.data` the whole dataset row,
`record.text` the prompt. Marked batched (the `@batched` decorator, or `batched: true` in its config entry)
it is called once per rollout step as `fn(responses, records)` and returns one value per response. A dict
value holds named sub-scores: each is logged, and the function's value is their sum.

`RewardSet`: reward = sum_i weight_i * value_i. Every function's unweighted value goes to
`sample.metadata["rewards"][name]` (dict entries as `"<name>/<key>"`), which `RolloutStats` logs as
`rollout/reward/<name>_mean`.

Functions are named `pkg.mod:fn` (imported) or `path/to/file.py:fn` (loaded from that file; a relative path
is taken from the working directory).

Built in:
- `math_answer`: 1.0 when the response's final answer equals the reference under math-verify (symbolic
  equality: `\\boxed{1/2}` == `0.5`), else 0.0. The response's answer is its last `\\boxed{}`, else the text
  after its last `####` (GSM8K's marker), else its last number ("The answer is 18."). The reference may be
  GSM8K's full solution ("reasoning #### 18"): the part after its last `####` is the answer.
- `countdown_score`: the Countdown rule (each given number used exactly once, or at most once; + - * / and
  parentheses), checked with `ast` and exact `Fraction` arithmetic, never `eval`.
"""

import ast
import functools
import hashlib
import importlib
import importlib.util
import math
import numbers
import operator
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from topp_rl.data import PromptRecord

RewardValue = float | Mapping[str, float]
ENTRY_KEYS = {"fn", "weight", "name", "batched", "kwargs"}


class RewardError(RuntimeError):
    """A reward function raised or returned a bad value; the message names the sample and the function."""


def batched(fn: Callable) -> Callable:
    """Mark `fn(responses, records) -> list[value]` as batched: called once per step, not once per sample."""
    fn.batched = True
    return fn


# ----- naming functions -----
def resolve_reward_fn(spec: str) -> Callable:
    """ "pkg.mod:fn" or "path/to/file.py:fn" -> the function."""
    target, sep, attr = str(spec).rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(
            f"reward_fn ({spec!r}) must look like 'package.module:function' or 'path/to/file.py:function'"
        )
    module = _load_file(target, spec) if target.endswith(".py") else _import(target, spec)
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward_fn {spec!r}: {target} has no attribute {attr!r}; check the function name")
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def _import(module_name: str, spec: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward_fn {spec!r} cannot be imported ({err}); check the module path and name") from err


def _load_file(path_text: str, spec: str):
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward_fn {spec!r}: file {path} does not exist; pass an existing .py file")
    # A private module name per file: two reward files both called rewards.py must not replace each other.
    name = f"topp_rl_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before exec: dataclasses / pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(f"reward_fn {spec!r}: loading {path} raised {type(err).__name__}: {err}") from err
    return module


# ----- weighted sets -----
@dataclass(frozen=True, kw_only=True)
class RewardTerm:
    name: str
    fn: Callable
    weight: float = 1.0
    batched: bool = False


class RewardSet:
    """Weighted named reward functions; `__call__` scores a batch and checks every value."""

    def __init__(self, terms: Sequence[RewardTerm]) -> None:
        if not terms:
            raise ValueError("a reward set needs at least one function; set task.rewards or task.reward_fn")
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names {names} repeat; give each task.rewards entry its own name")
        self.terms = list(terms)
        self._keys: dict[str, tuple[str, ...] | None] = {}  # per function: dict keys fixed by the first call

    @classmethod
    def from_config(cls, entries: Sequence[Mapping[str, Any]]) -> "RewardSet":
        """Entries `{fn: "pkg.mod:fn", weight: 1.0, name: ..., batched: false, kwargs: {...}}`."""
        return cls([_term(i, entry) for i, entry in enumerate(entries)])

    @property
    def name(self) -> str:
        return " + ".join(f"{t.weight:g}*{t.name}" for t in self.terms)

    def __call__(
        self, responses: list[str], records: list["PromptRecord"], sample_ids: list[int]
    ) -> tuple[list[float], list[dict[str, float]]]:
        """(weighted total per response, unweighted named values per response)."""
        totals = [0.0] * len(responses)
        parts: list[dict[str, float]] = [{} for _ in responses]
        for term in self.terms:
            for i, value in enumerate(self._values(term, responses, records, sample_ids)):
                named = self._named(term, value, sample_ids[i])
                parts[i].update(named)
                totals[i] += term.weight * sum(named.values())
        return totals, parts

    def _values(self, term: RewardTerm, responses, records, sample_ids) -> list[RewardValue]:
        if term.batched:
            values = _call(term, (responses, records))
            if not isinstance(values, Sequence) or len(values) != len(responses):
                got = len(values) if isinstance(values, Sequence) else type(values).__name__
                raise RewardError(
                    f"batched reward function {term.name} returned {got} values for {len(responses)} responses; "
                    "return a list with one value per response"
                )
            return list(values)
        return [
            _call(term, (resp, rec), sample_id=sid)
            for resp, rec, sid in zip(responses, records, sample_ids, strict=True)
        ]

    def _named(self, term: RewardTerm, value: RewardValue, sample_id: int) -> dict[str, float]:
        if isinstance(value, Mapping):
            if not value:  # its sum would be a silent 0.0, and it would log nothing
                raise RewardError(
                    f"reward function {term.name} returned an empty dict for sample {sample_id}; return a float, or "
                    "a dict with at least one named sub-score"
                )
            named = {f"{term.name}/{k}": value[k] for k in value}
            keys = tuple(sorted(value))
        else:
            named, keys = {term.name: value}, None
        # Every step (and every rank) must log the same names, so a function's dict keys may not change.
        expected = self._keys.setdefault(term.name, keys)
        if keys != expected:
            raise RewardError(
                f"reward function {term.name} returned keys {keys} for sample {sample_id}, earlier {expected}; "
                "return the same (float or dict) shape every time"
            )
        return {k: _finite(term.name, k, v, sample_id) for k, v in named.items()}


def _term(i: int, entry: Mapping[str, Any]) -> RewardTerm:
    if isinstance(entry, str):
        entry = {"fn": entry}
    unknown = set(entry) - ENTRY_KEYS
    if unknown or "fn" not in entry:
        problem = f"unknown keys {sorted(unknown)}" if unknown else "no fn"
        raise ValueError(
            f"task.rewards[{i}] ({dict(entry)}) has {problem}; an entry takes {sorted(ENTRY_KEYS)}, "
            "e.g. {fn: 'topp_rl.tasks.rewards:math_answer', weight: 1.0}"
        )
    # A Python callable (topp_rl.fit's reward_fn / rewards, which also names it) is used as given.
    fn = entry["fn"] if callable(entry["fn"]) else resolve_reward_fn(entry["fn"])
    is_batched = entry.get("batched")
    if is_batched is None:  # not said in the config: the function's own @batched mark
        is_batched = getattr(fn, "batched", False)
    if entry.get("kwargs"):
        fn = functools.partial(fn, **dict(entry["kwargs"]))
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise ValueError(f"task.rewards[{i}].weight ({weight!r}) must be a finite number")
    name = str(entry.get("name") or str(entry["fn"]).rpartition(":")[2])
    return RewardTerm(name=name, fn=fn, weight=float(weight), batched=bool(is_batched))


def _call(term: RewardTerm, args: tuple, *, sample_id: int | None = None):
    """term.fn(*args); an exception becomes a RewardError naming the function and the sample (or batch)."""
    try:
        return term.fn(*args)
    except Exception as err:
        response, record = args
        where = (
            f"a batch of {len(response)} samples"
            if sample_id is None
            else f"sample {sample_id} (prompt {record.text!r}, response {response!r})"
        )
        raise RewardError(f"reward function {term.name} raised on {where}: {type(err).__name__}: {err}") from err


def _finite(fn_name: str, key: str, value: Any, sample_id: int) -> float:
    if not isinstance(value, numbers.Real):  # bools count as 1 / 0; numpy scalars are Real too
        raise RewardError(
            f"reward function {fn_name} returned {value!r} ({type(value).__name__}) as {key} for sample "
            f"{sample_id}; return a float or a dict of floats"
        )
    if not math.isfinite(value):
        raise RewardError(f"reward function {fn_name} returned {value} as {key} for sample {sample_id}; rewards must be finite")
    if abs(value) > MAX_ABS_REWARD:
        raise RewardError(
            f"reward function {fn_name} returned {value:g} as {key} for sample {sample_id}; rewards must lie in "
            f"[-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}] (larger values overflow the float32 advantages and the "
            "squared-reward statistics): rescale the reward"
        )
    return float(value)


# Rewards beyond this are a bug or a unit mistake; their squares would overflow float32 statistics.
MAX_ABS_REWARD = 1e6


# ----- math answers (math-verify) -----
def math_answer(response: str, record: "PromptRecord") -> float:
    """1.0 when the response's final answer equals `record.answer` under math-verify, else 0.0."""
    from math_verify import verify

    if record.answer is None:
        raise ValueError("the record has no reference answer; set the task's answer_key to the answer column")
    return float(verify(_gold(record.answer), _parse(_final_part(response))))


_LEADING_NUMBER = re.compile(r"\s*[-+]?\$?\d")


def leading_number(response: str, record: "PromptRecord") -> float:
    """1.0 when the response starts with a number ("14", "14 apples", "-3.5"), else 0.0: a format reward that
    gives a small model asked for a bare number a signal before its answers are right."""
    return float(_LEADING_NUMBER.match(response) is not None)


@functools.lru_cache(maxsize=65536)
def _gold(answer: str):
    text = _final_part(answer)
    parsed = _parse(text)
    if not parsed and _LATEX.search(text):  # bare LaTeX ("x^2+1") parses only between $ signs; prose never
        parsed = _parse(f"${text}$")
    if not parsed:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}; fix the answer column")
    return parsed


_LATEX = re.compile(r"[\\^_{}]")


def _parse(text: str):
    from math_verify import parse

    return parse(text)


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
