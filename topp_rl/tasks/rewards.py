"""Reward sets: weighted named reward terms (config `task.rewards`, or `task.reward_fn` for one function).

A term is one of:
- a function `fn(response: str, record: PromptRecord) -> value`, named `pkg.mod:fn` or `path/to/file.py:fn`
  (`topp_rl.tasks.reward_import`), or passed as a Python callable. `record.answer` is the reference answer,
  `record.data` the whole dataset row, `record.text` the prompt. Marked batched (the `@batched` decorator, or
  `batched: true` in its entry) it is called once per rollout step as `fn(responses, records)` and returns one
  value per response.
- an object that `ScoresBatches`, built from a `_target_` entry: a reward model
  (`topp_rl.tasks.reward_model.RewardModel`) or a reward service (`topp_rl.tasks.reward_service.RewardService`).

Entries: `"pkg.mod:fn"`, `{fn, weight, name, batched, kwargs, terms}` (`fn` may also be a `_target_` node), or a
bare `{_target_: ..., <its arguments>}` (weight 1, the object's own name).

Values: a float, or a dict with a `score` key (verl's form). The score is the term's value; a dict's other
entries are logged, never summed, unless the entry declares them as weighted terms (`terms: {key: weight}`):
    reward = sum_i weight_i * score_i + sum_i sum_k terms_i[k] * value_i[k]
Anything else (a string, None, a list, a dict without `score`) is a `RewardError` naming the function and the
sample. Each term's unweighted score goes to `sample.metadata["rewards"][name]` and each other dict entry to
`"<name>/<key>"`; `RolloutStats` logs them as `rollout/reward/<name>_mean` and `rollout/reward/<name>/<key>_mean`.

Concurrency: terms that score asynchronously (`ScoresAsync`: the reward service, whose requests wait on the
network) are started first and run on their own threads while the other terms run on the caller's thread
(math-verify's timeouts use signals, which work only there). A reward model runs on the caller's thread: on the
trainer's device its forward would only compete with the trainer's own work.
"""

import functools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from topp_rl.tasks.checkers import (  # noqa: F401  (configs name them as topp_rl.tasks.rewards:<fn>)
    countdown_expression,
    countdown_score,
    leading_number,
    math_answer,
)
from topp_rl.tasks.reward_import import check_reward_config, resolve_reward_fn  # noqa: F401

if TYPE_CHECKING:
    import torch

    from topp_rl.data import PromptRecord

RewardValue = float | Mapping[str, float]
SCORE_KEY = "score"
ENTRY_KEYS = {"fn", "weight", "name", "batched", "kwargs", "terms"}
# Rewards beyond this are a bug or a unit mistake; their squares would overflow float32 statistics.
MAX_ABS_REWARD = 1e6


class RewardError(RuntimeError):
    """A reward function raised or returned a bad value; the message names the sample and the function."""


@runtime_checkable
class ScoresBatches(Protocol):
    """A reward term backed by a model or a service: one call scores a whole batch."""

    name: str  # the term's name unless its entry gives one

    def __call__(self, responses: list[str], records: list["PromptRecord"]) -> list[RewardValue]: ...


@runtime_checkable
class ScoresAsync(Protocol):
    """A batch term that can start scoring and return at once (its work waits on I/O, not on this process)."""

    def submit(self, responses: list[str], records: list["PromptRecord"]) -> Future: ...


@runtime_checkable
class OnDevice(Protocol):
    """A term that computes on a torch device: the trainer's, handed over at setup."""

    def to_device(self, device: "torch.device") -> None: ...


def batched(fn: Callable) -> Callable:
    """Mark `fn(responses, records) -> list[value]` as batched: called once per step, not once per sample."""
    fn.batched = True
    return fn


@dataclass(frozen=True, kw_only=True)
class RewardTerm:
    name: str
    fn: Callable
    weight: float = 1.0
    batched: bool = False
    terms: Mapping[str, float] = field(default_factory=dict)  # dict entries summed with these weights


class RewardSet:
    """Weighted named reward terms; `__call__` scores a batch and checks every value."""

    def __init__(self, terms: Sequence[RewardTerm]) -> None:
        if not terms:
            raise ValueError("a reward set needs at least one function; set task.rewards or task.reward_fn")
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names {names} repeat; give each task.rewards entry its own name")
        self.terms = list(terms)
        self._keys: dict[str, tuple[str, ...] | None] = {}  # per function: dict keys fixed by the first call

    @classmethod
    def from_config(cls, entries: Sequence[Any]) -> "RewardSet":
        """Entries `"pkg.mod:fn"`, `{fn, weight, name, batched, kwargs, terms}`, `{_target_: ...}` or objects."""
        return cls([_term(i, entry) for i, entry in enumerate(entries)])

    @property
    def name(self) -> str:
        return " + ".join(f"{t.weight:g}*{t.name}" for t in self.terms)

    def to_device(self, device: "torch.device") -> None:
        """Hand the trainer's device to the terms that compute on one (a reward model)."""
        for term in self.terms:
            if isinstance(term.fn, OnDevice):
                term.fn.to_device(device)

    def __call__(
        self, responses: list[str], records: list["PromptRecord"], sample_ids: list[int]
    ) -> tuple[list[float], list[dict[str, float]]]:
        """(weighted total per response, unweighted named values per response)."""
        started = {t.name: t.fn.submit(responses, records) for t in self.terms if isinstance(t.fn, ScoresAsync)}
        values = {t.name: self._values(t, responses, records, sample_ids) for t in self.terms if t.name not in started}
        for term in self.terms:
            if term.name in started:
                values[term.name] = _batch_result(term, _result(term, started[term.name], len(responses)),
                                                  len(responses))
        totals = [0.0] * len(responses)
        parts: list[dict[str, float]] = [{} for _ in responses]
        for term in self.terms:
            for i, value in enumerate(values[term.name]):
                contribution, named = self._named(term, value, sample_ids[i])
                parts[i].update(named)
                totals[i] += contribution
        return totals, parts

    def _values(self, term: RewardTerm, responses, records, sample_ids) -> list[RewardValue]:
        if term.batched:
            return _batch_result(term, _call(term, (responses, records)), len(responses))
        return [
            _call(term, (resp, rec), sample_id=sid)
            for resp, rec, sid in zip(responses, records, sample_ids, strict=True)
        ]

    def _named(self, term: RewardTerm, value: Any, sample_id: int) -> tuple[float, dict[str, float]]:
        """(the term's weighted contribution to the reward, its logged values) for one returned value."""
        if isinstance(value, Mapping):
            if SCORE_KEY not in value:
                raise RewardError(
                    f"reward function {term.name} returned a dict without a {SCORE_KEY!r} key (keys "
                    f"{sorted(map(str, value))}) for sample {sample_id}; return {{'score': reward, ...}}: the score "
                    "is the reward, the other entries are logged (and summed only when declared in the entry's terms)"
                )
            score = value[SCORE_KEY]
            extra = {str(k): v for k, v in value.items() if k != SCORE_KEY}
            keys: tuple[str, ...] | None = tuple(sorted(map(str, value)))
        elif isinstance(value, numbers.Real):  # bools count as 1 / 0; numpy scalars are Real too
            score, extra, keys = value, {}, None
        else:
            raise RewardError(
                f"reward function {term.name} returned {value!r:.80} ({type(value).__name__}) for sample "
                f"{sample_id}; return a float, or a dict with a {SCORE_KEY!r} key"
            )
        # Every step (and every rank) must log the same names, so a function's dict keys may not change.
        expected = self._keys.setdefault(term.name, keys)
        if keys != expected:
            raise RewardError(
                f"reward function {term.name} returned keys {keys} for sample {sample_id}, earlier {expected}; "
                "return the same (float or dict) shape every time"
            )
        missing = sorted(set(term.terms) - set(extra))
        if missing:
            raise RewardError(
                f"reward function {term.name} returned {value!r:.80} for sample {sample_id}, without the entries "
                f"{missing} its terms declare; return a dict holding them, or drop them from the entry's terms"
            )
        label = term.name if keys is None else repr(SCORE_KEY)
        named = {term.name: _finite(term.name, label, score, sample_id)}
        named |= {f"{term.name}/{k}": _finite(term.name, repr(k), v, sample_id) for k, v in extra.items()}
        contribution = term.weight * named[term.name]
        contribution += sum(w * named[f"{term.name}/{k}"] for k, w in term.terms.items())
        return contribution, named


def _term(i: int, entry: Any) -> RewardTerm:
    if isinstance(entry, str) or callable(entry) or (isinstance(entry, Mapping) and "_target_" in entry):
        entry = {"fn": entry}  # a name, a callable (a function, a built reward model) or a node to build
    if not isinstance(entry, Mapping):
        raise ValueError(
            f"task.rewards[{i}] ({entry!r:.80}) must be 'pkg.mod:fn', a callable, {{fn: ..., weight: ...}} or "
            "{_target_: ..., ...}"
        )
    unknown = set(entry) - ENTRY_KEYS
    if unknown or "fn" not in entry:
        problem = f"unknown keys {sorted(unknown)}" if unknown else "no fn"
        raise ValueError(
            f"task.rewards[{i}] ({dict(entry)}) has {problem}; an entry takes {sorted(ENTRY_KEYS)}, "
            "e.g. {fn: 'topp_rl.tasks.rewards:math_answer', weight: 1.0}, or is a {_target_: ...} node"
        )
    fn = _callable(i, entry["fn"])
    weight = entry.get("weight", 1.0)
    if not _is_number(weight):
        raise ValueError(f"task.rewards[{i}].weight ({weight!r}) must be a finite number")
    terms = dict(entry.get("terms") or {})
    bad = {k: w for k, w in terms.items() if k == SCORE_KEY or not _is_number(w)}
    if bad:
        raise ValueError(
            f"task.rewards[{i}].terms ({bad}) must map dict keys other than {SCORE_KEY!r} to finite weights, e.g. "
            f"terms: {{length: -0.01}} (the score is weighted by the entry's weight)"
        )
    if isinstance(fn, ScoresBatches):
        if entry.get("kwargs") or entry.get("batched") is False:
            raise ValueError(
                f"task.rewards[{i}]: {type(fn).__name__} scores whole batches and takes its settings in its "
                "_target_ node; drop kwargs and batched from the entry"
            )
        is_batched, default_name = True, fn.name
    else:
        is_batched = entry.get("batched")
        if is_batched is None:  # not said in the config: the function's own @batched mark
            is_batched = getattr(fn, "batched", False)
        if entry.get("kwargs"):
            fn = functools.partial(fn, **dict(entry["kwargs"]))
        spec = entry["fn"]
        default_name = str(spec).rpartition(":")[2] if isinstance(spec, str) else getattr(spec, "__name__", "reward")
    name = str(entry.get("name") or default_name)
    return RewardTerm(name=name, fn=fn, weight=float(weight), batched=bool(is_batched),
                      terms={str(k): float(w) for k, w in terms.items()})


def _callable(i: int, fn: Any) -> Callable:
    """An entry's `fn`: a name to resolve, a `_target_` node to build, or a callable as it is."""
    if isinstance(fn, str):
        return resolve_reward_fn(fn)
    if isinstance(fn, Mapping) and "_target_" in fn:
        from hydra.utils import instantiate

        return instantiate(fn)
    if callable(fn):
        return fn
    raise ValueError(f"task.rewards[{i}].fn ({fn!r:.80}) must be 'pkg.mod:fn', a {{_target_: ...}} node or a callable")


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _batch_result(term: RewardTerm, values: Any, count: int) -> list[RewardValue]:
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != count:
        got = len(values) if isinstance(values, Sequence) else type(values).__name__
        raise RewardError(
            f"batched reward function {term.name} returned {got} values for {count} responses; "
            "return a list with one value per response"
        )
    return list(values)


def _call(term: RewardTerm, args: tuple, *, sample_id: int | None = None):
    """term.fn(*args); an exception becomes a RewardError naming the function and the sample (or batch)."""
    try:
        return term.fn(*args)
    except RewardError:
        raise
    except Exception as err:
        response, record = args
        where = (
            f"a batch of {len(response)} samples"
            if sample_id is None
            else f"sample {sample_id} (prompt {record.text!r}, response {response!r})"
        )
        raise RewardError(f"reward function {term.name} raised on {where}: {type(err).__name__}: {err}") from err


def _result(term: RewardTerm, future: Future, count: int):
    try:
        return future.result()
    except RewardError:
        raise
    except Exception as err:
        raise RewardError(
            f"reward {term.name} raised on a batch of {count} samples: {type(err).__name__}: {err}"
        ) from err


def reward_number(value: Any) -> float:
    """`value` as a reward: a real number (a bool counts as 0 or 1), finite, within +-`MAX_ABS_REWARD`. Every
    reward passes here (a task's reward functions, an episode's reward, an agent's return value); ValueError
    saying which rule `value` breaks otherwise (the caller names where it came from)."""
    if not isinstance(value, numbers.Real):
        raise ValueError(f"a reward must be a number, not a {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError("rewards must be finite")
    if abs(value) > MAX_ABS_REWARD:
        raise ValueError(f"rewards must lie in [-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}] (larger values overflow the "
                         "float32 advantages and the squared-reward statistics): rescale the reward")
    return float(value)


def shown_reward(value: Any) -> str:
    """A reward value in a message: a number as `:g` (nan, inf, 1e+300), anything else as its repr and type."""
    return f"{float(value):g}" if isinstance(value, numbers.Real) else f"{value!r:.80} ({type(value).__name__})"


def _finite(fn_name: str, key: str, value: Any, sample_id: int) -> float:
    try:
        return reward_number(value)
    except ValueError as err:
        fix = (f"return a float, or a dict of floats with a {SCORE_KEY!r} key" if not isinstance(value, numbers.Real)
               else str(err))
        raise RewardError(f"reward function {fn_name} returned {shown_reward(value)} as {key} for sample "
                          f"{sample_id}; {fix}") from None
