"""`SupportStats`: size of the recorded candidate set per trainable token (the sampler's kept support).

Over trainable tokens that have candidate data (size 0 = none recorded, counted only in `support_coverage`):
mean, median, p99, max and share of singletons (size 1: the sampler had no choice). Exact over all ranks:
sizes are reduced as a histogram of counts (one max- and one sum-all_reduce). The run's cumulative counts go
to `<out_dir>/support_size_counts.json` for `python -m topp_rl.report` (rank 0, an atomic rewrite with every
checkpoint, at the end of training and when it fails: a resumed run goes on from the counts of the checkpoint it
resumes, so the file never holds steps that the run repeats).
"""

import json
import os
from collections import Counter
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from topp_rl.callbacks._common import log_histograms, log_metrics, quantile_from_counts
from topp_rl.trainer.metrics import reduce_tensor

COUNTS_FILE = "support_size_counts.json"


class SupportStats(Callback):
    def __init__(self, *, out_dir: str | None = None, save_counts: bool = True) -> None:
        self.out_dir = out_dir
        self.save_counts = save_counts
        self.total_counts: Counter[int] = Counter()
        self.steps = 0

    def state_dict(self) -> dict:
        return {"total_counts": dict(self.total_counts), "steps": self.steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.total_counts = Counter({int(k): int(v) for k, v in state_dict["total_counts"].items()})
        self.steps = int(state_dict["steps"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not outputs or "onpolicy" not in outputs:  # a skipped step (every rank skips alike)
            return
        record = outputs["onpolicy"]
        trainable = record.loss_mask > 0
        sizes = record.support_size[trainable].to(torch.int64).cpu()
        sizes = sizes[sizes > 0]
        local_max = int(sizes.max()) if sizes.numel() else 0
        top = int(reduce_tensor(trainer, torch.tensor([local_max]), op="max")[0])
        local = torch.cat([torch.tensor([int(trainable.sum())]), torch.bincount(sizes, minlength=top + 1)])
        reduced = reduce_tensor(trainer, local, op="sum")
        num_trainable, counts = int(reduced[0]), reduced[1:]
        total = int(counts.sum())
        extra = {}
        if num_trainable:
            extra["rollout/support_coverage"] = total / num_trainable
        if total:
            values = torch.arange(top + 1, dtype=torch.float64)
            extra |= {
                "rollout/support_size_mean": float((values * counts).sum()) / total,
                "rollout/support_size_median": quantile_from_counts(counts, 0.5),
                "rollout/support_size_p99": quantile_from_counts(counts, 0.99),
                "rollout/support_size_max": float(top),
                "rollout/support_singleton_frac": int(counts[1]) / total,
            }
        log_metrics(trainer, {}, extra)
        self.steps += 1
        self.total_counts.update({v: int(c) for v, c in enumerate(counts.tolist()) if c})
        if total:
            log_histograms(
                trainer, {"rollout/support_size_hist": torch.repeat_interleave(torch.arange(top + 1), counts)}
            )

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._save(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._save(trainer)

    def _save(self, trainer) -> None:
        if self.save_counts and trainer.is_global_zero and self.steps:
            self.write_counts(Path(self.out_dir or trainer.default_root_dir))

    def write_counts(self, out_dir: Path) -> Path:
        """Atomically (re)write the cumulative size counts: {"steps": n, "counts": {"size": count}}."""
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / COUNTS_FILE
        tmp = path.with_suffix(".json.tmp")
        payload = {"steps": self.steps, "counts": {str(k): v for k, v in sorted(self.total_counts.items())}}
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, path)
        return path
