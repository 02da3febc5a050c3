"""The run's loggers, built from `cfg.logger`: W&B mode, name, group, tags and resume; the config to every logger.

- W&B mode: `logger.wandb.mode` when set, else `WANDB_MODE` from the environment, else offline (`train.py`
  defaults the variable to offline, so nothing reaches the network unless a user opts in). Lightning's own
  `offline=True` is not used: it rewrites `WANDB_MODE` for the whole process, so an online run was impossible.
- Run name: `<task>-<model>-<run_name>` (the config group choices, as in the run dir's name; `run_name` alone
  outside a Hydra app), plus the swept keys of a multirun job (`copy_digit-tiny-grpo-top_p0.8-seed0
  [rollout.top_p=0.8]`), so jobs are told apart (`topp_rl.run.sweep` reads the swept keys from the sweep's
  `multirun.yaml`).
- Group: `group`, else in multirun mode the sweep, named by its dir and swept keys
  (`2026-12-02_14-05-09-copy_digit-tiny [rollout.top_p,algo]`).
- One W&B run id per run dir (`<run dir>/wandb_id`): a resume appends to the same run.
- `LogConfig` hands every logger the resolved config at fit start (`log_hyperparams`: the W&B run config, the
  CSV and TensorBoard `hparams.yaml`).
"""

import os
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf

from topp_rl.run.rundir import wandb_run_id
from topp_rl.run.sweep import group_label, job_label, sweep_keys_of, task_model_label

WANDB_MODES = ("online", "offline", "disabled")


def wandb_mode(configured: str | None, env: str | None) -> str:
    """The W&B mode: the configured one, else the environment's (WANDB_MODE), else offline."""
    mode = configured or env or "offline"
    mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)  # W&B's older spellings
    if mode not in WANDB_MODES:
        source = "logger.wandb.mode" if configured else "WANDB_MODE"
        raise ValueError(f"{source}={mode!r} is not a W&B mode; use one of {', '.join(WANDB_MODES)}")
    return mode


def _hydra_config():
    """Hydra's runtime config, or None outside a Hydra app (a test composing the config itself)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get()
    except ValueError:
        return None


def _is_multirun(hc) -> bool:
    from hydra.types import RunMode

    return hc is not None and hc.mode == RunMode.MULTIRUN


def group_name(cfg: DictConfig) -> str | None:
    """W&B group: `group` when set, else in multirun mode the sweep (`<sweep id> [<swept keys>]`), else none."""
    if cfg.get("group"):
        return str(cfg.group)
    hc = _hydra_config()
    if not _is_multirun(hc):
        return None
    return group_label(hc.sweep.dir, sweep_keys_of(hc.sweep.dir, list(hc.overrides.task)))


def run_display_name(cfg: DictConfig) -> str:
    """`<task>-<model>-<run_name>` in a Hydra app (`run_name` outside one: no group choices), plus ` [k=v,...]`
    with the swept keys of a multirun job."""
    name = str(cfg.run_name)
    hc = _hydra_config()
    if hc is None:
        return name
    choices = hc.runtime.choices
    task_model = task_model_label(choices.get("task"), choices.get("model"),
                                  OmegaConf.select(cfg, "model.path", default=None))
    name = f"{task_model}-{name}"
    if not _is_multirun(hc):
        return name
    job = list(hc.overrides.task)
    label = job_label(job, sweep_keys_of(hc.sweep.dir, job))
    return f"{name} [{label}]" if label else name


def build_loggers(cfg: DictConfig) -> list:
    """One Lightning logger per non-null entry of `cfg.logger`."""
    loggers = []
    for name, entry in (cfg.get("logger") or {}).items():
        if entry is None:
            continue
        kwargs: dict[str, Any] = {}
        if name == "wandb":  # one W&B run id per run dir: a resume appends to it instead of starting another run
            kwargs = {
                "name": run_display_name(cfg), "group": group_name(cfg), "mode": wandb_mode(
                    entry.get("mode"), os.environ.get("WANDB_MODE")),
                "id": wandb_run_id(Path(cfg.paths.output_dir)), "resume": "allow",
            }
        require_logger_packages(name, entry)
        logger = instantiate(entry, _convert_="all", **kwargs)  # plain lists (tags) for the loggers
        if name == "wandb":
            # Lightning passes wandb.init anonymous=None whatever is asked, and W&B >= 0.22 warns on every run that
            # the setting has no effect; the key is left out instead (Lightning keeps its init kwargs here).
            logger._wandb_init.pop("anonymous", None)
        loggers.append(logger)
    return loggers


def _packages() -> dict[type, tuple[tuple[str, ...], str]]:
    """Per Lightning logger class: the packages it imports (any one of them), and how to install one."""
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    return {
        WandbLogger: (("wandb",), "pip install wandb"),
        TensorBoardLogger: (("tensorboard", "tensorboardX"), "pip install 'topp_rl[tensorboard]' (or pip install "
                                                             "tensorboard)"),
    }


def require_logger_packages(name: str, entry: DictConfig) -> None:
    """A logger whose package cannot be imported fails here naming it and the install command; Lightning's own
    check reads the package metadata only, so a broken or missing import surfaced later as a bare ImportError."""
    import importlib

    from hydra.utils import get_object

    cls = get_object(str(entry._target_))
    for base, (modules, install) in _packages().items():
        if not (isinstance(cls, type) and issubclass(cls, base)):
            continue
        errors = []
        for module in modules:
            try:
                importlib.import_module(module)
                return
            except ImportError as err:
                errors.append(f"{module}: {err}")
        raise ValueError(
            f"logger={name} needs the {' or '.join(modules)} package, which cannot be imported ({'; '.join(errors)}); "
            f"run `{install}`, or pick another logger (logger=csv)"
        )


class LogConfig(Callback):
    """Hands every logger the run's resolved config at fit start (rank 0: loggers write there only)."""

    def __init__(self, cfg: DictConfig) -> None:
        self.config = OmegaConf.to_container(cfg, resolve=True)

    def on_fit_start(self, trainer, pl_module) -> None:
        for logger in trainer.loggers:
            logger.log_hyperparams(self.config)
