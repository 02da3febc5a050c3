"""What a run shows while it trains: one progress bar over the whole run, the wall time of every step, and
each log line once.

Lightning's own bar counts batches per epoch; an RL run has one endless epoch of rollout steps, so it shows
`Epoch 0/-2` and no total. `StepProgressBar` counts optimizer steps towards `trainer.max_steps` and shows the
two figures a user watches: the reward and the masked train/rollout mismatch. `StepTimer` logs `perf/step_s`.
Lines printed while the bar runs go through `print_line` (tqdm.write), so each lands on its own line above the bar;
`WarnOnce` prints each kind of warning the first time only.
"""

import logging
import sys
import time

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.callbacks.progress import ProgressBar
from tqdm.auto import tqdm

from topp_rl.trainer.step_metrics import StepMetrics

# (metric, label on the bar, format)
BAR_FIGURES = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("train/rollout_logprob_abs_diff", "mismatch", "{:.1e}"),
)


class StepProgressBar(ProgressBar):
    """`step 40/120 [00:05<00:10, 7.9step/s, reward=0.53, mismatch=2.1e-07]`, on global rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self.bar: tqdm | None = None

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.bar is not None

    def on_train_start(self, trainer, pl_module) -> None:
        if self._enabled and trainer.is_global_zero:
            total = trainer.max_steps if trainer.max_steps > 0 else None
            self.bar = tqdm(total=total, initial=trainer.global_step, desc="step", unit="step", dynamic_ncols=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.is_enabled:
            return
        metrics = trainer.callback_metrics
        shown = {label: fmt.format(float(metrics[key])) for key, label, fmt in BAR_FIGURES if key in metrics}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(trainer.global_step - self.bar.n)

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def print(self, *args, sep: str = " ", **kwargs) -> None:
        tqdm.write(sep.join(map(str, args)), **kwargs)  # above the bar, which stays intact


def print_line(text: str, *, file=None) -> None:
    """`text` on its own line of stderr (or `file`): a live tqdm bar is cleared first and redrawn below it. A plain
    print while the bar runs lands at the end of the bar's line (in a terminal, the bar then overwrites it)."""
    tqdm.write(text, file=file if file is not None else sys.stderr)


class WarnOnce:
    """Prints each kind of warning the first time it is raised in this process, through `print_line`; later
    occurrences print nothing (callers keep a per-step flag, e.g. TrainingHealth's `health/*` metrics)."""

    def __init__(self) -> None:
        self.printed: set[str] = set()

    def warn(self, kind: str, text: str) -> bool:
        """Print `text` unless `kind` was printed before; returns whether it printed."""
        if kind in self.printed:
            return False
        self.printed.add(kind)
        print_line(text)
        return True


class StepTimer(Callback):
    """`perf/step_s`: wall time from the previous step's end (or the train start) to this step's end, i.e. the
    rollout, scoring, optimisation and every callback of the step (weight sync, evaluation, checkpoints).
    Add it after the callbacks it should count."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        self.last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        StepMetrics.of(trainer).add(trainer, {"perf/step_s": now - self.last})
        self.last = now


def route_lightning_logs() -> None:
    """Lightning's `lightning` logger prints through its own handler and also propagates to the root logger, so
    under Hydra (root handlers: console + `<run dir>/train.log`) every line appears twice. With root handlers
    present, drop Lightning's own: its lines then reach the console and the run's log file once each."""
    if logging.getLogger().hasHandlers():
        lightning = logging.getLogger("lightning")
        for handler in list(lightning.handlers):
            lightning.removeHandler(handler)
