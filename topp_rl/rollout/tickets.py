"""Rollout tickets: what the dataloader yields, one per step (its index, this DP rank's prompt records, a
generation seed), cheap to make because Lightning fetches one batch ahead; the datamodule turns the current one
into a `RolloutBatch` right before `training_step`.

Data parallel: `prompts_per_step` counts prompts per step over ALL DP ranks; DP rank r takes the r-th slice of
each step's prompts (example indices are consecutive: step k uses [k * P, (k + 1) * P), shifted by the prompts
refill rounds drew before it, `offset`). Prompts and seeds are functions of (seed, step, DP rank, offset), so a
resumed run continues identically. A refill round (`data.refill`, `topp_rl.rollout.refill`) takes the next prompts
of the stream after its step's: `refill_ticket`.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from torch.utils.data import IterableDataset

from topp_rl.data import PromptRecord
from topp_rl.data.prompt import check_encodable
from topp_rl.tasks import Task


@dataclass(frozen=True, kw_only=True)
class RolloutTicket:
    step: int
    records: list[PromptRecord]  # this DP rank's prompts
    first_group: int  # global index of records[0] within the step
    seed: int  # generation seed of this (step, DP rank)


def local_prompt_count(prompts_per_step: int, dp_size: int) -> int:
    if prompts_per_step % dp_size:
        raise ValueError(
            f"prompts_per_step ({prompts_per_step}) is not divisible by the data-parallel size ({dp_size}); make "
            "it a multiple so every DP rank gets the same number of prompts"
        )
    return prompts_per_step // dp_size


def make_ticket(task: Task, tokenizer: Any, *, step: int, prompts_per_step: int, dp_rank: int, dp_size: int,
                seed: int, offset: int = 0) -> RolloutTicket:
    """Step `step`'s ticket for `dp_rank`; `offset`: the prompts refill rounds drew before this step."""
    local = local_prompt_count(prompts_per_step, dp_size)
    first = dp_rank * local
    return RolloutTicket(step=step, records=_records(task, tokenizer, step * prompts_per_step + offset + first, local),
                         first_group=first, seed=_seed(seed, step, dp_rank))


def refill_ticket(task: Task, tokenizer: Any, *, step: int, number: int, start: int, first_group: int,
                  sizes: list[int], dp_rank: int, seed: int) -> RolloutTicket:
    """Refill round `number` (1, 2, ...) of step `step`: DP rank r draws `sizes[r]` prompts; the round's prompts
    are data positions [start, start + sum(sizes)), rank-major, and its prompt groups are numbered on from
    `first_group` (step-global, after every group the step generated before)."""
    before = sum(sizes[:dp_rank])
    return RolloutTicket(step=step, records=_records(task, tokenizer, start + before, sizes[dp_rank]),
                         first_group=first_group + before, seed=_seed(seed, step, dp_rank, number))


def _records(task: Task, tokenizer: Any, start: int, count: int) -> list[PromptRecord]:
    records = [task.prompt(start + i, tokenizer) for i in range(count)]
    for record in records:
        check_encodable(record, tokenizer)
    return records


def _seed(*key: int) -> int:
    return int(np.random.SeedSequence(list(key)).generate_state(1)[0])


class TicketSource(Protocol):
    step: int  # the next step to generate

    def ticket(self, step: int) -> RolloutTicket: ...


class TicketStream(IterableDataset):
    def __init__(self, source: TicketSource) -> None:
        self.source = source

    def __iter__(self) -> Iterator[RolloutTicket]:
        step = self.source.step  # read when iteration starts: after a checkpoint restore
        while True:
            yield self.source.ticket(step)
            step += 1
