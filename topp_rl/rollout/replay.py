"""`rollout=replay rollout.path=DIR`: train on a recording (`topp_rl.rollout.record`) with no engine.

The datamodule runs every step as it does with an engine, except generation: `RolloutDataModule._sample` asks a
`ReplaysRollouts` engine for the recorded samples of the call (looked up by its generation seed, which is a
function of the seed, the step, the data-parallel rank and the refill round, and checked against the call's
prompts), then scores them with the task, computes advantages, drops zero-variance groups, refills and packs as
the recording run did. With the same initial weights (the same seed and model) every batch, loss and gradient
equals the recording run's. Rewards are recomputed by the task (the recorded ones stay in the files for reading):
a replay may change the algorithm and its advantage, not what the samples are.

What a replay cannot do is refused at start (`topp_rl.config.validate_replay`): another policy's tokenizer,
vocabulary or family, more steps than recorded, settings that draw other prompts, rollouts ahead, evaluation
(it needs an engine that generates).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample
from topp_rl.engines.base import RolloutEngine
from topp_rl.rollout.record import Manifest, read_call, read_header, step_files
from topp_rl.rollout.tickets import RolloutTicket


@runtime_checkable
class ReplaysRollouts(Protocol):
    """An engine that hands back recorded samples instead of generating (`rollout=replay`)."""

    def replay(self, ticket: RolloutTicket) -> list[Sample]: ...


class ReplayEngine(RolloutEngine):
    """The recorded samples of `path`, per generation call; weight pushes are accepted and ignored."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.manifest = Manifest.read(self.path)
        self.vocab_size = self.manifest.identity.vocab_size
        self._calls = recorded_calls(self.path)

    @classmethod
    def for_policy(cls, *, model: Any = None, tokenizer: Any = None, workdir: Path | None = None,
                   path: str) -> ReplayEngine:
        """The engine factory's signature (`topp_rl.train.engine_for`); the policy was checked against the
        recording at start."""
        return cls(path)

    def replay(self, ticket: RolloutTicket) -> list[Sample]:
        found = self._calls.get((ticket.step, ticket.seed))
        if found is None:
            steps = sorted({step for step, _ in self._calls})
            raise ValueError(
                f"rollout.path={str(self.path)!r}: no recorded generation for step {ticket.step} with seed "
                f"{ticket.seed} (this rank's); it holds steps {steps[0]}..{steps[-1]} recorded at data-parallel size "
                f"{self.manifest.dp_size}; replay with the recording's seed, data-parallel size and data.refill "
                "settings" if steps else f"rollout.path={str(self.path)!r} holds no step files")
        samples, prompts = read_call(found)
        mine = [r.prompt_ids for r in ticket.records]
        if prompts != mine:
            raise ValueError(f"{found}: recorded for other prompts than this run's step {ticket.step} draws "
                             f"({len(prompts)} recorded, {len(mine)} here, first differing at "
                             f"{_first_difference(prompts, mine)}); replay with the recording's task, seed, "
                             f"rollout.prompts_per_step and data-parallel size ({self.manifest.dp_size})")
        return samples

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None) -> list[Sample]:
        raise RuntimeError("rollout=replay does not generate: it hands back recorded samples (`replay`); evaluation "
                           "and other callers that generate need an engine (rollout=embedded or rollout=sglang)")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in named_tensors:  # walk the export: under model parallelism it is a collective
            pass

    def close(self) -> None:
        pass


def recorded_calls(path: Path) -> dict[tuple[int, int], Path]:
    """(step, generation seed) -> the step file of that call."""
    calls = {}
    for file in step_files(path):
        header = read_header(file)
        calls[(int(header["step"]), int(header["seed"]))] = file
    return calls


def recorded_steps(path: Path) -> int:
    """How many steps the recording at `path` holds for every data-parallel rank: steps 0..n-1 all present."""
    manifest = Manifest.read(path)
    present: dict[int, set[int]] = {}
    for file in step_files(path):
        header = read_header(file)
        if int(header["round"]) == 0:
            present.setdefault(int(header["step"]), set()).add(int(header["dp_rank"]))
    n = 0
    while present.get(n) == set(range(manifest.dp_size)):
        n += 1
    return n


def _first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"prompt {i}"
    return f"prompt {min(len(a), len(b))}"
