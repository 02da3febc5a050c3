"""Config validation at start: every user-facing number is checked before any model or engine is built.

Each error names the key, its value, the constraint and the fix, so a bad sweep value fails in a second instead
of deep inside a rollout step. The sampling rules are the ops' own (`topp_rl.ops.SAMPLING_RULES`); what a part
can do is asked of its class (`_target_`), never guessed from names.
"""

from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig

from topp_rl.ops import SAMPLING_RULES, check_sampling_value


def _fail(key: str, value, constraint: str, fix: str) -> None:
    raise ValueError(f"config {key}={value!r}: must be {constraint}; {fix}")


def _number(cfg: DictConfig, key: str, *, kind: type = float) -> Any:
    """`cfg[key]` (a dotted path) as an int or float; bools and strings fail naming the key."""
    value = cfg
    for part in key.split("."):
        value = value[part]
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or (kind is int and not isinstance(value, int)):
        _fail(key, value, "an integer" if kind is int else "a number", f"set {key} to a {kind.__name__} value")
    return value


def _positive_int(cfg: DictConfig, key: str, fix: str) -> int:
    value = _number(cfg, key, kind=int)
    if value < 1:
        _fail(key, value, "an integer >= 1", fix)
    return value


def target_class(node: DictConfig) -> Any:
    """The class a `_target_` entry builds (a `Class.factory` classmethod target resolves to its class)."""
    target = get_object(str(node["_target_"]))
    return getattr(target, "__self__", target)


def _world_size(cfg: DictConfig) -> int:
    devices = cfg.trainer.get("devices", 1)
    nodes = cfg.trainer.get("num_nodes", 1)
    if isinstance(devices, int) and isinstance(nodes, int):
        return devices * nodes
    return 1  # "auto" / device lists: checked again by Lightning once the devices are known


def validate_sampling(cfg: DictConfig) -> None:
    for rule in SAMPLING_RULES:
        try:
            check_sampling_value(rule, cfg.rollout[rule.name], key=f"config rollout.{rule.name}")
        except ValueError as err:
            raise ValueError(str(err).replace(" must be ", ": must be ", 1)) from None
    for key in ("n_samples", "max_new_tokens", "prompts_per_step"):
        _positive_int(cfg, f"rollout.{key}", f"set rollout.{key} to a positive integer")


def validate_parallel(cfg: DictConfig) -> None:
    p, world = cfg.parallel, _world_size(cfg)
    for key in ("tp_size", "cp_size"):
        _positive_int(cfg, f"parallel.{key}", f"use parallel.{key}=1 to disable it")
    if p.cp_mode not in ("zigzag", "allgather"):
        _fail("parallel.cp_mode", p.cp_mode, "'zigzag' or 'allgather'", "pick one of the two layouts")
    if p.get("strategy") and p.cp_size > 1 and p.cp_mode != "zigzag":
        _fail("parallel.cp_mode", p.cp_mode, "'zigzag' with the Megatron backbone (Megatron's THD RoPE and "
              "transformer-engine's CP attention assume the zigzag split; all-gather CP exists only in the ops)",
              "use parallel.cp_mode=zigzag")
    if p.get("strategy") and cfg.module.get("gradient_checkpointing"):
        _fail("module.gradient_checkpointing", True, "false with the Megatron backbone (it is the HF backbone's "
              "layer recompute; the Megatron model is built without it)", "set module.gradient_checkpointing=false")
    model_parallel = p.tp_size * p.cp_size
    if world % model_parallel:
        _fail("parallel.tp_size * parallel.cp_size", model_parallel,
              f"a divisor of the world size ({world} = trainer.devices * trainer.num_nodes)",
              "change trainer.devices or the parallel sizes")
    dp = world // model_parallel
    prompts = cfg.rollout.prompts_per_step
    if prompts % dp:
        _fail("rollout.prompts_per_step", prompts, f"divisible by the data-parallel size ({dp})",
              f"use a multiple of {dp}, so that every rank gets whole prompt groups")
    if world > 1 and not p.get("strategy"):
        # PolicyModule runs several backward passes per DDP forward (one per micro-batch); plain DDP is
        # not wired for that, so multi-rank runs need a parallel/ config that brings its own strategy.
        _fail("trainer.devices * trainer.num_nodes", world, "1 with parallel=none (plain DDP is not supported)",
              "use trainer.devices=1, or a parallel/ config with a strategy (e.g. the Megatron ones)")


def validate_weight_sync(cfg: DictConfig) -> None:
    """Without a weight sync the engine keeps sampling with the initial weights: every step after the first
    trains off-policy while the config claims on-policy updates. Refused unless asked for explicitly."""
    from callbacks.weight_sync import WeightSync

    entries = [c for c in (cfg.get("callbacks") or {}).values() if c is not None]
    if any(issubclass(target_class(c), WeightSync) for c in entries) or cfg.get("allow_stale_weights"):
        return
    _fail("callbacks.weight_sync", None, "a WeightSync callback (the engine must sample with the trained weights "
          "for on-policy training)", "keep callbacks.weight_sync, or set allow_stale_weights=true to train "
          "off-policy against the initial weights on purpose")


def validate_overlap(cfg: DictConfig) -> None:
    """rollout.overlap=true trains each step on samples one weight update old: the engine must keep its own
    weights while the trainer updates, and the loss must correct the gap."""
    overlap = cfg.rollout.get("overlap", False)
    if not isinstance(overlap, bool):
        _fail("rollout.overlap", overlap, "true or false", "set rollout.overlap=true or false")
    if not overlap:
        return
    if cfg.rollout.engine.get("share_weights"):
        _fail("rollout.engine.share_weights", True, "false with rollout.overlap=true (the next step is generated "
              "while this one updates the weights)", "set rollout.engine.share_weights=false (the embedded engine "
              "keeps its own copy), or use rollout=sglang")
    loss = cfg.algo.get("loss") or {}
    if loss.get("tis_cap") is None and loss.get("icepop_low") is None:
        _fail("algo.loss.tis_cap", None, "set with rollout.overlap=true (samples come from the policy one update "
              "back; the importance ratio to it needs a correction)",
              "set algo.loss.tis_cap=2.0 (or algo.loss.icepop_low=0.5 algo.loss.icepop_high=2.0)")


def validate_config(cfg: DictConfig) -> None:
    """Raise ValueError on the first invalid setting (see module docstring)."""
    validate_sampling(cfg)
    validate_weight_sync(cfg)
    validate_overlap(cfg)
    advantage = target_class(cfg.algo.advantage)
    if advantage.group_relative and cfg.rollout.n_samples < 2:
        _fail("rollout.n_samples", cfg.rollout.n_samples, f">= 2 with {advantage.__name__} (algo={cfg.algo.name}: "
              "group-relative advantages are all zero with one sample per prompt)",
              "use rollout.n_samples=4 or more, or a batch baseline (algo.advantage._target_=...BatchAdvantage)")
    _positive_int(cfg, "trainer.max_steps", "set the number of rollout steps")
    _positive_int(cfg, "module.ppo_epochs", "use 1 for on-policy updates")
    if not _number(cfg, "optimizer.lr") > 0:
        _fail("optimizer.lr", cfg.optimizer.lr, "> 0", "use e.g. optimizer.lr=1e-3 for the tiny model")
    budget = _number(cfg, "data.max_tokens_per_micro_batch", kind=int)
    if budget < cfg.rollout.max_new_tokens + 1:
        _fail("data.max_tokens_per_micro_batch", budget,
              f"> rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) plus the prompt length",
              "raise the token budget so that one whole sample fits in a micro-batch")
    validate_parallel(cfg)
