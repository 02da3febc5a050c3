"""Loggers: a `logger=wandb` run has the resolved config, tags and a CSV log next to it (which the plot command
reads); the W&B mode follows WANDB_MODE; TensorBoard (sweep names: test_sweep.py)."""

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml
from helpers import compose_cfg as tiny_cfg
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from topp_rl.callbacks.completions import COLUMNS
from topp_rl.report import plots as report
from topp_rl.run.loggers import LogConfig, build_loggers, wandb_mode
from topp_rl.train import build_run, fit

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def compose_cfg(output_dir: Path, *overrides: str):
    """The tiny config (helpers.TINY) without the HF export."""
    return tiny_cfg(output_dir, "export.hf=false", *overrides)


def test_wandb_run_has_config_tags_completions_and_a_csv_log(tmp_path):
    run = build_run(compose_cfg(tmp_path, "logger=wandb", "logger.wandb.tags=[baseline,tiny]", "seed=3"))
    (wandb_logger,) = [lg for lg in run.loggers if isinstance(lg, WandbLogger)]
    assert [type(lg) for lg in run.loggers] == [CSVLogger, WandbLogger]
    fit(run)
    experiment = wandb_logger.experiment
    assert experiment.offline and experiment.id == (tmp_path / "wandb_id").read_text().strip()
    assert experiment.name == "grpo-top_p0.9-seed3" and experiment.tags == ("baseline", "tiny")
    config = dict(experiment.config)
    assert config["rollout"]["top_p"] == 0.9 and config["seed"] == 3 and config["algo"]["name"] == "grpo"
    assert config["paths"]["output_dir"] == str(tmp_path)  # resolved, not "${hydra:runtime.output_dir}"
    # The completions tables, as wandb.Table wrote them (JSON: columns + data), hold completions.jsonl's rows.
    tables = [json.loads(p.read_text()) for p in tmp_path.glob("wandb/offline-run-*/files/media/table/rollout/"
                                                                  "completions_*.table.json")]
    jsonl = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(tables) == 2 and all(t["columns"] == list(COLUMNS) for t in tables)
    assert sorted(map(str, (row for t in tables for row in t["data"]))) == sorted(
        str([r[c] for c in COLUMNS]) for r in jsonl)

    (metrics,) = tmp_path.glob("csv/version_0/metrics.csv")
    with metrics.open() as f:
        rewards = [r["rollout/reward_mean"] for r in csv.DictReader(f) if r.get("rollout/reward_mean")]
    assert len(rewards) == 2
    hparams = yaml.safe_load((metrics.parent / "hparams.yaml").read_text())
    assert hparams["rollout"]["top_p"] == 0.9 and hparams["logger"]["wandb"]["tags"] == ["baseline", "tiny"]
    assert report.load_history(tmp_path)[report.REWARD] == [(0.0, float(rewards[0])), (1.0, float(rewards[1]))]


def test_wandb_mode_follows_the_environment_unless_configured(tmp_path):
    assert wandb_mode(None, "online") == "online"
    assert wandb_mode(None, None) == "offline"
    assert wandb_mode("disabled", "online") == "disabled"
    assert wandb_mode(None, "dryrun") == "offline"
    with pytest.raises(ValueError, match=r"WANDB_MODE='onlin' is not a W&B mode; use one of online, offline"):
        wandb_mode(None, "onlin")
    cfg = compose_cfg(tmp_path, "logger=wandb")
    assert "offline" not in cfg.logger.wandb and cfg.logger.wandb.mode is None  # nothing pins offline


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed (pip install 'topp_rl[tensorboard]')")
def test_tensorboard_logger_gets_config_and_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = compose_cfg(tmp_path, "logger=tensorboard")
    loggers = build_loggers(cfg)
    assert [type(lg).__name__ for lg in loggers] == ["CSVLogger", "TensorBoardLogger"]
    config = LogConfig(cfg).config  # what the callback hands every logger at fit start
    for step in range(3):
        for lg in loggers:
            if step == 0:
                lg.log_hyperparams(config)
            lg.log_metrics({"rollout/reward_mean": 0.25 * step}, step=step)
    for lg in loggers:
        lg.finalize("success")
    tb = loggers[1]
    events = EventAccumulator(tb.log_dir)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert yaml.safe_load((Path(tb.log_dir) / "hparams.yaml").read_text())["rollout"]["top_p"] == 0.9
    assert report.load_history(tmp_path)[report.REWARD] == [(0.0, 0.0), (1.0, 0.25), (2.0, 0.5)]


def test_tensorboard_without_the_package_names_the_fix(tmp_path, monkeypatch):
    for name in ("tensorboard", "tensorboardX"):  # as on an install without the extra: the import fails
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ValueError) as info:
        build_loggers(compose_cfg(tmp_path, "logger=tensorboard"))
    assert str(info.value) == (
        "logger=tensorboard needs the tensorboard or tensorboardX package, which cannot be imported (tensorboard: "
        "import of tensorboard halted; None in sys.modules; tensorboardX: import of tensorboardX halted; None in "
        "sys.modules); run `pip install 'topp_rl[tensorboard]' (or pip install tensorboard)`, or pick another "
        "logger (logger=csv)"
    )


def test_an_unimportable_wandb_names_the_package_and_the_install_command(tmp_path, monkeypatch):
    """Lightning checks wandb's package metadata only: a wandb that is listed but fails to import (issue 18 part
    6l) surfaced as a bare ImportError from inside WandbLogger."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError) as info:
        build_loggers(compose_cfg(tmp_path, "logger=wandb"))
    assert str(info.value) == (
        "logger=wandb needs the wandb package, which cannot be imported (wandb: import of wandb halted; None in "
        "sys.modules); run `pip install wandb`, or pick another logger (logger=csv)"
    )


def test_csv_only_and_no_logger_still_work(tmp_path):
    assert [type(lg) for lg in build_loggers(compose_cfg(tmp_path, "logger=csv"))] == [CSVLogger]
    assert build_loggers(compose_cfg(tmp_path, "logger=none")) == []
