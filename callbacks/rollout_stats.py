"""`RolloutStats`: figures of the generated samples of each rollout step (`outputs["rollout"].samples`).

Reward mean / std (population std, from the reduced mean of r and r^2), accuracy (a sample's
`metadata["correct"]` when the task sets it, else reward >= `correct_reward`), response length, truncation and
abort rates, and the share of prompt groups whose rewards are all equal (zero advantage under group
normalisation: no learning signal). Aborted samples count only in `rollout/aborted_frac`. Pairs in the
batch's own `stats` (sums, counts from the datamodule) are reduced along; a bare float there is averaged over
ranks. One reduction per step. Statuses are compared as strings (`SampleStatus` is a StrEnum), which keeps
this import light.

Per reward function (a task with a reward set leaves `metadata["rewards"] = {name: value}` on each scored
sample): `rollout/reward/<name>_mean`, the unweighted value's mean. The task's own figures (`Task.stats()`,
e.g. `rollout/filtered_prompts`) are read from `trainer.datamodule.task` and logged as they are.
"""

import math
from collections import defaultdict

from lightning.pytorch.callbacks import Callback

from topp_rl.callbacks._common import log_metrics
from topp_rl.tasks import Task
from topp_rl.trainer.metrics import reduce_sums


class RolloutStats(Callback):
    def __init__(self, *, correct_reward: float = 1.0) -> None:
        self.correct_reward = correct_reward

    def sums(self, rollout) -> dict[str, tuple[float, float]]:
        samples = rollout.samples
        live = [s for s in samples if s.status != "aborted"]
        # Reward figures per trajectory: a multi-turn trajectory split into several samples (a prefix break) is one
        # reward, read on its first live sample.
        rewarded, seen = [], set()
        for s in live:
            key = s.metadata.get("trajectory", ("sample", id(s)))
            if s.reward is not None and key not in seen:
                seen.add(key)
                rewarded.append(s)
        rewards = [float(s.reward) for s in rewarded]
        correct = [bool(s.metadata.get("correct", s.reward >= self.correct_reward)) for s in rewarded]
        groups: dict[int, list[float]] = defaultdict(list)
        for s, r in zip(rewarded, rewards, strict=True):
            groups[s.group_index].append(r)
        sums = {
            "rollout/reward_mean": (sum(rewards), len(rewards)),
            "rollout/reward_sq_mean": (sum(r * r for r in rewards), len(rewards)),
            "rollout/accuracy": (sum(correct), len(rewards)),
            "rollout/response_length_mean": (sum(s.response_length for s in live), len(live)),
            "rollout/truncation_rate": (sum(s.status == "truncated" for s in live), len(live)),
            "rollout/aborted_frac": (len(samples) - len(live), len(samples)),
            "rollout/zero_variance_group_frac": (sum(max(g) == min(g) for g in groups.values()), len(groups)),
        }
        sums |= self.reward_sums(rewarded)
        for name, value in (getattr(rollout, "stats", None) or {}).items():
            sums[name] = tuple(value) if isinstance(value, tuple | list) else (float(value), 1.0)
        return sums

    @staticmethod
    def reward_sums(rewarded) -> dict[str, tuple[float, float]]:
        """(sum, count) of each reward function's value; names sorted, so every rank stacks them alike."""
        parts = [s.metadata["rewards"] for s in rewarded if "rewards" in s.metadata]
        names = sorted({name for p in parts for name in p})
        return {
            f"rollout/reward/{n}_mean": (sum(p[n] for p in parts if n in p), sum(n in p for p in parts))
            for n in names
        }

    @staticmethod
    def task_sums(trainer) -> dict[str, tuple[float, float]]:
        task = getattr(trainer.datamodule, "task", None)  # a RolloutDataModule's; other datamodules have none
        if not isinstance(task, Task):
            return {}
        return {name: (float(value), 1.0) for name, value in task.stats().items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not outputs or "rollout" not in outputs:  # a skipped step (every rank skips alike)
            return
        values = reduce_sums(trainer, self.sums(outputs["rollout"]) | self.task_sums(trainer))
        square = values.pop("rollout/reward_sq_mean", None)
        if square is not None:
            values["rollout/reward_std"] = math.sqrt(max(square - values["rollout/reward_mean"] ** 2, 0.0))
        log_metrics(trainer, {}, values)
