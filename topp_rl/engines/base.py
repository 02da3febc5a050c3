"""The `RolloutEngine` protocol every backend implements (`EmbeddedEngine`, `SGLangEngine`).

Contract (docs/ARCHITECTURE.md): `generate` returns `params.n` samples per prompt, prompt-major (the pipeline
numbers them: `topp_rl.data.number_samples`); `update_weights` takes HF parameter names; engines are context
managers that `close()` on exit.
"""

from collections.abc import Iterable
from typing import Protocol, Self, runtime_checkable

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample


@runtime_checkable
class RolloutEngine(Protocol):
    vocab_size: int

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None
    ) -> list[Sample]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def close(self) -> None: ...

    # Default context-manager behaviour for engines that subclass the protocol explicitly.
    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    """Every engine's input check: non-empty prompts of ids inside the model vocabulary."""
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the model vocabulary [0, {vocab_size})")
