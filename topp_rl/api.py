"""The Python API: `topp_rl.compose(overrides)` -> a config, `topp_rl.fit(overrides | config)` -> a `FitResult`.

`fit` runs the same `train` as `python train.py` / `topp-rl train`, from a notebook or a script: no `sys.exit`,
and Hydra's global state is entered and left inside `compose` (its context manager), so fit runs any number of
times in one process. Differences from the command line: the run dir is made absolute and, when Hydra names it
from the clock (`${now:...}` in `hydra.run.dir`, as the default does), no resume is asked (`ckpt_path`) and it
exists already (two runs started in the same second), gets a `-<n>` suffix; any other `hydra.run.dir` is used as
given, so `fit([..., "hydra.run.dir=D", "ckpt_path=last"])` resumes D, and a fresh start in a D holding a run is
refused. The job logging (`<run dir>/train.log`, console at WARNING) is set up for the run and undone after it
(`run_logging`).

Reward functions can be Python callables (`reward_fn=fn`, or `rewards=[fn, {"fn": fn, "weight": 0.1}]`): they
replace the task's configured rewards, and the run's config records them by their import name
(`module:qualname`), so `config.yaml` says what scored the run. They need a task that takes `rewards`
(`task=dataset`, `gsm8k`, `jsonl`); a callable is `fn(response, record) -> float | dict`, as a config one.
"""

import contextlib
import copy
import inspect
import itertools
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from topp_rl.paths import config_dir

DEFAULT_OUTPUT_DIR = "${hydra:runtime.output_dir}"  # conf/config.yaml's paths.output_dir
RewardSpec = Callable | Mapping[str, Any]
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # conf/hydra/job_logging/topp_rl.yaml's
LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")  # each may hold its own console handler


@dataclass(frozen=True)
class FitResult:
    """What a run left: its directory, the printed summary (`summary.json`), the last value of every logged
    metric, and the config it ran with."""

    run_dir: Path
    summary: dict[str, float | str]
    metrics: dict[str, float]
    config: DictConfig

    def __repr__(self) -> str:
        figures = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.summary.items())
        return f"FitResult(run_dir={str(self.run_dir)!r}, {len(self.metrics)} metrics, summary: {figures})"


def compose(overrides: Sequence[str] = (), *, config_name: str = "config") -> DictConfig:
    """The shipped config (`topp_rl.paths.config_dir()`) with Hydra `overrides`, as `topp-rl train` composes it,
    with `paths.output_dir` set to a concrete directory (the run dir `hydra.run.dir` names, absolute).

    `hydra.searchpath=[file:///my/conf]` among the overrides adds a config directory of your own (its groups'
    options beside the shipped ones, e.g. `experiment=mine` for /my/conf/experiment/mine.yaml)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3", job_name="train"):
        cfg = hydra_compose(config_name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        if _is_default_output_dir(cfg):
            from topp_rl.run.rundir import check_run_name

            check_run_name(cfg.get("run_name", ""))  # it names the run dir: `../x` would leave outputs/<date>/
            run_dir = Path(cfg.hydra.run.dir).absolute()
            cfg.paths.output_dir = str(_fresh_dir(run_dir) if _names_a_new_run(cfg) else run_dir)
        del cfg["hydra"]  # its `${hydra:...}` values resolve only inside a Hydra app
    return cfg


def fit(
    overrides: Sequence[str] = (),
    *,
    config: DictConfig | None = None,
    reward_fn: Callable | None = None,
    rewards: Sequence[RewardSpec] | None = None,
) -> FitResult:
    """Train one run from `overrides` (Hydra's, as on the command line) or a composed `config` (`compose`), with
    optional Python reward functions replacing the task's; returns the run's `FitResult`."""
    if config is not None and overrides:
        raise ValueError(f"pass overrides ({list(overrides)}) or config, not both; apply the overrides with "
                         "topp_rl.compose(overrides) and edit that config")
    if reward_fn is not None and rewards is not None:
        raise ValueError("pass reward_fn (one function) or rewards (several), not both")
    cfg = compose(overrides) if config is None else copy.deepcopy(config)
    refuse_several_processes(cfg)
    if _is_default_output_dir(cfg):
        raise ValueError(f"config's paths.output_dir is {DEFAULT_OUTPUT_DIR}, which only a Hydra app resolves; "
                         "compose the config with topp_rl.compose(overrides), or set cfg.paths.output_dir")
    entries = reward_entries([reward_fn] if reward_fn is not None else rewards)
    if entries is not None:
        record_rewards(cfg, entries)
    from topp_rl.train import train_run  # Lightning and the models load here, not on `import topp_rl`

    with run_logging(Path(cfg.paths.output_dir)):
        run, summary = train_run(cfg, rewards=entries)
    metrics = {k: float(v) for k, v in run.trainer.callback_metrics.items()}
    return FitResult(run_dir=Path(cfg.paths.output_dir), summary=summary, metrics=metrics, config=cfg)


def refuse_several_processes(cfg: DictConfig) -> None:
    """`fit` trains in this process: Lightning starts the other ranks of a multi-device run by re-running the
    command line (`sys.argv`), which in a notebook or `python -c` is not the run; `topp-rl train` is."""
    from topp_rl.config import world_size

    world = world_size(cfg)
    if world > 1:
        raise ValueError(
            f"topp_rl.fit runs one process, and trainer.devices x trainer.num_nodes is {world}: Lightning would "
            "start the other ranks by re-running this process's command line. Run multi-device jobs with the "
            "command (topp-rl train ... or python train.py ...), or set trainer.devices=1"
        )


def reward_entries(specs: Sequence[RewardSpec] | None) -> list[dict[str, Any]] | None:
    """Reward entries (`task.rewards` form) for Python callables: `fn`, or `{"fn": fn, "weight": ..., "name":
    ..., "batched": ..., "kwargs": ...}`; each is named after its function unless named."""
    if specs is None:
        return None
    if isinstance(specs, str | Mapping) or callable(specs) or not specs:
        raise ValueError(f"rewards ({specs!r}) must be a non-empty list of functions or {{fn: function, weight: "
                         "...}} entries; pass one function as reward_fn=")
    entries = []
    for i, spec in enumerate(specs):
        entry = {"fn": spec} if callable(spec) else dict(spec) if isinstance(spec, Mapping) else None
        if entry is None or not callable(entry.get("fn")):
            raise ValueError(f"rewards[{i}] ({spec!r}) is not a function nor an entry whose fn is one; config "
                             "strings ('pkg.mod:fn') go in the overrides: task.reward_fn=pkg.mod:fn")
        entry.setdefault("name", getattr(entry["fn"], "__name__", f"reward{i}").strip("<>"))
        entries.append(entry)
    return entries


def record_rewards(cfg: DictConfig, entries: list[dict[str, Any]]) -> None:
    """Write the callables' import names into `cfg.task` (the run's config.yaml), for a task that takes rewards."""
    from topp_rl.config import target_class

    task_class = target_class(cfg.task)
    if "rewards" not in inspect.signature(task_class).parameters:
        raise ValueError(
            f"Python reward functions replace a task's `rewards`, and task {task_class.__name__} (task._target_) "
            "takes none: use a dataset task (task=dataset task.path=FILE, task=gsm8k), or a task class of your own "
            "whose reward method calls your function"
        )
    with open_dict(cfg):
        cfg.task.reward_fn = None
        cfg.task.rewards = [{**entry, "fn": import_name(entry["fn"])} for entry in entries]


def import_name(fn: Callable) -> str:
    """`module:qualname` of a function (`__main__:score` for one defined in a notebook or a script)."""
    return f"{getattr(fn, '__module__', None) or '?'}:{getattr(fn, '__qualname__', type(fn).__name__)}"


@contextlib.contextmanager
def run_logging(run_dir: Path):
    """The command line's job logging for one run, undone on exit: every log line at INFO into
    `<run dir>/train.log`; the console gets WARNING and above (Lightning's INFO lines, accelerator found and tips,
    only the file), through the caller's own root handlers when it has some."""
    from topp_rl.run.rundir import check_run_dir_writable

    check_run_dir_writable(run_dir)  # before the log file opens in it: a clear error naming the dir
    root = logging.getLogger()
    touched = [root, *(logging.getLogger(name) for name in LIGHTNING_LOGGERS)]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in touched]
    log_file = logging.FileHandler(run_dir / "train.log")
    log_file.setFormatter(logging.Formatter(LOG_FORMAT))
    added = [log_file]
    if not root.handlers:  # a bare script: a console like the command line's (a notebook keeps its own)
        console = logging.StreamHandler(sys.stdout)
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter(LOG_FORMAT))
        added.append(console)
    for handler in added:
        root.addHandler(handler)
    root.setLevel(min(root.level or logging.WARNING, logging.INFO))
    for lg in touched[1:]:  # Lightning's own console handlers go: its lines reach the root's, once
        for handler in list(lg.handlers):
            lg.removeHandler(handler)
        lg.propagate = True
    try:
        yield
    finally:
        log_file.close()
        for lg, handlers, level, propagate in saved:
            for handler in list(lg.handlers):
                lg.removeHandler(handler)
            for handler in handlers:
                lg.addHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


def _is_default_output_dir(cfg: DictConfig) -> bool:
    node = cfg.paths._get_node("output_dir")
    return node is not None and node._value() == DEFAULT_OUTPUT_DIR


def _names_a_new_run(cfg: DictConfig) -> bool:
    """`hydra.run.dir` is named from the clock (`${now:...}`) and no resume is asked: an existing dir of that name is
    another run started in the same second, not one the user named. A dir named outright is the user's choice:
    resumed with `ckpt_path`, refused by the run dir's own check when it holds a run."""
    return "${now:" in str(cfg.hydra.run._get_node("dir")._value()) and not cfg.get("ckpt_path")


def _fresh_dir(path: Path) -> Path:
    """`path`, or `path-1`, `path-2`, ... when it exists (two fits in the same second share a default name)."""
    candidates = itertools.chain([path], (path.with_name(f"{path.name}-{n}") for n in itertools.count(1)))
    return next(p for p in candidates if not p.exists())
