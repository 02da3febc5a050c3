"""`Evaluation`: held-out prompts scored before training and every `every_n_steps` (0: never), and the best
checkpoint.

Per evaluation, on the rank that owns an engine in each TP x CP group (its peers take part in the reductions
and the checkpoint save only), this DP rank's share of `num_prompts` held-out prompts (at most the evaluated
task's number of examples) goes twice through the training's own rollout step (`datamodule.rollout_step`:
generate, number, score):
- greedily (`top_k=1`, one sample): `val/accuracy` (a sample is correct when the task marks it so, else when its
  reward is >= `correct_reward`) and `val/response_length_mean`;
- `k` samples at the rollout's own sampling settings: `val/pass@k` (share of prompts with at least one correct
  sample) and `val/mean@k` (mean correctness over the k samples), k being `k`.
Held-out prompts (`topp_rl.tasks.splits.eval_examples`, resolved at fit start): `task` when given; else the
training task on `split` (`eval.split=test`: a dataset task's test split, a generated task's examples far beyond
any training index; a split that shares rows with the training split is refused); with neither, a generated
training task's `test` examples.
Multi-turn tasks (the agent loop, `rollout/step=agent`) go through that same step: each held-out prompt's
trajectories run against the training's environment, turns batched as in training, and a trajectory is scored
by its episode's reward (correct when the episode's reward mapping says `correct`, else when its score is
>= `correct_reward`; a trajectory whose environment failed is never correct). The response length then counts
the environment's tokens too (the whole transcript after the prompt). `eval.task`'s records go to the training's
environment, so they must be records it can play (a failed share above `max_failed_frac` stops the run there).
With `best_metric` set, `checkpoints/best.ckpt` is rewritten whenever that metric improves (every rank takes
part: Megatron gathers its shards there). Metrics are (sum, count) pairs reduced once over all ranks, so DP ranks
with different numbers of prompts weigh correctly. Each evaluation
prints one console line on global rank 0; `summary()` gives the last one's figures and the best checkpoint for
the end-of-run summary (summary.json).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from tqdm.auto import tqdm

from topp_rl.data.sample import SampleStatus
from topp_rl.tasks import Task
from topp_rl.tasks.base import HELD_OUT_OFFSET
from topp_rl.tasks.splits import EvalExamples, eval_examples
from topp_rl.trainer.metrics import add_sums, reduce_sums, reduce_tensor

__all__ = ["HELD_OUT_OFFSET", "METRICS", "Evaluation"]
METRICS = ("val/accuracy", "val/response_length_mean", "val/pass@k", "val/mean@k")  # what `evaluate` logs


class Evaluation(Callback):
    def __init__(self, *, every_n_steps: int = 10, num_prompts: int = 32, k: int = 4, task: Task | None = None,
                 split: str | None = None, correct_reward: float = 1.0, best_metric: str | None = "val/accuracy",
                 checkpoint_dir: str | Path | None = None) -> None:
        if every_n_steps < 0 or num_prompts < 1 or k < 1:
            raise ValueError(
                f"Evaluation(every_n_steps={every_n_steps}, num_prompts={num_prompts}, k={k}): need "
                "every_n_steps >= 0 (0: no evaluation), num_prompts and k >= 1"
            )
        _check_best_metric(best_metric, METRICS)
        self.every_n_steps, self.num_prompts, self.k = every_n_steps, num_prompts, k
        self.task, self.split, self.correct_reward = task, split, correct_reward
        self.best_metric, self.checkpoint_dir = best_metric, checkpoint_dir
        self.best, self.best_step = -math.inf, None
        self.history: list[dict[str, float]] = []
        self.examples: EvalExamples | None = None  # resolved at fit start
        self.prompt_count = 0  # prompts per evaluation: num_prompts, or all of a smaller split

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Resolve the held-out examples before the first rollout: a split the task lacks, one that shares rows
        with training, or a chat template the tokenizer lacks fails here, not at the first evaluation."""
        if self.every_n_steps:  # eval.every_n_steps=0 (the default): the entry is there, switched off
            self.resolve(trainer.datamodule)

    def resolve(self, datamodule) -> None:
        """Pick the held-out examples and how many of them an evaluation scores."""
        self.examples = eval_examples(datamodule.task, split=self.split, task=self.task)
        task, tokenizer = self.examples.task, datamodule.tokenizer
        task.check_tokenizer(tokenizer, key="eval.task" if self.task is not None else "task")
        task.prompt(self.examples.first_index, tokenizer)  # a dataset task drops over-long prompts here
        available = task.num_examples  # after that filtering
        self.prompt_count = self.num_prompts if available is None else min(self.num_prompts, available)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.every_n_steps:
            self.evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self.evaluate(trainer, pl_module)

    def evaluate(self, trainer, pl_module) -> dict[str, float]:
        if self.examples is None:  # called outside a fit (tests, scripts): resolve as the fit start would
            self.resolve(trainer.datamodule)
        datamodule = trainer.datamodule
        sums: dict[str, tuple[float, float]] = {}
        samples = []
        if datamodule.peers.is_source:
            sums, samples = self._score(datamodule)
        try:  # every rank (ranks without an engine add nothing), so all stop alike
            datamodule.rollout_step.check(samples, reduce_sum=lambda t: reduce_tensor(trainer, t, op="sum"))
        except RuntimeError as e:  # e.g. the agent loop's failed share: say that evaluation hit it, on what
            raise RuntimeError(f"evaluation on {self.examples.label}: {e}") from e
        values = reduce_sums(trainer, self._complete(sums))
        step = trainer.global_step
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)
        self.history.append({"step": float(step), **values})
        _check_best_metric(self.best_metric, tuple(values))  # a subclass may log other names
        metric = values[self.best_metric] if self.best_metric else None
        improved = metric is not None and metric > self.best and self.checkpoint_dir is not None
        if improved:
            self.best, self.best_step = metric, step
            trainer.save_checkpoint(self.best_path)
        if trainer.is_global_zero:
            tqdm.write(self.console_line(step, values, best=improved))  # above a live progress bar
        return values

    @property
    def best_path(self) -> Path | None:
        return None if self.checkpoint_dir is None else Path(self.checkpoint_dir) / "best.ckpt"

    def console_line(self, step: int, values: dict[str, float], *, best: bool) -> str:
        """`[topp_rl] eval at step 10 (data.jsonl [test], 16 prompts): accuracy 0.438, pass@4 0.625, ...`."""
        names = {"val/accuracy": "accuracy", "val/pass@k": f"pass@{self.k}", "val/mean@k": f"mean@{self.k}",
                 "val/response_length_mean": "response length"}
        figures = ", ".join(f"{names.get(key, key)} {value:.3g}" for key, value in values.items())
        mark = f" -> best {self.best_metric}: {self.best_path}" if best else ""
        return f"[topp_rl] eval at step {step} ({self.examples.label}, {self.prompt_count} prompts): {figures}{mark}"

    def summary(self) -> dict[str, float | str]:
        """The last evaluation's figures (under their metric names) and the best checkpoint, for summary.json."""
        if not self.history:
            return {}
        *_, last = self.history
        out: dict[str, float | str] = {"eval_set": self.examples.label, "eval_prompts": self.prompt_count,
                                       "eval_step": int(last["step"])}
        out |= {key: value for key, value in last.items() if key != "step"}
        if self.best_step is not None and self.best_path.is_file():
            out |= {"best_metric": self.best_metric, "best_value": self.best, "best_step": self.best_step,
                    "best_checkpoint": str(self.best_path)}
        return out

    def _prompts(self, datamodule) -> list:
        task, first = self.examples.task, self.examples.first_index
        mine = range(datamodule.dp_rank, self.prompt_count, datamodule.dp_size)
        return [task.prompt(first + i, datamodule.tokenizer) for i in mine]

    def _score(self, datamodule) -> tuple[dict[str, tuple[float, float]], list]:
        """This rank's metric sums, and its samples (greedy and sampled) for the step's failure check."""
        records = self._prompts(datamodule)
        if not records:
            return {}, []
        step, engine, params = datamodule.rollout_step, datamodule.ensure_engine(), datamodule.params
        greedy = dataclasses.replace(params, top_k=1, n=1)
        sampled = dataclasses.replace(params, n=self.k)
        sums: dict[str, tuple[float, float]] = {}
        every = []
        for kind, p in (("greedy", greedy), ("sampled", sampled)):
            samples = step.run(engine, records, p, task=self.examples.task, tokenizer=datamodule.tokenizer,
                               seed=0).samples
            every += samples
            correct = [s.status != SampleStatus.ABORTED and self._correct(s) for s in samples]
            if kind == "greedy":
                add_sums(sums, {"val/accuracy": (sum(correct), len(samples)),
                                "val/response_length_mean": (sum(s.response_length for s in samples), len(samples))})
            else:
                groups = [correct[i : i + self.k] for i in range(0, len(correct), self.k)]
                add_sums(sums, {"val/pass@k": (sum(any(g) for g in groups), len(groups)),
                                "val/mean@k": (sum(correct), len(correct))})
        return sums, every

    def _correct(self, sample) -> bool:
        meta = sample.metadata
        if "env_error" in meta:  # an agent trajectory whose environment failed (its reward 0 is no verdict)
            return False
        marked = meta.get("correct", meta.get("env_reward_info", {}).get("correct"))  # the task's or the episode's
        return bool(sample.reward >= self.correct_reward if marked is None else marked)

    @staticmethod
    def _complete(sums: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        """Every rank reduces the same names in the same order (ranks without an engine contribute zeros)."""
        return {n: sums.get(n, (0.0, 0.0)) for n in METRICS}

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step}

    def load_state_dict(self, state: dict) -> None:
        self.best = state["best"]
        self.best_step = state.get("best_step")  # checkpoints written before best_step was kept have none


def _check_best_metric(best_metric: str | None, logged: tuple[str, ...]) -> None:
    """A best_metric that is never logged would never write best.ckpt, silently (checked at construction
    against `METRICS`, and against what each evaluation really logged)."""
    if best_metric and best_metric not in logged:
        raise ValueError(
            f"eval.best_metric={best_metric!r} is not a metric the evaluation logs ({', '.join(logged)}); set "
            "eval.best_metric to one of them, or eval.best_metric=null for no best checkpoint"
        )
