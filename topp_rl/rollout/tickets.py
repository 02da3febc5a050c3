"""Rollout tickets: what the dataloader yields, one per step (its index, this DP rank's prompt records, a
generation seed), cheap to make because Lightning fetches one batch ahead; the datamodule turns the current one
into a `RolloutBatch` right before `training_step`.

Data parallel: `prompts_per_step` counts prompts per step over ALL DP ranks; DP rank r takes the r-th slice of
each step's prompts (example indices are consecutive: step k uses [k * P, (k + 1) * P)). Prompts and seeds are
functions of (seed, step, DP rank), so a resumed run continues identically.
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
                seed: int) -> RolloutTicket:
    local = local_prompt_count(prompts_per_step, dp_size)
    first = dp_rank * local
    start = step * prompts_per_step + first
    records = [task.prompt(start + i, tokenizer) for i in range(local)]
    for record in records:
        check_encodable(record, tokenizer)
    generation_seed = int(np.random.SeedSequence([seed, step, dp_rank]).generate_state(1)[0])
    return RolloutTicket(step=step, records=records, first_group=first, seed=generation_seed)


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
