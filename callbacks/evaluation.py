"""`Evaluation`: held-out prompts scored before training and every `every_n_steps` (0: never), and the best
checkpoint.

Per evaluation, on the rank that owns an engine in each TP x CP group (its peers take part in the reductions
and the checkpoint save only), this DP rank's share of `num_prompts` held-out prompts is generated twice:
- greedily (`top_k=1`, one sample): `val/accuracy` (a sample is correct when the task marks it so, else when its
  reward is >= `correct_reward`) and `val/response_length_mean`;
- `k` samples at the rollout's own sampling settings: `val/pass@k` (share of prompts with at least one correct
  sample) and `val/mean@k` (mean correctness over the k samples), k being `k`.
Held-out prompts: `task` when given (e.g. the dataset task on its test split), else the training task's
examples far beyond any training index (generated tasks draw them from the same distribution); a finite
dataset needs an explicit `task`. With `best_metric` set, `checkpoints/best.ckpt` is rewritten whenever that
metric improves (every rank takes part: Megatron gathers its shards there). Metrics are (sum, count) pairs
reduced once over all ranks, so DP ranks with different numbers of prompts weigh correctly.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from topp_rl.data.sample import SampleStatus, number_samples
from topp_rl.metrics import add_sums, reduce_sums
from topp_rl.tasks import Task

HELD_OUT_OFFSET = 10**9  # example indices past every training step's
METRICS = ("val/accuracy", "val/response_length_mean", "val/pass@k", "val/mean@k")  # what `evaluate` logs


class Evaluation(Callback):
    def __init__(self, *, every_n_steps: int = 10, num_prompts: int = 32, k: int = 4, task: Task | None = None,
                 correct_reward: float = 1.0, best_metric: str | None = "val/accuracy",
                 checkpoint_dir: str | Path | None = None) -> None:
        if every_n_steps < 0 or num_prompts < 1 or k < 1:
            raise ValueError(
                f"Evaluation(every_n_steps={every_n_steps}, num_prompts={num_prompts}, k={k}): need "
                "every_n_steps >= 0 (0: no evaluation), num_prompts and k >= 1"
            )
        _check_best_metric(best_metric, METRICS)
        self.every_n_steps, self.num_prompts, self.k = every_n_steps, num_prompts, k
        self.task, self.correct_reward = task, correct_reward
        self.best_metric, self.checkpoint_dir = best_metric, checkpoint_dir
        self.best = -math.inf
        self.history: list[dict[str, float]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        if not self.every_n_steps:  # eval.every_n_steps=0 (the default): the entry is there, switched off
            return
        datamodule = trainer.datamodule
        if self.task is None and datamodule.task.num_examples is not None:
            raise ValueError(
                f"eval: the training task {type(datamodule.task).__name__} has a finite dataset, so its examples "
                "are not held out; set eval.task (e.g. the same task on its test split)"
            )
        self.evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self.evaluate(trainer, pl_module)

    def evaluate(self, trainer, pl_module) -> dict[str, float]:
        datamodule = trainer.datamodule
        sums: dict[str, tuple[float, float]] = {}
        if datamodule.peers.is_source:
            sums = self._score(datamodule)
        values = reduce_sums(trainer, self._complete(sums))
        step = trainer.global_step
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)
        self.history.append({"step": float(step), **values})
        _check_best_metric(self.best_metric, tuple(values))  # a subclass may log other names
        metric = values[self.best_metric] if self.best_metric else None
        if metric is not None and metric > self.best and self.checkpoint_dir is not None:
            self.best = metric
            trainer.save_checkpoint(Path(self.checkpoint_dir) / "best.ckpt")
        return values

    def _prompts(self, datamodule) -> list:
        task = self.task or datamodule.task
        offset = 0 if self.task is not None else HELD_OUT_OFFSET
        mine = range(datamodule.dp_rank, self.num_prompts, datamodule.dp_size)
        return [task.prompt(offset + i, datamodule.tokenizer) for i in mine]

    def _score(self, datamodule) -> dict[str, tuple[float, float]]:
        records = self._prompts(datamodule)
        if not records:
            return {}
        task, engine, params = self.task or datamodule.task, datamodule.ensure_engine(), datamodule.params
        greedy = dataclasses.replace(params, top_k=1, n=1)
        sampled = dataclasses.replace(params, n=self.k)
        sums: dict[str, tuple[float, float]] = {}
        for kind, p in (("greedy", greedy), ("sampled", sampled)):
            samples = number_samples(engine.generate([r.prompt_ids for r in records], p, seed=0),
                                     prompts=len(records), n=p.n)
            live = [s for s in samples if s.status != SampleStatus.ABORTED]
            task.score(live, records, datamodule.tokenizer)
            correct = [s.status != SampleStatus.ABORTED and self._correct(s) for s in samples]
            if kind == "greedy":
                add_sums(sums, {"val/accuracy": (sum(correct), len(samples)),
                                "val/response_length_mean": (sum(s.response_length for s in samples), len(samples))})
            else:
                groups = [correct[i : i + self.k] for i in range(0, len(correct), self.k)]
                add_sums(sums, {"val/pass@k": (sum(any(g) for g in groups), len(groups)),
                                "val/mean@k": (sum(correct), len(correct))})
        return sums

    def _correct(self, sample) -> bool:
        return bool(sample.metadata.get("correct", sample.reward >= self.correct_reward))

    @staticmethod
    def _complete(sums: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        """Every rank reduces the same names in the same order (ranks without an engine contribute zeros)."""
        return {n: sums.get(n, (0.0, 0.0)) for n in METRICS}

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.best = state["best"]


def _check_best_metric(best_metric: str | None, logged: tuple[str, ...]) -> None:
    """A best_metric that is never logged would never write best.ckpt, silently (checked at construction
    against `METRICS`, and against what each evaluation really logged)."""
    if best_metric and best_metric not in logged:
        raise ValueError(
            f"eval.best_metric={best_metric!r} is not a metric the evaluation logs ({', '.join(logged)}); set "
            "eval.best_metric to one of them, or eval.best_metric=null for no best checkpoint"
        )
