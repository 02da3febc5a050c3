"""`LogProbMismatch`: train vs rollout log-probs on the on-policy pass, with and without the candidate mask.

The old-log-prob pass runs with the weights the engine sampled with, so for every trainable token
d = log pi_train(y) - log pi_rollout(y) should be ~0 when the trainer scores over the recorded candidate set;
the `_unmasked` figures score over the full vocabulary and show the bias the mask removes. Per token:
|d| (mean, max, p99), the IS ratio exp(d) (mean, min, max, share outside [0.9, 1.1]) and the k3 estimate of
KL(pi_rollout || pi_train) = exp(d) - 1 - d, and the share of extreme tokens, |d| > ln 2 (the ratio beyond a
factor of two either way: `rollout_extreme_frac`). Only these mismatch figures: the module logs its own training
curves (train/loss, train/entropy, train/grad_norm, ...). Order statistics are exact over all ranks
(all-gather of the per-token figures).
"""

import math

import torch
from lightning.pytorch.callbacks import Callback

from topp_rl.callbacks._common import gather_columns, log_histograms, log_metrics

RATIO_BAND = (0.9, 1.1)
EXTREME_LOG_RATIO = math.log(2.0)  # |d| above it: train and rollout disagree on the token by more than 2x


class LogProbMismatch(Callback):
    def __init__(self, *, histograms: bool = True, histogram_every_n_steps: int = 1) -> None:
        if histogram_every_n_steps < 1:
            raise ValueError(f"histogram_every_n_steps={histogram_every_n_steps} must be >= 1")
        self.histograms = histograms
        self.histogram_every_n_steps = histogram_every_n_steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not outputs or "onpolicy" not in outputs:  # a skipped step (every rank skips alike)
            return
        record = outputs["onpolicy"]
        keep = record.loss_mask > 0
        rollout = record.rollout_logprobs[keep].double()
        n = float(keep.sum())
        sums: dict[str, tuple[float, float]] = {}
        columns = {}
        for suffix, logprobs in (("", record.logprobs), ("_unmasked", record.logprobs_unmasked)):
            d = logprobs[keep].double() - rollout
            ratio = torch.exp(d)
            outside = (ratio < RATIO_BAND[0]) | (ratio > RATIO_BAND[1])
            sums |= {
                f"train/rollout_logprob_abs_diff{suffix}": (float(d.abs().sum()), n),
                f"train/kl_k3_rollout{suffix}": (float((torch.expm1(d) - d).sum()), n),
                f"train/is_ratio_mean{suffix}": (float(ratio.sum()), n),
                f"train/is_ratio_outside_frac{suffix}": (float(outside.sum()), n),
                f"train/rollout_extreme_frac{suffix}": (float((d.abs() > EXTREME_LOG_RATIO).sum()), n),
            }
            columns[f"abs_diff{suffix}"] = d.abs()
            columns[f"ratio{suffix}"] = ratio
        gathered = gather_columns(trainer, torch.stack(list(columns.values())).cpu())
        per_token = dict(zip(columns, gathered, strict=True))
        extra = {}
        if gathered.shape[1]:
            for suffix in ("", "_unmasked"):
                diff, ratio = per_token[f"abs_diff{suffix}"], per_token[f"ratio{suffix}"]
                extra |= {
                    f"train/rollout_logprob_abs_diff_max{suffix}": float(diff.max()),
                    f"train/rollout_logprob_abs_diff_p99{suffix}": float(torch.quantile(diff, 0.99)),
                    f"train/is_ratio_min{suffix}": float(ratio.min()),
                    f"train/is_ratio_max{suffix}": float(ratio.max()),
                }
        log_metrics(trainer, sums, extra)
        if self.histograms and trainer.global_step % self.histogram_every_n_steps == 0:
            log_histograms(
                trainer,
                {
                    "train/rollout_logprob_abs_diff_hist": per_token["abs_diff"],
                    "train/rollout_logprob_abs_diff_unmasked_hist": per_token["abs_diff_unmasked"],
                    "train/is_ratio_hist": per_token["ratio"],
                },
            )
