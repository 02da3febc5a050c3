"""Config validation at start: every user-facing number is checked before any model or engine is built.

Each error names the key, its value, the constraint and the fix, so a bad sweep value fails in a second instead
of deep inside a rollout step. The sampling checks mirror `SamplingParams` so that a command line override
(`rollout.top_p=1.2`) fails here, before the model is loaded.
"""

from omegaconf import DictConfig


def _fail(key: str, value, constraint: str, fix: str) -> None:
    raise ValueError(f"config {key}={value!r}: must be {constraint}; {fix}")


def _world_size(cfg: DictConfig) -> int:
    devices = cfg.trainer.get("devices", 1)
    nodes = cfg.trainer.get("num_nodes", 1)
    if isinstance(devices, int) and isinstance(nodes, int):
        return devices * nodes
    return 1  # "auto" / device lists: checked again by Lightning once the devices are known


def validate_sampling(r: DictConfig) -> None:
    if not r.temperature > 0:
        _fail("rollout.temperature", r.temperature, "> 0", "use e.g. rollout.temperature=1.0")
    if not 0 < r.top_p <= 1:
        _fail("rollout.top_p", r.top_p, "in (0, 1]", "use rollout.top_p=1.0 to disable top-p")
    if not (isinstance(r.top_k, int) and r.top_k >= 0):
        _fail("rollout.top_k", r.top_k, "an integer >= 0", "use rollout.top_k=0 to disable top-k")
    if not 0 <= r.min_p < 1:
        _fail("rollout.min_p", r.min_p, "in [0, 1)", "use rollout.min_p=0.0 to disable min-p")
    for key in ("n_samples", "max_new_tokens", "prompts_per_step"):
        if not (isinstance(r[key], int) and r[key] >= 1):
            _fail(f"rollout.{key}", r[key], "an integer >= 1", f"set rollout.{key} to a positive integer")


def validate_parallel(cfg: DictConfig) -> None:
    p, world = cfg.parallel, _world_size(cfg)
    for key in ("tp_size", "cp_size"):
        if not (isinstance(p[key], int) and p[key] >= 1):
            _fail(f"parallel.{key}", p[key], "an integer >= 1", f"use parallel.{key}=1 to disable it")
    if p.cp_mode not in ("zigzag", "allgather"):
        _fail("parallel.cp_mode", p.cp_mode, "'zigzag' or 'allgather'", "pick one of the two layouts")
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
    if model_parallel > 1 and "sglang" in str(cfg.rollout.engine.get("_target_", "")):
        # TP/CP peers must train on identical rollouts; SGLang on CPU ignores seeds, so each peer's server
        # would sample different tokens for the same prompts.
        _fail("rollout", "sglang", f"the embedded engine when parallel.tp_size * parallel.cp_size > 1 "
              f"(here {model_parallel})", "use rollout=embedded with tensor/context parallelism")
    if world > 1 and not p.get("strategy"):
        # PolicyModule runs several backward passes per DDP forward (one per micro-batch); plain DDP is
        # not wired for that, so multi-rank runs need a parallel/ config that brings its own strategy.
        _fail("trainer.devices * trainer.num_nodes", world, "1 with parallel=none (plain DDP is not supported)",
              "use trainer.devices=1, or a parallel/ config with a strategy (e.g. the Megatron ones)")


def validate_config(cfg: DictConfig) -> None:
    """Raise ValueError on the first invalid setting (see module docstring)."""
    validate_sampling(cfg.rollout)
    if cfg.algo.group_relative and cfg.rollout.n_samples < 2:
        _fail("rollout.n_samples", cfg.rollout.n_samples, f">= 2 for algo={cfg.algo.name} (group-relative "
              "advantages are all zero with one sample per prompt)", "use rollout.n_samples=4 or more")
    if not (isinstance(cfg.trainer.max_steps, int) and cfg.trainer.max_steps >= 1):
        _fail("trainer.max_steps", cfg.trainer.max_steps, "an integer >= 1", "set the number of rollout steps")
    if not (isinstance(cfg.module.ppo_epochs, int) and cfg.module.ppo_epochs >= 1):
        _fail("module.ppo_epochs", cfg.module.ppo_epochs, "an integer >= 1", "use 1 for on-policy updates")
    if not cfg.optimizer.lr > 0:
        _fail("optimizer.lr", cfg.optimizer.lr, "> 0", "use e.g. optimizer.lr=1e-3 for the tiny model")
    if cfg.data.max_tokens_per_micro_batch < cfg.rollout.max_new_tokens + 1:
        _fail("data.max_tokens_per_micro_batch", cfg.data.max_tokens_per_micro_batch,
              f"> rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) plus the prompt length",
              "raise the token budget so that one whole sample fits in a micro-batch")
    validate_parallel(cfg)
