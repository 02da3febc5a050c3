"""`LogProbMismatch`: train vs rollout log-probs on the on-policy pass, with and without the candidate mask.

The old-log-prob pass runs with the weights the engine sampled with, so for every trainable token
d = log pi_train(y) - log pi_rollout(y) should be ~0 when the trainer scores over the recorded candidate set;
the `_unmasked` figures score over the full vocabulary and show the bias the mask removes. With rollouts ahead
(`rollout.max_staleness >= 1`) most tokens were sampled by older weights; `rollout_logprob_abs_diff_current` is the
masked |d| over the tokens sampled by the weights this step trains, which stays at the on-policy level. Per token:
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
        n = float(keep.sum())
        suffixes = ("", "_unmasked")
        # Both figures side by side ([2, n]: masked, unmasked), every sum in one tensor, read back at once.
        d = torch.stack([record.logprobs[keep], record.logprobs_unmasked[keep]]).double()
        d -= record.rollout_logprobs[keep].double()
        ratio, abs_d = torch.exp(d), d.abs()
        outside = (ratio < RATIO_BAND[0]) | (ratio > RATIO_BAND[1])
        per_row = torch.stack([abs_d, torch.expm1(d) - d, ratio, outside.double(), (abs_d > EXTREME_LOG_RATIO).double()])
        names = ("rollout_logprob_abs_diff", "kl_k3_rollout", "is_ratio_mean", "is_ratio_outside_frac",
                 "rollout_extreme_frac")
        totals = per_row.sum(dim=2).tolist()  # [figure][masked, unmasked]
        sums = {f"train/{name}{suffix}": (totals[i][j], n)
                for i, name in enumerate(names) for j, suffix in enumerate(suffixes)}
        if record.staleness is not None:  # rollouts ahead: the tokens sampled by the very weights this step trains
            current = keep & (record.staleness == 0)
            d_current = record.logprobs[current].double() - record.rollout_logprobs[current].double()
            sums["train/rollout_logprob_abs_diff_current"] = (float(d_current.abs().sum()), float(current.sum()))
        # rows: abs_diff, abs_diff_unmasked, ratio, ratio_unmasked (the histograms' and order statistics' columns)
        gathered = gather_columns(trainer, torch.cat([abs_d, ratio]).cpu())
        extra = {}
        if gathered.shape[1]:
            diff, ratios = gathered[:2], gathered[2:]
            stats = torch.stack([diff.amax(dim=1), torch.quantile(diff, 0.99, dim=1), ratios.amin(dim=1),
                                 ratios.amax(dim=1)]).tolist()
            names = ("rollout_logprob_abs_diff_max", "rollout_logprob_abs_diff_p99", "is_ratio_min", "is_ratio_max")
            extra = {f"train/{name}{suffix}": stats[i][j]
                     for i, name in enumerate(names) for j, suffix in enumerate(suffixes)}
        log_metrics(trainer, sums, extra)
        if self.histograms and trainer.global_step % self.histogram_every_n_steps == 0:
            log_histograms(
                trainer,
                {
                    "train/rollout_logprob_abs_diff_hist": gathered[0],
                    "train/rollout_logprob_abs_diff_unmasked_hist": gathered[1],
                    "train/is_ratio_hist": gathered[2],
                },
            )
