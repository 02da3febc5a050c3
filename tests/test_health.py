"""TrainingHealth's console: each alarm kind is printed once (the first time it turns on; its `health/*` flag is
logged every step), on its own line above the live progress bar, never appended to the bar's line."""

import sys

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from tqdm.auto import tqdm

from topp_rl.callbacks import TrainingHealth
from topp_rl.report import plots as report
from topp_rl.run.console import StepProgressBar, WarnOnce, print_line
from topp_rl.trainer.step_metrics import StepMetrics

MISMATCH = [1e-7, 0.9, 1e-7, 0.8, 0.7, 1e-7]  # the mismatch alarm turns on at steps 1 and 3


class ScriptedFigures(L.LightningModule):
    """Logs a scripted masked mismatch and a zero gradient norm each step, as PolicyModule's callbacks would."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch, batch_idx):
        StepMetrics.of(self.trainer).add(
            self.trainer, {"train/rollout_logprob_abs_diff": MISMATCH[self.global_step], "train/grad_norm": 0.0})
        return (self.weight * batch).sum()

    def configure_callbacks(self):
        return [StepMetrics()]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(len(MISMATCH), 1), batch_size=1)


def console_lines(text: str) -> list[str]:
    """What a terminal shows of each line: the text after its last carriage return."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


def test_each_alarm_kind_prints_once_on_its_own_line_and_flags_every_step(tmp_path, capfd):
    trainer = L.Trainer(max_steps=len(MISMATCH), logger=CSVLogger(tmp_path, name="csv"), accelerator="cpu",
                        callbacks=[StepProgressBar(), TrainingHealth(max_mismatch=1e-3, zero_grad_steps=2)],
                        enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(ScriptedFigures())
    history = report.load_history(tmp_path)
    assert [v for _, v in history["health/mismatch_alarm"]] == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert [v for _, v in history["health/zero_grad_alarm"]] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    err = capfd.readouterr().err
    assert err.count("WARNING") == 2 and "step: 100%" in err  # the bar ran, each alarm kind printed once
    warnings = [line for line in console_lines(err) if "WARNING" in line]
    assert [w.split(":")[0] for w in warnings] == ["[topp_rl] WARNING at step 1"] * 2  # whole lines, not the bar's
    assert sorted(w.split("(printed once; ")[1] for w in warnings) == [
        "health/mismatch_alarm flags every step it holds)", "health/zero_grad_alarm flags every step it holds)"]


def test_print_line_keeps_a_live_bar_off_the_line(capfd):
    bar = tqdm(total=3, desc="step", file=sys.stderr)
    bar.update(1)
    warn = WarnOnce()
    assert warn.warn("a", "[topp_rl] first") and not warn.warn("a", "[topp_rl] again") and warn.warn("b", "[topp_rl] b")
    print_line("[topp_rl] plain line")
    bar.close()
    lines = console_lines(capfd.readouterr().err)
    assert [line for line in lines if "[topp_rl]" in line] == ["[topp_rl] first", "[topp_rl] b", "[topp_rl] plain line"]
