"""`DatasetTask`: prompts from a jsonl / json / parquet / csv file or a saved HF dataset directory, through HF
`datasets` (config `task=dataset`, `task=gsm8k`, `task=jsonl`).

- `path`: a file (the loader follows the extension) or a directory written by `save_to_disk` (a `Dataset`, or a
  `DatasetDict` whose split `split` is taken). `split` also takes HF slices: `train[:90%]`, `test[100:]`. A
  relative path is looked up in the working directory, then among the files topp_rl ships
  (`topp_rl.paths.resolve_data_path`), so `task=gsm8k` works from any directory.
- `prompt_key` names the prompt column: strings, or chat conversations (`[{role, content}, ...]`, rendered
  by the tokenizer's chat template: needs `chat_template=true`). `system_prompt` goes first in each
  conversation that has none. `answer_key` (or null) names the reference answer, `record.answer` for the reward.
- Rewards: `reward_fn` ("pkg.mod:fn" or "path/to/file.py:fn") or `rewards` (weighted named terms: functions,
  reward models, reward services; `topp_rl.tasks.rewards.RewardSet`); each term's score is logged as
  `rollout/reward/<name>_mean`.
- `max_prompt_tokens`: prompts whose token count exceeds it are dropped once, with the first tokenizer
  seen (the count is printed and logged as `rollout/filtered_prompts`).
- Order: a fresh permutation per pass over the kept rows, fixed by (seed, epoch), so the data position stays
  one integer and a resumed run draws the same prompts.

Unlike TRL's dataset handling, nothing is coerced: a non-string prompt, a null, a missing column or an empty
file raises a ValueError naming the value and the fix.
"""

from pathlib import Path
from typing import Any

import numpy as np

from topp_rl.data import Messages, PromptRecord, prompt_text
from topp_rl.paths import resolve_data_path
from topp_rl.tasks import splits
from topp_rl.tasks.base import Task
from topp_rl.tasks.rewards import RewardSet, RewardTerm

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetTask(Task):
    log_reward_parts = True

    def __init__(
        self,
        *,
        path: str | Path,
        split: str = "train",
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        reward_fn: str | None = None,
        rewards: list[Any] | None = None,
        max_prompt_tokens: int | None = None,
        shuffle: bool = True,
        cache_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # What `held_out` builds the same task on another split from.
        self.init_args = dict(path=path, split=split, prompt_key=prompt_key, answer_key=answer_key,
                              reward_fn=reward_fn, rewards=rewards, max_prompt_tokens=max_prompt_tokens,
                              shuffle=shuffle, cache_dir=cache_dir, **kwargs)
        if reward_fn is not None and rewards:
            raise ValueError(
                f"set exactly one of task.reward_fn ({reward_fn!r}) and task.rewards ({rewards!r}), not both: "
                "reward_fn=pkg.mod:fn for one function, rewards=[{fn: ..., weight: ...}, ...] for several"
            )
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens ({max_prompt_tokens}) must be >= 1, or null for no limit")
        self.path, self.split = resolve_data_path(path), split
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.max_prompt_tokens, self.shuffle = max_prompt_tokens, shuffle
        # Replaces the base's `reward`. Neither set: the step's environment or agent gives the rewards (a
        # single-turn run is refused at start, `check_reward_config`; a call here raises naming the keys).
        self.reward_set = (RewardSet([RewardTerm(name="reward", fn=unset_reward)]) if reward_fn is None and not rewards
                           else RewardSet.from_config(rewards or [{"fn": reward_fn}]))
        self.reward_name = self.reward_set.name
        self.rows = load_rows(self.path, split, cache_dir=cache_dir)
        self.is_chat = check_prompt_column(self.rows, prompt_key, self.path)
        if self.is_chat and not self.chat_template:
            raise ValueError(
                f"column {prompt_key!r} of {self.path} holds chat conversations; set chat_template=true so the "
                "tokenizer's chat template renders them"
            )
        if answer_key is not None:
            check_answer_column(self.rows, answer_key, self.path)
        self.filtered_prompts = 0
        self._kept: np.ndarray = np.arange(len(self.rows))  # row ids in use (all until filtered)
        self._ids: list[list[int]] | None = None  # their prompt ids when filtering encoded them
        self._tokenizer = None
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def num_examples(self) -> int:
        return len(self._kept)

    def reward(self, response: str, record: PromptRecord) -> float:
        totals, _ = self.reward_set([response], [record], [0])
        return totals[0]

    def stats(self) -> dict[str, float]:
        return {"rollout/filtered_prompts": float(self.filtered_prompts)} if self._tokenizer is not None else {}

    def describe(self) -> str:
        return f"{self.path} [{self.split}]"

    def held_out(self, split: str) -> tuple["DatasetTask", int]:
        """This task (same file, columns, rewards, template, prompt limit) on `split`, refused when it reads a
        row the training split reads: a data file is one split whatever its name, so `eval.split=test` on it would
        score the training rows; slices (`task.split='train[:90%]' eval.split='train[90%:]'`) hold rows out."""
        lengths, one_split = self._split_lengths()
        if one_split:  # every name reads the same rows: give each name the source's row count
            known = f"one of {lengths['']} rows, under any name"
            lengths = dict.fromkeys(splits.split_names(self.split) | splits.split_names(split), lengths[""])
        else:
            known = ", ".join(f"{name} ({n} rows)" for name, n in sorted(lengths.items()))
        where = f"{self.path}" + (" (a one-split source: every split name reads all its rows)" if one_split else "")
        train = splits.row_spans(self.split, lengths, key="task.split", where=where, splits=known)
        held = splits.row_spans(split, lengths, key="eval.split", where=where, splits=known)
        if one_split:
            train, held = ([("", a, b) for _, a, b in spans] for spans in (train, held))
        shared = splits.shared_rows(train, held)
        if shared:
            fix = ("hold rows out with slices of it, e.g. task.split='train[:90%]' eval.split='train[90%:]', or set "
                   "eval.task to a task on a separate test file") if one_split else (
                   f"pick rows the training does not read (splits: {known})")
            raise ValueError(
                f"eval.split={split!r} reads {shared} of the rows task.split={self.split!r} trains on in {where}; "
                f"{fix}"
            )
        return type(self)(**self.init_args | {"split": split}), 0

    def _split_lengths(self) -> tuple[dict[str, int], bool]:
        """({split: rows}, False) for a saved DatasetDict; ({"": rows}, True) for a data file or saved Dataset."""
        if self.path.is_dir():
            import datasets

            saved = datasets.load_from_disk(str(self.path))
            if isinstance(saved, datasets.DatasetDict):
                return {name: len(part) for name, part in saved.items()}, False
            return {"": len(saved)}, True
        base = self.split.partition("[")[0]  # the training load's own name: the datasets cache has it
        rows = self.rows if base == self.split else load_rows(self.path, base, cache_dir=self.init_args["cache_dir"])
        return {"": len(rows)}, True

    # ----- prompts -----
    def prepare(self, tokenizer) -> None:
        """Drop prompts longer than `max_prompt_tokens` tokens (once per tokenizer) and say how many."""
        if tokenizer is self._tokenizer:
            return
        self._order_cache, total = None, len(self.rows)
        if self.max_prompt_tokens is not None:
            ids = [self.encode(p, tokenizer) for p in self.rows[self.prompt_key]]
            lengths = np.array([len(x) for x in ids])
            self._kept = np.flatnonzero(lengths <= self.max_prompt_tokens)
            self._ids = [ids[i] for i in self._kept]
            self.filtered_prompts = total - len(self._kept)
            if not len(self._kept):
                raise ValueError(
                    f"all {total} prompts of {self.path} are longer than max_prompt_tokens={self.max_prompt_tokens} "
                    f"tokens (shortest: {lengths.min()}); raise max_prompt_tokens"
                )
        limit = f", {self.filtered_prompts} longer than max_prompt_tokens={self.max_prompt_tokens} dropped"
        _print_once(
            f"task: {self.path} [{self.split}]: {len(self._kept)} prompts"
            + (limit if self.max_prompt_tokens is not None else "")
        )
        self._tokenizer = tokenizer

    def prompt(self, index: int, tokenizer) -> PromptRecord:
        self.prepare(tokenizer)
        pos = self._position(index)
        prompt, answer, data = self._row(int(self._kept[pos]))
        ids = self._ids[pos] if self._ids is not None else self.encode(prompt, tokenizer)
        return PromptRecord(index=index, text=prompt_text(prompt), prompt_ids=ids, answer=answer, data=data)

    def example(self, index: int) -> tuple[str | Messages, str | None, dict[str, Any]]:
        """The example at data position `index` (over the kept rows once `prepare` ran, else all rows)."""
        return self._row(int(self._kept[self._position(index)]))

    def order(self, epoch: int) -> np.ndarray:
        """Positions of the kept rows in pass `epoch`: a permutation fixed by (seed, epoch), or in file order."""
        n = len(self._kept)
        if not self.shuffle:
            return np.arange(n)
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(n))
        return self._order_cache[1]

    def _position(self, index: int) -> int:
        epoch, pos = divmod(index, len(self._kept))
        return int(self.order(epoch)[pos])

    def _row(self, row_id: int) -> tuple[str | Messages, str | None, dict[str, Any]]:
        row = self.rows[row_id]
        answer = None if self.answer_key is None else row[self.answer_key]
        return row[self.prompt_key], None if answer is None else str(answer), row


class JsonlTask(DatasetTask):
    """The dataset task under its earlier name (`task=jsonl`; same options)."""


# ----- loading and checking -----
def load_rows(path: Path, split: str, *, cache_dir: str | None = None):
    """The `datasets.Dataset` of `split` at `path`; a ValueError when it is missing, of unknown type, or empty."""
    import datasets

    datasets.disable_progress_bars()  # one bar per load in the console scrollback otherwise
    if path.is_dir():
        rows = _saved_split(path, split)
    elif path.is_file():
        rows = _file_split(path, split, cache_dir)
    else:
        raise ValueError(f"dataset path {path} does not exist; pass a data file or a save_to_disk directory")
    if len(rows) == 0:
        raise ValueError(f"{path} [{split}] holds no rows; a dataset task needs at least one prompt")
    return rows


def _file_split(path: Path, split: str, cache_dir: str | None):
    import datasets

    loader = LOADERS.get(path.suffix.lower())
    if loader is None:
        raise ValueError(
            f"dataset file {path} has an unknown extension; use one of {sorted(LOADERS)} or a save_to_disk directory"
        )
    if loader != "parquet" and not _utf8_text(path).strip():  # the json loader raises a bare StopIteration
        raise ValueError(f"{path} is empty; a dataset task needs at least one prompt")
    base = split.partition("[")[0]  # the file is this split; a slice ("train[:90%]") applies to it
    try:
        return datasets.load_dataset(loader, data_files={base: str(path)}, split=split, cache_dir=cache_dir)
    except (ValueError, datasets.exceptions.DatasetGenerationError) as err:
        if "corresponds to no data" in str(err):  # datasets' words for a split with no rows (a header-only csv)
            raise ValueError(f"{path} [{split}] holds no rows; a dataset task needs at least one prompt") from None
        raise ValueError(f"{path} cannot be read as {loader} split {split!r}: {err}") from err


def _utf8_text(path: Path) -> str:
    """The text of a json / csv file; bytes that are not UTF-8 (what `datasets` reads) name their line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(
            f"{path} line {line} is not UTF-8 (byte 0x{data[err.start]:02x} at column {err.start - line_start + 1}: "
            f"{err.reason}); dataset files are read as UTF-8: re-encode the file (e.g. `iconv -f latin1 -t utf-8`)"
        ) from None


def _saved_split(path: Path, split: str):
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise ValueError(f"{path} is not a directory written by save_to_disk ({err})") from err
    # A lone Dataset is the split it was saved as; a DatasetDict offers its split names.
    parts = dict(saved) if isinstance(saved, datasets.DatasetDict) else {split.partition("[")[0]: saved}
    try:
        spans = datasets.ReadInstruction.from_spec(split).to_absolute({k: len(v) for k, v in parts.items()})
    except (ValueError, AssertionError) as err:
        raise ValueError(
            f"split {split!r} is not in {path} (splits: {sorted(parts)}); set task.split to one of them ({err})"
        ) from err
    pieces = [parts[s.splitname].select(range(s.from_, s.to)) for s in spans]
    return pieces[0] if len(pieces) == 1 else datasets.concatenate_datasets(pieces)


def check_prompt_column(rows, key: str, path: Path) -> bool:
    """True for a chat column, False for a text column; a ValueError naming the first bad row otherwise."""
    if key not in rows.column_names:
        raise ValueError(_missing(key, rows, path, "prompt_key", "the prompt (or chat messages) column"))
    import pyarrow.compute as pc

    column = rows.data.column(key)
    kind = _column_kind(column.type)
    if kind is None:  # another type, or mixed types (a Json column): name the first row that is no prompt
        bad, value = next((i, v) for i, v in enumerate(rows[key]) if not _is_prompt(v))
        if not value:
            raise ValueError(f"prompt {bad} of {path} ({key!r}) is null or empty; every row needs a prompt")
        what = (
            "a list but no chat conversation (each message needs a string 'role' and 'content')"
            if isinstance(value, list)
            else f"a {type(value).__name__}, not a string"
        )
        raise ValueError(
            f"prompt {bad} of {path} ({key!r}: {value!r}) is {what}; prompts must be strings or chat message "
            "lists [{role, content}]: fix the data or set prompt_key to the text column"
        )
    nulls = pc.is_null(column)
    if kind == "chat":
        messages = pc.list_flatten(column)
        nulls = pc.or_(nulls, pc.fill_null(pc.equal(pc.list_value_length(column), 0), True))  # [] or null
        if pc.any(pc.is_null(messages)).as_py() or any(
            pc.any(pc.is_null(pc.struct_field(messages, f))).as_py() for f in ("role", "content")
        ):
            raise ValueError(f"a conversation in column {key!r} of {path} has a null message, role or content")
    else:  # an empty string is no prompt, as an empty csv cell (read as null) is none
        nulls = pc.or_(nulls, pc.fill_null(pc.equal(pc.utf8_length(column), 0), True))
    if pc.any(nulls).as_py():
        bad = int(pc.index(nulls, True).as_py())
        raise ValueError(f"prompt {bad} of {path} ({key!r}) is null or empty; every row needs a prompt")
    return kind == "chat"


def check_answer_column(rows, key: str, path: Path) -> None:
    """Every row has a reference answer: a null (or, in jsonl, a row without the key) would reach the reward
    as None, and a csv column with an empty cell is read as floats ("1" -> "1.0")."""
    if key not in rows.column_names:
        raise ValueError(_missing(key, rows, path, "answer_key", "or answer_key=null"))
    import pyarrow.compute as pc

    nulls = pc.is_null(rows.data.column(key))
    if pc.any(nulls).as_py():
        bad = int(pc.index(nulls, True).as_py())
        raise ValueError(
            f"answer {bad} of {path} ({key!r}) is null or missing; every row needs a reference answer for the "
            "reward (record.answer): fix the data, or set task.answer_key=null if the rewards use none"
        )


def _column_kind(arrow_type) -> str | None:
    import pyarrow as pa

    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "text"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        item = arrow_type.value_type
        if pa.types.is_struct(item) and {"role", "content"} <= {f.name for f in item}:
            if all(pa.types.is_string(item.field(f).type) for f in ("role", "content")):
                return "chat"
    return None


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def _missing(key: str, rows, path: Path, option: str, fix: str) -> str:
    return (
        f"{path} has no column {key!r}; its columns are {rows.column_names}: set task.{option} to one of them ({fix})"
    )


def _print_once(message: str) -> None:
    from lightning_utilities.core.rank_zero import rank_zero_only

    # Lightning sets `rank_zero_only.rank` when it starts; before that (tests, scripts) this is the only process.
    if getattr(rank_zero_only, "rank", 0) == 0:
        print(f"[topp_rl] {message}", flush=True)


def unset_reward(response: str, record: PromptRecord) -> float:
    """The reward of a dataset task with neither `reward_fn` nor `rewards`: for the multi-turn steps, whose
    environment or agent gives the reward; a step that calls the task's reward gets this error."""
    raise ValueError("task.reward_fn and task.rewards are unset, and this rollout step scores responses with the "
                     "task's reward; set task.reward_fn=pkg.mod:fn (or path/to/file.py:fn), or use a multi-turn step "
                     "whose environment or agent gives the reward (rollout/step=agent, task=agent)")
