"""`TrainingHealth`: loud warnings when a run goes wrong without crashing (collapse, off-policy drift).

Reads the step's reduced figures from `trainer.callback_metrics` (the same on every rank, so it must come
after the callbacks that log them) and raises an alarm, logged every step as a 0 / 1 flag and printed to stderr on
rank 0 once per alarm kind and run start: the first time it turns on, on its own line above the progress bar
(`topp_rl.run.console.WarnOnce`); an alarm that turns off and on again is left to its flag. The alarms:
- `health/mismatch_alarm`: the masked on-policy mismatch `train/rollout_logprob_abs_diff` exceeds
  `max_mismatch` (default by the trainer's precision: 1e-3 at 32 bits, where engines agree to ~1e-6; 1e-2 at
  16 bits, where bf16 scoring alone gives ~2e-3 (measured: tiny model, CPU bf16-mixed, top_p 0.9). Above it
  the engine samples with other weights, e.g. a missing weight sync, or another model). Needs `LogProbMismatch`.
  With rollouts ahead (`rollout.max_staleness >= 1`) a step's samples come from older weights by design (the
  batch's `rollout/weight_staleness` > 0), and the mismatch then measures that gap, which TIS / ICEPOP correct;
  the alarm then checks `train/rollout_logprob_abs_diff_current`, the tokens sampled by the trained weights
  (partial rollouts, steps whose generation started after the last update), and logs 0 where there are none.
- `health/zero_grad_alarm`: `train/grad_norm` is exactly 0 for `zero_grad_steps` steps in a row (every
  advantage zero: all groups tied, or a collapsed policy whose samples all get one reward).
- `health/entropy_collapse_alarm`: `train/entropy` below `entropy_collapse_frac` of its first step's value
  (the policy turned deterministic), or within 0.1% of ln(vocab) after having been lower (it turned uniform,
  e.g. after a learning-rate blow-up).
"""

import math

from lightning.pytorch.callbacks import Callback

from topp_rl.data import RolloutBatch
from topp_rl.run.console import WarnOnce
from topp_rl.trainer.module import PolicyModule
from topp_rl.trainer.step_metrics import StepMetrics

# The logged figures the alarms read (each one host read per step, not one per logged figure).
_WATCHED = ("train/rollout_logprob_abs_diff", "train/rollout_logprob_abs_diff_current", "train/grad_norm",
            "train/entropy")


def _rollout_step(outputs, batch_idx: int) -> int:
    """The step this batch's figures carry in metrics.csv: its rollout's step (the number CompletionsLog prints),
    else the batch index. `trainer.global_step` has already moved past it at batch end, and counts optimizer
    steps (several per rollout step with `module.ppo_epochs` > 1)."""
    rollout = (outputs or {}).get("rollout")
    return int(rollout.step) if isinstance(rollout, RolloutBatch) else batch_idx


def _stale(outputs) -> bool:
    """Whether the step trained on samples of older weights than the trained ones (`rollout.max_staleness`)."""
    stats = getattr((outputs or {}).get("rollout"), "stats", None) or {}
    staleness, _ = stats.get("rollout/weight_staleness", (0.0, 0.0))
    return staleness > 0


class TrainingHealth(Callback):
    def __init__(self, *, max_mismatch: float | None = None, zero_grad_steps: int = 5,
                 entropy_collapse_frac: float = 0.01) -> None:
        if (max_mismatch is not None and not max_mismatch > 0) or zero_grad_steps < 1 or not 0 < entropy_collapse_frac < 1:
            raise ValueError(
                f"TrainingHealth(max_mismatch={max_mismatch}, zero_grad_steps={zero_grad_steps}, "
                f"entropy_collapse_frac={entropy_collapse_frac}): need max_mismatch > 0, zero_grad_steps >= 1 "
                "and 0 < entropy_collapse_frac < 1 (max_mismatch=null: by precision)"
            )
        self.max_mismatch, self.zero_grad_steps = max_mismatch, zero_grad_steps
        self.entropy_collapse_frac = entropy_collapse_frac
        self.zero_grad_run = 0
        self.first_entropy: float | None = None
        self.min_entropy = math.inf
        self.warnings = WarnOnce()  # per process: a resumed run prints an alarm that holds again

    def on_train_start(self, trainer, pl_module) -> None:
        if self.max_mismatch is None:
            self.max_mismatch = 1e-2 if "16" in str(trainer.precision) else 1e-3

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = {k: float(trainer.callback_metrics[k]) for k in _WATCHED if k in trainer.callback_metrics}
        step = _rollout_step(outputs, batch_idx)
        alarms: dict[str, str | None] = {}
        mismatch = metrics.get("train/rollout_logprob_abs_diff")
        if mismatch is not None and _stale(outputs):
            # Older weights on purpose (rollouts ahead): only the tokens the trained weights sampled must agree.
            mismatch = metrics.get("train/rollout_logprob_abs_diff_current")
            if mismatch is None:
                alarms["health/mismatch_alarm"] = None  # no token of this step was sampled by the trained weights
        if mismatch is not None and "health/mismatch_alarm" not in alarms:
            alarms["health/mismatch_alarm"] = (
                f"masked on-policy mismatch train/rollout_logprob_abs_diff{'_current' if _stale(outputs) else ''}="
                f"{mismatch:.3g} > {self.max_mismatch:g}: "
                "the engine is not sampling with the trained weights (is callbacks.weight_sync set?) or scores "
                "another model; the run is training off-policy"
            ) if not mismatch <= self.max_mismatch else None
        grad_norm = metrics.get("train/grad_norm")
        if grad_norm is not None:
            self.zero_grad_run = self.zero_grad_run + 1 if grad_norm == 0.0 else 0
            alarms["health/zero_grad_alarm"] = (
                f"train/grad_norm has been exactly 0 for {self.zero_grad_run} steps: no learning signal (every "
                "group's rewards tie, or the policy collapsed; check rollout/reward_std and optimizer.lr)"
            ) if self.zero_grad_run >= self.zero_grad_steps else None
        entropy = metrics.get("train/entropy")
        if entropy is not None:
            alarms["health/entropy_collapse_alarm"] = self._entropy_alarm(entropy, pl_module)
        for key, message in alarms.items():
            self._report(trainer, key, message, step)
        if alarms:
            StepMetrics.of(trainer).add(trainer, {k: float(m is not None) for k, m in alarms.items()})

    def _entropy_alarm(self, entropy: float, pl_module) -> str | None:
        if self.first_entropy is None:
            self.first_entropy = entropy
        self.min_entropy = min(self.min_entropy, entropy)
        if entropy < self.entropy_collapse_frac * self.first_entropy:
            return (f"train/entropy={entropy:.3g} fell below {self.entropy_collapse_frac:g} x its first value "
                    f"({self.first_entropy:.3g}): the policy is collapsing to deterministic outputs")
        uniform = math.log(pl_module.layout.vocab_size) if isinstance(pl_module, PolicyModule) else math.inf
        if entropy >= 0.999 * uniform and self.min_entropy < 0.99 * uniform:
            return (f"train/entropy={entropy:.3g} is ln(vocab)={uniform:.3g}: the policy became uniform after "
                    f"having been sharper ({self.min_entropy:.3g}); likely a learning-rate blow-up")
        return None

    def _report(self, trainer, key: str, message: str | None, step: int) -> None:
        if message is not None and trainer.is_global_zero:
            self.warnings.warn(key, f"[topp_rl] WARNING at step {step}: {message} (printed once; {key} flags every "
                                    "step it holds)")

    def state_dict(self) -> dict:
        return {"zero_grad_run": self.zero_grad_run, "first_entropy": self.first_entropy,
                "min_entropy": self.min_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.zero_grad_run = state["zero_grad_run"]
        self.first_entropy, self.min_entropy = state["first_entropy"], state["min_entropy"]
