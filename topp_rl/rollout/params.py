"""Sampling parameters shared by every rollout engine.

The truncation rule is SGLang's (see `topp_rl.ops.sampling_candidates`, convention "sglang"): temperature
first, then top-k, top-p over the untruncated probabilities, then min-p relative to the max probability.
`top_k=0` means no top-k (SGLang spells that -1; `SGLangEngine` maps it).
"""

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 64
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"temperature ({self.temperature}) must be > 0; use a small value such as 1e-3 for near-greedy sampling"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p ({self.top_p}) must be in (0, 1]; use 1.0 to disable top-p")
        if self.top_k < 0:
            raise ValueError(f"top_k ({self.top_k}) must be >= 0; use 0 to disable top-k")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p ({self.min_p}) must be in [0, 1); use 0.0 to disable min-p")
        if self.n < 1:
            raise ValueError(f"n ({self.n}) must be >= 1 (samples per prompt)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens ({self.max_new_tokens}) must be >= 1")
        # Accept any iterable (a Hydra ListConfig, say) but store a hashable tuple of ints.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def truncates(self) -> bool:
        """True when the sampler drops tokens, i.e. when candidate sets carry information."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0
