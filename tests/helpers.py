"""Helpers the test modules share (imported by name: `from helpers import compose_cfg`; pytest puts tests/ on
sys.path): the tiny training config every short run starts from, its metrics.csv, and the environment of a
`train.py` subprocess. Fixtures live in conftest.py."""

import csv
import os
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
# Two steps of 2 prompts x 2 samples x 4 new tokens; the last entry (top_p) is dropped by a sweep over top_p.
TINY = [
    "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=4",
    "checkpoint.every_n_steps=0", "trainer.enable_progress_bar=false", "rollout.top_p=0.9",
]


def compose_config(output_dir: Path, *overrides: str):
    """conf/config.yaml with its run dir at `output_dir` and `overrides` (later ones win), no tiny defaults."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"paths.output_dir={output_dir}", *overrides])


def compose_cfg(output_dir: Path, *overrides: str):
    """The tiny config (TINY) with `overrides` on top."""
    return compose_config(output_dir, *TINY, *overrides)


def read_metrics(output_dir: Path) -> list[dict[str, str]]:
    """The rows of a run's only csv/*/metrics.csv."""
    (path,) = output_dir.glob("csv/*/metrics.csv")
    with path.open() as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> list[float]:
    """`key`'s logged values, in row order (rows without it skipped)."""
    return [float(r[key]) for r in rows if r.get(key)]


def metric_columns(output_dir: Path) -> dict[str, list[float]]:
    """Every logged key of a run's metrics.csv -> its values, in row order."""
    rows = read_metrics(output_dir)
    return {key: column(rows, key) for key in {k for r in rows for k, v in r.items() if v}}


def train_env(**extra: str) -> dict[str, str]:
    """This process's environment for a `train.py` subprocess: W&B offline, no hub downloads, plus `extra`."""
    return dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", **extra)
