"""The sampling settings of the ratio study: each truncation rule at each temperature.

A setting is written `rule=value` (`top_p=0.9`, `top_k=20`, `min_p=0.1`); the other two rules stay off
(top_p 1, top_k 0, min_p 0), so `top_p=1.0` is the untruncated control.
"""

from dataclasses import dataclass

from topp_rl.rollout import SamplingParams

TRUNCATIONS = ("top_p=1.0", "top_p=0.95", "top_p=0.9", "top_p=0.8", "top_k=20", "top_k=50", "min_p=0.1")
TEMPERATURES = (1.0, 0.7)
RULES = {"top_p": float, "top_k": int, "min_p": float}


@dataclass(frozen=True, kw_only=True)
class Setting:
    truncation: str  # e.g. "top_p=0.9"
    temperature: float

    @property
    def name(self) -> str:
        return f"{self.truncation} T={self.temperature:g}"

    def params(self, *, max_new_tokens: int, n: int, stop_token_ids=()) -> SamplingParams:
        rule, value = parse_truncation(self.truncation)
        return SamplingParams(temperature=self.temperature, max_new_tokens=max_new_tokens, n=n,
                              stop_token_ids=tuple(stop_token_ids), **{rule: value})


def parse_truncation(text: str) -> tuple[str, float | int]:
    rule, sep, value = text.partition("=")
    if not sep or rule not in RULES:
        raise ValueError(
            f"sampling setting {text!r} is not rule=value with rule in {sorted(RULES)}; e.g. top_p=0.9 or top_k=20"
        )
    try:
        return rule, RULES[rule](value)
    except ValueError:
        raise ValueError(f"sampling setting {text!r}: {value!r} is not a {RULES[rule].__name__}") from None


def grid(truncations=TRUNCATIONS, temperatures=TEMPERATURES) -> list[Setting]:
    """Every truncation at every temperature, temperature-major (all of T=1.0 first)."""
    for t in truncations:
        parse_truncation(t)  # fail before any sampling
    return [Setting(truncation=t, temperature=float(temp)) for temp in temperatures for t in truncations]
