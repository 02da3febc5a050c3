"""The `RolloutEngine` protocol every backend implements (`EmbeddedEngine`, `SGLangEngine`).

Contract (docs/ARCHITECTURE.md; `tests/test_engine_contract.py` checks it for every engine): `generate` returns
`params.n` samples per prompt, prompt-major (the pipeline numbers them: `topp_rl.data.number_samples`), each
sampled token in its recorded kept set and its log-prob renormalised over that set; `update_weights` takes HF
parameter names; engines are context managers that `close()` on exit (idempotent).

What an engine can do is asked of its capabilities below, never of its class: wrappers (`VersionedEngine`,
`SharedWorkersEngine`) answer for the engine they wrap.
"""

import contextlib
from collections.abc import Iterable
from typing import Any, Protocol, Self, runtime_checkable

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample


@runtime_checkable
class RolloutEngine(Protocol):
    vocab_size: int
    # ---- capabilities (class-level defaults; an engine overrides them, per instance where config decides) ----
    # Samples with the trainer's own module (one copy of the weights): `update_weights` has nothing to copy, the
    # engine cannot generate while the trainer updates (no `rollout.overlap`), and a sharded trainer (FSDP) hands
    # it its gather with `sample_sharded(gathered)`. The embedded engine with share_weights=true.
    shares_trainer_weights: bool = False
    # The engine reaches workers that every data-parallel rank of the job reaches too (servers given by URL, a
    # running router): one rank pushes the weights for all (`topp_rl.engines.shared.SharedWorkersEngine`).
    shared_by_ranks: bool = False
    # The largest kept set the engine records; a sample whose set outgrows it is aborted and flagged
    # `candidate_overflow`, never cut. None: sets of any size (the embedded engine).
    max_candidates: int | None = None
    # Samples carry `Sample.routes` (the experts every MoE layer picked per token) for an MoE policy.
    records_routes: bool = False
    # The model's context in tokens (prompt + response of one call); None: not known. A multi-turn step ends a
    # trajectory that has no room left for a turn (`topp_rl.rollout.trajectory.room_for_turn`).
    max_context: int | None = None
    # Decode work so far, for the mean decode batch (`perf/decode_batch_mean`): an object whose `rows` (responses
    # that sampled a token) and `steps` (decode steps) only grow; None: the engine does not count (a server).
    decode_counts: Any = None

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None
    ) -> list[Sample]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def close(self) -> None: ...

    def holding_weights(self) -> contextlib.AbstractContextManager:
        """A block of several `generate` calls (the agent loop's turns of one step), entered by every data-parallel
        rank together: an engine whose `generate` is a collective (the FSDP-sharded shared module, gathered per
        call) gathers once for the whole block, so the ranks' calls inside it need not match in number. Default
        (explicit subclasses): nothing to hold."""
        return contextlib.nullcontext()

    # Default context-manager behaviour for engines that subclass the protocol explicitly.
    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@runtime_checkable
class InFlightUpdates(Protocol):
    """An engine whose weight updates land while it generates (partial rollouts, `rollout.partial_rollouts=true`):
    `generate` may be called from several threads at once (their requests share one decode batch), and an update
    lands between two decode steps of the requests in flight, which continue under the new weights instead of
    being dropped or waited for. Every response token records the version of the weights that sampled it
    (`Sample.weight_versions`, through `Sample.set_token_versions` / `append_response_tokens(versions=...)`), and
    its recorded log-prob is over the distribution that really sampled it."""

    def update_weights_in_flight(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Load the tensors between two decode steps of the requests in flight (blocking until they are in); the
        tokens sampled after it record `version`."""
        ...

    def start_version(self, version: int) -> None:
        """The version the current weights carry (0 at start; a resumed run's restored version), stamped on the
        tokens sampled before the next update."""
        ...


@runtime_checkable
class ReleasesMemory(Protocol):
    """An engine on the trainer's own devices (`rollout.engine.placement=colocated`): once a step's generations are
    done, `release_memory` gives its device memory to the trainer; its next `update_weights` takes the memory back
    (the weights', then the pushed values, then the KV cache's) before it generates again."""

    def release_memory(self) -> None: ...


class EngineWrapper(RolloutEngine):
    """An engine around another (`inner`), answering with its capabilities."""

    inner: RolloutEngine

    @property
    def shares_trainer_weights(self) -> bool:
        return self.inner.shares_trainer_weights

    @property
    def shared_by_ranks(self) -> bool:
        return self.inner.shared_by_ranks

    @property
    def max_candidates(self) -> int | None:
        return self.inner.max_candidates

    @property
    def records_routes(self) -> bool:
        return self.inner.records_routes

    @property
    def max_context(self) -> int | None:
        return self.inner.max_context

    @property
    def decode_counts(self) -> Any:
        return self.inner.decode_counts

    def holding_weights(self) -> contextlib.AbstractContextManager:
        return self.inner.holding_weights()


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    """Every engine's input check: non-empty prompts of ids inside the model vocabulary."""
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the model vocabulary [0, {vocab_size})")
