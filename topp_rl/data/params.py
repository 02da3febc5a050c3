"""Sampling parameters shared by every rollout engine.

The truncation rule is SGLang's (see `topp_rl.ops.sampling_candidates`, convention "sglang"): temperature
first, then top-k, top-p over the untruncated probabilities, then min-p relative to the max probability.
`top_k=0` means no top-k (SGLang spells that -1; `SGLangEngine` maps it).
"""

from dataclasses import dataclass

from topp_rl.ops import SAMPLING_RULES, check_sampling_value


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
        for rule in SAMPLING_RULES:  # the one definition of the sampling rules (shared with the ops, config)
            object.__setattr__(self, rule.name, check_sampling_value(rule, getattr(self, rule.name)))
        for name in ("n", "max_new_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        # Accept any iterable (a Hydra ListConfig, say) but store a hashable tuple of ints.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def truncates(self) -> bool:
        """True when the sampler drops tokens, i.e. when candidate sets carry information."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0
