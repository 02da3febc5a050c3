"""`train(cfg)`: build every part from the Hydra config, fit, and print an end-of-run summary.

Order: validate the config (fail in a second on a bad value), seed, build the policy + tokenizer, the rollout
engine (with its own copy of the weights, kept in sync by the `WeightSync` callback), the task and datamodule,
the module (loss from `algo.loss`, optimizer from `optimizer` as a partial), callbacks, loggers and the trainer.
Checkpoints go to `<output_dir>/checkpoints` (`last.ckpt`, atomic writes); `ckpt_path=last` resumes from there.
"""

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from topp_rl.callbacks.evaluation import Evaluation
from topp_rl.config import (
    callback_entries,
    engine_placement_mode,
    placement_of,
    validate_config,
    validate_replay,
    validate_with_model,
    weight_sync_of,
)
from topp_rl.parallel.placement import ENGINE_KEYS, render
from topp_rl.rollout import RolloutDataModule, RolloutEngine, SamplingParams
from topp_rl.rollout.record import rollout_recorder
from topp_rl.run import loggers as run_loggers
from topp_rl.run.checkpoint import AtomicCheckpointIO, RunRecord
from topp_rl.run.console import StepTimer, route_lightning_logs
from topp_rl.run.host_memory import keep_freed_memory
from topp_rl.run.loggers import LogConfig
from topp_rl.run.rundir import RunDir, resolve_ckpt_path
from topp_rl.run.stop import StopOnSignal, exit_status_on_signal
from topp_rl.run.summary import RunSummary, outputs_summary, print_summary, write_summary
from topp_rl.trainer.hook import ToppLogProb
from topp_rl.trainer.lora import build_policy_backbone, check_lora_config, engine_model_factory
from topp_rl.trainer.module import PolicyModule
from topp_rl.trainer.schedule import LRSchedule


@dataclass
class Run:
    """Everything `train` builds, so tests and the benchmark can reuse the construction."""

    cfg: DictConfig
    module: PolicyModule
    datamodule: RolloutDataModule
    trainer: L.Trainer
    summary: RunSummary
    loggers: list = field(default_factory=list)


def build_loggers(cfg: DictConfig) -> list:
    """The loggers of `cfg.logger` (W&B mode / name / group / resume: `topp_rl.run.loggers`)."""
    return run_loggers.build_loggers(cfg)


def build_callbacks(cfg: DictConfig, summary: RunSummary, *, loggers: list) -> list[Callback]:
    """`cfg.callbacks` in order (entries with `enabled: false` skipped), then the run's bookkeeping."""
    built = [_build(c) for c in map(_without_switch, callback_entries(cfg))]
    bars = [c for c in built if isinstance(c, ProgressBar)]
    callbacks = [c for c in built if not isinstance(c, ProgressBar)]
    callbacks.append(RunRecord(cfg))  # every checkpoint records the config (checked on resume)
    # SIGTERM / Ctrl-C: all ranks stop after the same step (LastCheckpoint saves it), bounded by a watchdog
    callbacks.append(StopOnSignal(run_dir=cfg.paths.output_dir, timeout_s=cfg.checkpoint.stop_timeout_s))
    if loggers:
        callbacks.append(LogConfig(cfg))  # the resolved config to every logger (W&B run config, hparams.yaml)
    callbacks.append(StepTimer())  # after the callbacks whose time a step includes (sync, eval, export)
    return [*callbacks, *bars, summary]  # the summary last: it reads what the others logged this step


def _build(entry: dict) -> Callback:
    try:
        return instantiate(entry)
    except InstantiationException as err:  # a callback's own check says what to fix; Hydra's wrapper does not
        if isinstance(err.__cause__, ValueError):
            raise err.__cause__ from None
        raise


def _without_switch(entry: DictConfig) -> dict:
    """The entry resolved in its config (its interpolations point outside it), less the `enabled` switch."""
    resolved = OmegaConf.to_container(entry, resolve=True)
    resolved.pop("enabled", None)
    return resolved


def engine_settings(cfg: DictConfig) -> DictConfig | dict:
    """`rollout.engine`, less the placement plan's keys where it has them (resolved then: `placement_of` reads
    them, the engine does not) and with its weight sync resolved by the placement (`weight_sync_of`)."""
    engine = cfg.rollout.engine
    if not any(key in engine for key in ENGINE_KEYS):
        return engine
    settings = OmegaConf.to_container(engine, resolve=True)
    if "weight_sync" in settings:
        settings["weight_sync"] = weight_sync_of(cfg)
    return {key: value for key, value in settings.items() if key not in ENGINE_KEYS}


def engine_for(cfg: DictConfig, policy, tokenizer, output_dir: Path, *,
               engine_model: Callable[[], torch.nn.Module] | None = None) -> Callable[[int], RolloutEngine]:
    """The engine factory the datamodule calls on each rank that generates (one per TP x CP group), once the
    process groups exist; each data-parallel rank's engine gets its own work dir and, where servers are placed
    (`placement_of`), its own servers' places. `engine_model`, when given, makes the model the engine is built on
    instead of `policy` (LoRA: the merged weights)."""
    factory = instantiate(engine_settings(cfg))
    placed = placement_kwargs(cfg)

    def build(dp_rank: int) -> RolloutEngine:
        model = engine_model() if engine_model is not None else policy
        return factory(model=model, tokenizer=tokenizer, workdir=output_dir / "engine" / f"dp{dp_rank}",
                       **placed(dp_rank))

    return build


def placement_kwargs(cfg: DictConfig) -> Callable[[int], dict]:
    """What the placement plan tells data-parallel rank d's engine: `colocated`, and `placed` (its servers' GPUs and
    memory fractions) on GPU runs; nothing for an engine without the placement keys."""
    mode = engine_placement_mode(cfg)
    if mode is None:
        return lambda dp_rank: {}
    placement = placement_of(cfg)

    def for_rank(dp_rank: int) -> dict:
        kwargs: dict = {"colocated": mode == "colocated"}
        if placement is not None:
            servers = placement.servers_of(dp_rank)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if servers[0].pushed_by != rank:
                raise RuntimeError(f"the placement plan gives data-parallel replica {dp_rank}'s servers to rank "
                                   f"{servers[0].pushed_by}, but rank {rank} builds its engine; the plan's rank order "
                                   "differs from the strategy's")
            kwargs["placed"] = servers
        return kwargs

    return for_rank


@rank_zero_only
def print_placement(cfg: DictConfig) -> None:
    """The placement block (SGLang servers on GPUs), once per run, before the layout line."""
    placement = placement_of(cfg)
    if placement is not None:
        print(render(placement, weight_sync=weight_sync_of(cfg)), flush=True)


def build_run(cfg: DictConfig, *, rewards: list[dict] | None = None) -> Run:
    """Every part of a run; `rewards` (entries whose `fn` may be a Python callable: `topp_rl.fit`) replace the
    task's configured reward functions."""
    validate_config(cfg, check_rewards=rewards is None)
    print_placement(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    policy, tokenizer = instantiate(cfg.model)
    policy.float()
    validate_with_model(cfg, policy)
    validate_replay(cfg, policy, tokenizer)
    lora = check_lora_config(cfg)
    # Built before the engine: with LoRA on (module.lora.rank > 0) it injects the adapters into `policy`.
    backbone = build_policy_backbone(policy, lora, gradient_checkpointing=cfg.module.gradient_checkpointing,
                                     routing_replay=cfg.rollout.routing_replay)
    shares = bool(cfg.rollout.engine.get("share_weights"))
    engine_factory = engine_for(cfg, policy, tokenizer, output_dir,
                                engine_model=engine_model_factory(backbone, shares_weights=shares))
    task = instantiate(cfg.task) if rewards is None else instantiate(cfg.task, _partial_=True)(rewards=rewards)
    params: SamplingParams = instantiate(cfg.rollout.sampling, _convert_="all")
    # Runtime objects go to partials: instantiate() would turn a dataclass kwarg into a DictConfig.
    datamodule = instantiate(cfg.data, _partial_=True)(engine=engine_factory, task=task, tokenizer=tokenizer,
                                                       params=params,
                                                       recorder=rollout_recorder(cfg, policy, tokenizer))
    loss = instantiate(cfg.algo.loss)
    hook = ToppLogProb(use_mask=cfg.module.use_mask, temperature=params.temperature)
    teacher = instantiate(cfg.teacher) if cfg.get("teacher") else None
    # A parallel strategy (MegatronStrategy) swaps in its sharded backbones at setup, from these weights.
    module = PolicyModule(
        policy=backbone, loss=loss, optimizer=instantiate(cfg.optimizer), hook=hook,
        **(teacher.module_parts(policy=policy, tokenizer=tokenizer, policy_name=_model_name(cfg)) if teacher else {}),
        ppo_epochs=cfg.module.ppo_epochs, grad_clip=cfg.module.grad_clip,
        lr_schedule=LRSchedule(**cfg.lr_schedule, total_steps=cfg.trainer.max_steps),
    )
    summary = RunSummary()
    loggers = build_loggers(cfg)
    strategy = instantiate(cfg.parallel.strategy) if cfg.parallel.get("strategy") else "auto"
    callbacks = build_callbacks(cfg, summary, loggers=loggers)
    # The bar is callbacks.progress (switched by trainer.enable_progress_bar); Lightning's own never shows.
    # The trainer config's own plugins (e.g. trainer=cpu_fp16's loss-scaled precision) beside the checkpoint IO.
    plugins = [AtomicCheckpointIO(), *instantiate(cfg.trainer.get("plugins") or [])]
    trainer = instantiate(cfg.trainer, _partial_=True)(
        callbacks=callbacks, logger=loggers or False, plugins=plugins, strategy=strategy,
        enable_checkpointing=True, enable_progress_bar=any(isinstance(c, ProgressBar) for c in callbacks),
    )
    return Run(cfg=cfg, module=module, datamodule=datamodule, trainer=trainer, summary=summary, loggers=loggers)


def _model_name(cfg: DictConfig) -> str:
    """The policy as a user named it: its checkpoint path, else the model config's builder."""
    return str(cfg.model.get("path") or cfg.model.get("_target_"))


def train(cfg: DictConfig) -> dict[str, float | str]:
    """Fit one run from a composed config; returns the summary figures (also printed), with the checkpoint the
    run resumed from and the one it leaves, each with its step."""
    return train_run(cfg)[1]


def train_run(cfg: DictConfig, *, rewards: list[dict] | None = None) -> tuple[Run, dict[str, float | str]]:
    """`train`, also returning the run it built (`topp_rl.fit` reads the trainer's last metrics from it)."""
    route_lightning_logs()
    # Lock the run dir and check a resume (checkpoint present, same config) before anything is built.
    with process_settings(cfg), RunDir(cfg) as run_dir:
        run = build_run(cfg, rewards=rewards)
        run_dir.record_config(cfg)  # config.yaml, or config.resume-<n>.yaml: the history is kept
        fit(run)
    summary = (run.summary.summary() | {"steps": run.trainer.global_step} | outputs_summary(run.trainer, run_dir)
               | evaluation_summary(run.trainer))
    if run.trainer.is_global_zero:
        write_summary(summary, Path(cfg.paths.output_dir) / "summary.json")
        print_summary(summary, str(cfg.paths.output_dir))
    return run, summary


def evaluation_summary(trainer: L.Trainer) -> dict[str, float | str]:
    """The last evaluation's figures with the best checkpoint (`Evaluation.summary`); empty without one."""
    return {k: v for c in trainer.callbacks if isinstance(c, Evaluation) for k, v in c.summary().items()}


@contextlib.contextmanager
def process_settings(cfg: DictConfig) -> Iterator[None]:
    """The config's process-wide settings for one run: torch's intra-op threads (restored after: tests run several
    trainings in one process) and host memory reuse (`topp_rl.run.host_memory`; kept: it changes no value)."""
    threads = torch.get_num_threads()
    try:
        if cfg.get("num_threads"):
            torch.set_num_threads(int(cfg.num_threads))
        if cfg.get("host_memory_reuse"):
            keep_freed_memory()
        yield
    finally:
        torch.set_num_threads(threads)


def fit(run: Run) -> None:
    # "last" resolved here: Lightning finds it only through a ModelCheckpoint, else silently starts from scratch.
    ckpt_path = resolve_ckpt_path(run.cfg.get("ckpt_path"), Path(run.cfg.paths.output_dir) / "checkpoints")
    try:
        with warnings.catch_warnings(), exit_status_on_signal(run.trainer):
            # The policy stays in eval mode on purpose (no dropout: the on-policy pass must match the rollout).
            warnings.filterwarnings("ignore", message=".*module\\(s\\) in eval mode.*")
            # Lightning 2.6 on torch >= 2.10 warns about its own pytree use on every fit; nothing for users to do.
            warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")
            run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt_path)
    finally:
        run.datamodule.close_engine()  # servers and their work dirs go with the run, also on errors
        for logger in run.loggers:  # a sweep runs its jobs in one process: close each W&B run
            if isinstance(logger, WandbLogger):
                logger.experiment.finish()
