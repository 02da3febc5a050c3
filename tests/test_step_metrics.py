"""StepMetrics: a step's figures reach every logger in one call per logged step (Lightning's step numbers,
`log_every_n_steps`, `epoch`, float32 values as `LightningModule.log` gave them) and `trainer.callback_metrics` at
once; next to figures logged through Lightning's own `log` they land on the same steps (this fails if the two
Lightning internals it reads change)."""

import csv

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from topp_rl.trainer.step_metrics import StepMetrics

STEPS = 7


def figure(step: int, k: int) -> float:
    return 0.1 * (step + 1) + k / 3  # not exact in float32


def f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


class Figures(L.LightningModule):
    """Adds `module/a`, `module/b` to the owner each step; `lightning/c` through Lightning's `log` if asked."""

    def __init__(self, *, lightning_log: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.lightning_log = lightning_log

    def training_step(self, batch, batch_idx):
        StepMetrics.of(self.trainer).add(self.trainer, {"module/a": figure(batch_idx, 0), "module/b": figure(batch_idx, 1)})
        if self.lightning_log:
            self.log("lightning/c", figure(batch_idx, 2), on_step=True, on_epoch=False, batch_size=1)
        return {}

    def configure_callbacks(self):
        return [StepMetrics()]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(STEPS)), batch_size=None)


class Contributor(Callback):
    """A metric callback: reads the module's figures of this step from callback_metrics, adds its own."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append(dict(trainer.callback_metrics))
        StepMetrics.of(trainer).add(trainer, {"callback/d": figure(batch_idx, 3)})


class CountingCSVLogger(CSVLogger):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))
        super().log_metrics(metrics, step)


def fit(tmp_path, *, every: int, module=None, callbacks=(), logger=None):
    logger = logger or CountingCSVLogger(tmp_path, name="csv")
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=logger, callbacks=list(callbacks),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=every, default_root_dir=tmp_path)
    trainer.fit(module or Figures())
    return trainer, logger


def read_csv(logger) -> list[dict[str, str]]:
    with open(f"{logger.log_dir}/metrics.csv") as f:
        return list(csv.DictReader(f))


def expected(step: int) -> dict[str, float]:
    return {"module/a": f32(figure(step, 0)), "module/b": f32(figure(step, 1)), "callback/d": f32(figure(step, 3))}


@pytest.mark.parametrize("every", [1, 3])
def test_one_logger_call_per_logged_step_with_every_figure(tmp_path, every):
    contributor = Contributor()
    trainer, logger = fit(tmp_path, every=every, callbacks=[contributor])
    logged = [s for s in range(STEPS) if (s + 1) % every == 0]
    assert [step for step, _ in logger.calls] == logged  # one call per logged step, Lightning's step numbers
    for step, metrics in logger.calls:
        assert metrics == expected(step) | {"epoch": 0}
    rows = read_csv(logger)
    assert [int(r["step"]) for r in rows] == logged
    for row in rows:
        assert {k: float(v) for k, v in row.items() if k != "step"} == expected(int(row["step"])) | {"epoch": 0.0}
    # callback_metrics: float32 CPU tensors, this step's module figures already there for a callback of the step
    for step, seen in enumerate(contributor.seen):
        assert {k: (v.dtype, float(v)) for k, v in seen.items() if k.startswith("module/")} == {
            k: (torch.float32, v) for k, v in expected(step).items() if k.startswith("module/")}
    assert {k: float(v) for k, v in trainer.callback_metrics.items()} == expected(STEPS - 1)


def test_same_steps_as_lightnings_own_log(tmp_path):
    """`lightning/c` goes through `LightningModule.log`; the owner's figures must land on the same CSV steps and
    sit in callback_metrics beside it (guards `log_step`, `logs_step` and `publish` against Lightning changes)."""
    trainer, logger = fit(tmp_path, every=3, module=Figures(lightning_log=True))
    rows = read_csv(logger)  # two rows per logged step: Lightning's call and the owner's
    by_key = {key: [int(r["step"]) for r in rows if r[key] != ""] for key in ("module/a", "lightning/c")}
    assert by_key["module/a"] == by_key["lightning/c"] == [2, 5]
    for row in rows:
        step, key, k = (int(row["step"]), "module/a", 0) if row["module/a"] else (int(row["step"]), "lightning/c", 2)
        assert float(row[key]) == f32(figure(step, k))
    assert set(trainer.callback_metrics) == {"module/a", "module/b", "lightning/c"}
    assert float(trainer.callback_metrics["module/b"]) == f32(figure(STEPS - 1, 1))


class RecordingWandbLogger(WandbLogger):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))
        super().log_metrics(metrics, step)


def test_wandb_offline_gets_each_logged_step_once(tmp_path):
    logger = RecordingWandbLogger(offline=True, save_dir=str(tmp_path), project="topp_rl_test")
    fit(tmp_path, every=2, callbacks=[Contributor()], logger=logger)
    logger.experiment.finish()
    assert [(step, metrics) for step, metrics in logger.calls] == [
        (s, expected(s) | {"epoch": 0}) for s in range(STEPS) if (s + 1) % 2 == 0]
    assert list(tmp_path.rglob("offline-run-*")), "the run was written offline"


def test_a_module_without_the_owner_is_told_how_to_add_it(tmp_path):
    class NoOwner(Figures):
        def configure_callbacks(self):
            return []

    with pytest.raises(ValueError, match=r"add StepMetrics\(\) as the last"):
        fit(tmp_path, every=1, module=NoOwner())


def test_a_figure_after_the_step_was_written_is_refused(tmp_path):
    class Late(Contributor):  # a trainer callback placed after the owner
        pass

    class OwnerFirst(Figures):
        def configure_callbacks(self):
            return []

    with pytest.raises(RuntimeError, match="must come before StepMetrics"):
        fit(tmp_path, every=1, module=OwnerFirst(), callbacks=[StepMetrics(), Late()])
