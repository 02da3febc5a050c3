"""Per-token figures of one sampled batch -> the table's statistics (pure torch).

With d = log pi_train(y) - log pi_rollout(y) per token: the importance ratio exp(d) (mean, median, p5, p95, share
outside [0.9, 1.1], max |d|) and the k3 estimate of KL(pi_rollout || pi_train) = exp(d) - 1 - d, the same
estimator as the `LogProbMismatch` callback's `train/kl_k3_rollout`.
"""

from dataclasses import dataclass

import torch

RATIO_BAND = (0.9, 1.1)


@dataclass(frozen=True, kw_only=True)
class TokenFigures:
    """One setting's trainable response tokens (all [N], float64 unless noted)."""

    rollout: torch.Tensor  # the engine's log-prob (renormalised over its kept set)
    masked: torch.Tensor  # trainer, over the kept set (the mask on)
    unmasked: torch.Tensor  # trainer, over the full vocabulary
    log_kept_mass: torch.Tensor  # log of the full-vocabulary probability of the kept set (trainer, at T)
    kept_size: torch.Tensor  # int64: kept-set size (the vocabulary size where nothing was cut)
    aborted: int = 0  # samples the engine aborted (not in the figures)

    @classmethod
    def concat(cls, parts: list["TokenFigures"]) -> "TokenFigures":
        names = ("rollout", "masked", "unmasked", "log_kept_mass", "kept_size")
        return cls(**{n: torch.cat([getattr(p, n) for p in parts]) for n in names},
                   aborted=sum(p.aborted for p in parts))


def ratio_stats(train: torch.Tensor, rollout: torch.Tensor) -> dict[str, float]:
    d = train.double() - rollout.double()
    ratio = torch.exp(d)
    q = torch.quantile(ratio, torch.tensor([0.5, 0.05, 0.95], dtype=torch.float64))
    outside = (ratio < RATIO_BAND[0]) | (ratio > RATIO_BAND[1])
    return {
        "ratio_mean": float(ratio.mean()), "ratio_median": float(q[0]), "ratio_p5": float(q[1]),
        "ratio_p95": float(q[2]), "outside_0.9_1.1": float(outside.double().mean()),
        "kl_k3": float((torch.expm1(d) - d).mean()), "max_abs_log_ratio": float(d.abs().max()),
    }


def table_rows(fig: TokenFigures, **labels) -> list[dict]:
    """Two rows (scoring = masked, unmasked) of one engine x setting; `labels` go first in each row."""
    shared = {
        "tokens": int(fig.rollout.numel()), "aborted_samples": fig.aborted,
        "kept_size_mean": float(fig.kept_size.double().mean()),
        "kept_mass_mean": float(torch.exp(fig.log_kept_mass.double()).mean()),
    }
    return [
        {**labels, "scoring": scoring, **ratio_stats(train, fig.rollout), **shared}
        for scoring, train in (("masked", fig.masked), ("unmasked", fig.unmasked))
    ]
