"""The run's loggers, built from `cfg.logger`: W&B mode, name, group, tags and resume; the config to every logger.

- W&B mode: `logger.wandb.mode` when set, else `WANDB_MODE` from the environment, else offline (`train.py`
  defaults the variable to offline, so nothing reaches the network unless a user opts in). Lightning's own
  `offline=True` is not used: it rewrites `WANDB_MODE` for the whole process, so an online run was impossible.
- Run name: `run_name`, plus the swept keys of a multirun job (`grpo-top_p0.8-seed0 [rollout.top_p=0.8]`),
  read from the sweep's `multirun.yaml` (Hydra writes it before the first job), so jobs are told apart.
- Group: `group`, else the sweep directory's name in multirun mode.
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

from topp_rl.rundir import wandb_run_id

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
    """W&B group: `group` when set, else the sweep directory's name in multirun mode, else none."""
    if cfg.get("group"):
        return str(cfg.group)
    hc = _hydra_config()
    return Path(hc.sweep.dir).name if _is_multirun(hc) else None


def swept_keys(sweep_overrides: list[str]) -> list[str]:
    """Keys the sweep varies (`a=1,2`, `b=range(3)`, `c=choice(x,y)`), in command-line order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(sweep_overrides)
    return [o.get_key_element() for o in parsed if o.is_sweep_override()]


def job_label(job_overrides: list[str], keys: list[str]) -> str:
    """`key=value` of the swept keys as this job set them, comma-separated (keys this job lacks are left out)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    values = {o.get_key_element(): o.get_value_element_as_str()
              for o in OverridesParser.create().parse_overrides(job_overrides)}
    return ",".join(f"{k}={values[k]}" for k in keys if k in values)


def run_display_name(cfg: DictConfig) -> str:
    """`run_name`, plus ` [k=v,...]` with the swept keys of a multirun job."""
    name = str(cfg.run_name)
    hc = _hydra_config()
    if not _is_multirun(hc):
        return name
    sweep = Path(hc.sweep.dir) / "multirun.yaml"
    job = list(hc.overrides.task)
    try:  # the sweep as typed: overrides plus hydra.sweeper.params (config-defined sweeps)
        recorded = OmegaConf.load(sweep).hydra
        typed = [f"{k}={v}" for k, v in (recorded.sweeper.get("params") or {}).items()]
        keys = swept_keys(typed + list(recorded.overrides.task))
    except (OSError, AttributeError):  # a sweeper that writes no multirun.yaml: name every override of the job
        keys = [o.split("=", 1)[0].lstrip("+~") for o in job]
    label = job_label(job, keys)
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
        loggers.append(instantiate(entry, _convert_="all", **kwargs))  # plain lists (tags) for the loggers
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
