"""Which examples an evaluation reads: `eval.task` as given, or the training task's own held-out split
(`eval.split`, through `Task.held_out`), and the row arithmetic that keeps a dataset's held-out rows apart from
its training rows.

Split specs are HF `datasets` split strings (`test`, `train[:90%]`, `train[:100]+train[200:]`). A data file or a
saved `Dataset` holds one split whatever its name (the dataset task reads the file as the split it is asked
for), so two specs on it address the same rows; a saved `DatasetDict` has a row range per split name.
"""

from dataclasses import dataclass

from topp_rl.tasks.base import HELD_OUT_OFFSET, Task

Span = tuple[str, int, int]  # (split name, first row, row past the last); the name is "" on a one-split source


@dataclass(frozen=True)
class EvalExamples:
    """The task an evaluation scores and the index of its first example (`task.prompt(first_index + i)`)."""

    task: Task
    first_index: int

    @property
    def label(self) -> str:
        """What the console and summary.json call the evaluated examples."""
        held_out = " test (indices from 10**9)" if self.first_index == HELD_OUT_OFFSET else ""
        return self.task.describe() + held_out


def eval_examples(training: Task, *, split: str | None, task: Task | None) -> EvalExamples:
    """`eval.task` when set, else the training task's split `eval.split`, else (neither set) a generated training
    task's held-out examples; a ValueError naming the keys when the choice is ambiguous or the task has none."""
    if task is not None and split is not None:
        raise ValueError(
            f"eval.split={split!r} and eval.task ({type(task).__name__}) are both set; set eval.split to evaluate "
            "the training task on another split, or eval.task for another task, not both"
        )
    if task is not None:
        return EvalExamples(task, 0)
    if split is None and training.num_examples is not None:
        raise ValueError(
            f"eval: the training task {type(training).__name__} has a finite dataset, so its examples are not held "
            "out; set eval.split to a split it does not train on (eval.split=test, or a slice such as "
            "eval.split='train[90%:]' with task.split='train[:90%]'), or set eval.task"
        )
    return EvalExamples(*training.held_out(split or "test"))


def split_names(spec: str) -> set[str]:
    """The split names a spec reads: {"train"} for `train[:90%]+train[95%:]`."""
    return {part.strip().partition("[")[0] for part in spec.split("+")}


def row_spans(spec: str, lengths: dict[str, int], *, key: str, where: str, splits: str) -> list[Span]:
    """The absolute row ranges `spec` reads, given each split's row count; a ValueError naming `key` (the config
    key that holds the spec) and `splits` (the splits there are) when it names another split or is malformed."""
    import datasets

    try:
        spans = datasets.ReadInstruction.from_spec(spec).to_absolute(lengths)
    except (ValueError, AssertionError) as err:
        raise ValueError(
            f"{key}={spec!r} is not a split of {where} (splits: {splits}); set {key} to one of them or a slice of "
            f"one, e.g. 'train[90%:]' ({err})"
        ) from err
    return [(s.splitname, s.from_, s.to) for s in spans]


def shared_rows(a: list[Span], b: list[Span]) -> int:
    """Rows that both span lists read."""
    return sum(max(0, min(to_a, to_b) - max(from_a, from_b))
               for name_a, from_a, to_a in a for name_b, from_b, to_b in b if name_a == name_b)
