"""`StepMetrics`: the one owner of a training step's figures, handed to the loggers in one call per step.

Lightning's `LightningModule.log` costs about 1 ms per figure on a CPU (each call builds a `_ResultMetric`, moves
it with `apply_to_collection` and deep-copies its metadata), and a topp_rl step logs ~60 figures (~55 ms of a
tiny CPU step, docs/evidence/speed.md). The
module and the metric callbacks instead hand their step's figures, already reduced across ranks (equal on every
rank), to `StepMetrics.add`, which
- puts them at once into `trainer.callback_metrics`, as float32 CPU tensors (what `log` makes of a float), so a
  callback later in the same step (TrainingHealth, the progress bar, RunSummary) reads them;
- keeps them until its own `on_train_batch_end`, the last of the step (the `PolicyModule` brings it through
  `configure_callbacks`, which Lightning runs after the trainer's callbacks), and writes them to every logger in
  one `log_metrics` call on the steps Lightning's own logging would (`trainer.log_every_n_steps`, the step a run
  stops), with Lightning's step number and its `epoch` figure, the values rounded to float32 as before.
Departure from Lightning: `trainer.logged_metrics` does not list these figures (nothing here reads it).
"""

from collections.abc import Mapping

import torch
from lightning.pytorch.callbacks import Callback


class StepMetrics(Callback):
    def __init__(self) -> None:
        self.pending: dict[str, float] = {}
        self.written = False  # this step's figures went out: a later `add` comes from a callback placed after it

    @staticmethod
    def of(trainer) -> "StepMetrics":
        """The trainer's owner of step figures (exactly one must be among `trainer.callbacks`)."""
        owners = [c for c in trainer.callbacks if isinstance(c, StepMetrics)]
        if len(owners) != 1:
            raise ValueError(
                f"the trainer has {len(owners)} topp_rl.trainer.step_metrics.StepMetrics callbacks, need exactly 1: it "
                "logs the step's figures; PolicyModule brings one, another LightningModule must add "
                "StepMetrics() as the last of the trainer's callbacks"
            )
        return owners[0]

    def add(self, trainer, values: Mapping[str, float]) -> None:
        """Publish `values` in `trainer.callback_metrics` now; log them with the rest of the step at its end."""
        if self.written:
            raise RuntimeError(
                f"step figures {sorted(values)} arrived after StepMetrics wrote the step: the callback that logs "
                "them must come before StepMetrics in trainer.callbacks"
            )
        if not values:
            return
        figures = torch.tensor([float(v) for v in values.values()], dtype=torch.float32)
        publish(trainer, dict(zip(values, figures.unbind(), strict=True)))
        self.pending.update(zip(values, figures.tolist(), strict=True))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.written = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.written = True
        step = log_step(trainer)
        if self.pending and logs_step(trainer, step):
            scalars = dict(self.pending)
            scalars.setdefault("epoch", trainer.current_epoch)  # as Lightning's `_LoggerConnector.log_metrics`
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=step)
                logger.save()
        self.pending = {}


def logs_step(trainer, step: int) -> bool:
    """Whether Lightning's own logging writes the figures of the training batch it numbers `step` (its
    `should_update_logs`, or `fast_dev_run`)."""
    every = trainer.log_every_n_steps
    return bool(trainer.fast_dev_run) or (every > 0 and ((step + 1) % every == 0 or trainer.should_stop))


# The two Lightning internals this module leans on, each in one place; tests/test_step_metrics.py fails if
# Lightning changes either.
def log_step(trainer) -> int:
    """The step number Lightning's logging gives the current training batch: the batches that stepped before it
    (`_batches_that_stepped`, saved in checkpoints). Private in Lightning 2.6; there is no public equal
    (`global_step` counts optimizer steps, several per batch with `module.ppo_epochs` > 1)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def publish(trainer, tensors: Mapping[str, torch.Tensor]) -> None:
    """Add `tensors` to `trainer.callback_metrics`: the property returns Lightning's own dict, which it keeps
    and updates in place (Lightning 2.6 has no public setter)."""
    trainer.callback_metrics.update(tensors)
