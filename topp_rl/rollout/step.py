"""One rollout step, prompts -> scored samples, shared by training (`RolloutDataModule`) and evaluation
(`topp_rl.callbacks.evaluation`): the `RolloutStep` protocol and its first implementation, `SingleTurnStep`.

A step has two phases, because with `rollout.overlap=true` the first runs ahead on the prefetch thread:
- `generate`: engine work only (and, for a multi-turn agent loop, the environment between turns): n samples
  per prompt, prompt-major, unscored;
- `score`: on the trainer's thread (rewards may use signals or a reward model on the trainer's device): number
  the samples step-globally and set the reward of every sample the engine did not abort.
`run` does both, timing the first; `check` (every rank, after the samples were shared) may stop the run; `stats` gives the step's own rollout figures (sums and counts). Config:
`rollout.step` (the `rollout/step` group: `single_turn`, the default, or `agent`:
`topp_rl.rollout.agent_step.AgentLoopStep`, the multi-turn agent loop), handed to the datamodule as
`data.rollout_step`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from topp_rl.data import PromptRecord, SamplingParams
from topp_rl.data.sample import Sample, SampleStatus, number_samples
from topp_rl.engines.base import RolloutEngine
from topp_rl.tasks import Task

Stats = dict[str, tuple[float, float]]


@dataclass(frozen=True)
class StepResult:
    samples: list[Sample]  # numbered, scored; aborted ones kept (unscored) for the stats
    generate_s: float  # time `generate` took


@runtime_checkable
class RolloutStep(Protocol):
    def generate(self, engine: RolloutEngine, records: list[PromptRecord], params: SamplingParams, *,
                 seed: int | None, tokenizer: Any) -> list[Sample]:
        """`params.n` samples per record, prompt-major, unscored; may run on the prefetch thread (`tokenizer`:
        the policy's, for steps that turn text into ids between turns)."""
        ...

    def score(self, samples: list[Sample], records: list[PromptRecord], params: SamplingParams, *, task: Task,
              tokenizer: Any, first_group: int = 0) -> list[Sample]:
        """Number `samples` in place (records[0] is prompt group `first_group` of the step) and score the live
        ones with `task`; returns `samples`."""
        ...

    def run(self, engine: RolloutEngine, records: list[PromptRecord], params: SamplingParams, *, task: Task,
            tokenizer: Any, seed: int | None, first_group: int = 0) -> StepResult:
        """`generate` then `score` (a default for explicit subclasses)."""
        start = time.perf_counter()
        samples = self.generate(engine, records, params, seed=seed, tokenizer=tokenizer)
        seconds = time.perf_counter() - start
        self.score(samples, records, params, task=task, tokenizer=tokenizer, first_group=first_group)
        return StepResult(samples=samples, generate_s=seconds)

    def check(self, samples: list[Sample], *, reduce_sum: Any = None) -> None:
        """Raise if the step must stop (a default for explicit subclasses: never). Called on every rank once the
        samples reached it, with `reduce_sum` summing a tensor over the DP ranks, so all ranks raise alike."""

    def stats(self, samples: list[Sample]) -> Stats:
        """The step's own rollout figures as (sum, count) pairs, the same keys on every rank and every step
        (`samples`: the scored ones of this rank, aborted ones included)."""
        ...


class SingleTurnStep(RolloutStep):
    """One engine call per step: each prompt answered once, n times."""

    def generate(self, engine: RolloutEngine, records: list[PromptRecord], params: SamplingParams, *,
                 seed: int | None, tokenizer: Any = None) -> list[Sample]:
        return engine.generate([r.prompt_ids for r in records], params, seed=seed)

    def score(self, samples: list[Sample], records: list[PromptRecord], params: SamplingParams, *, task: Task,
              tokenizer: Any, first_group: int = 0) -> list[Sample]:
        number_samples(samples, prompts=len(records), n=params.n, first_group=first_group)
        by_group = {first_group + j: r for j, r in enumerate(records)}
        task.score([s for s in samples if s.status != SampleStatus.ABORTED], by_group, tokenizer)
        return samples

    def stats(self, samples: list[Sample]) -> Stats:
        return {}
