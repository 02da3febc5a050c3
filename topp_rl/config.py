"""Config validation at start: every user-facing number is checked before any model or engine is built.

Each error names the key, its value, the constraint and the fix, so a bad sweep value fails in a second instead
of deep inside a rollout step. The sampling rules are the ops' own (`topp_rl.ops.SAMPLING_RULES`); what a part
can do is asked of its class (`_target_`), never guessed from names.
"""

import dataclasses
import difflib
import inspect
import json
import logging
import math
import typing
from dataclasses import dataclass
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue

from topp_rl.callbacks.weight_sync import WeightSync
from topp_rl.config_keys import parallel_keys, validate_known_keys
from topp_rl.data.params import SamplingParams
from topp_rl.engines.base import RolloutEngine
from topp_rl.engines.serving.client import MAX_RETRIES, MAX_WAIT_S, Retries, Timeouts
from topp_rl.engines.vllm import VLLMEngine
from topp_rl.engines.vllm.engine import check_kept_sets
from topp_rl.engines.vllm.weights import SYNC_METHODS as VLLM_SYNC_METHODS
from topp_rl.models.moe import moe_routing
from topp_rl.ops import SAMPLING_RULES, check_sampling_value
from topp_rl.parallel.capabilities import StrategyCapabilities, capabilities_of
from topp_rl.parallel.placement import ENGINE_KEYS, Placement, plan_placement
from topp_rl.parallel.plan import ParallelPlan
from topp_rl.rollout.agent_step import AgentLoopStep
from topp_rl.rollout.endpoint.step import EndpointStep
from topp_rl.rollout.overlong import Overlong
from topp_rl.rollout.record import Manifest, PolicyIdentity, recorded_settings
from topp_rl.rollout.refill import check_refill
from topp_rl.rollout.replay import ReplayEngine, recorded_steps
from topp_rl.rollout.scheduler.staleness import check_staleness_key
from topp_rl.rollout.trajectory import check_context
from topp_rl.tasks.agent_task import resolve_agent
from topp_rl.tasks.environment import check_environment_config
from topp_rl.tasks.reward_import import check_reward_config
from topp_rl.teacher.sglang import SGLangTeacher

log = logging.getLogger(__name__)

# Keys read with `if value:` / passed on as flags: a string such as "yes" would be truthy (and "false" too).
BOOLEAN_KEYS = (
    "allow_stale_weights", "module.use_mask", "module.gradient_checkpointing", "rollout.overlap",
    "rollout.engine.share_weights", "rollout.engine.router", "rollout.engine.progress", "export.hf",
    "export.on_checkpoint", "resume.allow_config_change", "data.drop_zero_variance_groups",
    "data.refill", "rollout.partial_rollouts",
    "trainer.enable_progress_bar", "rollout.record_routes", "rollout.routing_replay", "host_memory_reuse",
    "rollout.record",
    "teacher.use_candidate_mask",
)
# Below this, a capped engine (SGLangEngine) aborts every sample a truncating sampler keeps two ids for
# (`validate_sglang_candidates`).
SGLANG_MIN_CANDIDATES = 2


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


@dataclass(frozen=True)
class NumberRange:
    """The values a numeric key may take: finite, an integer where `integer`, in [low, high] ((low, high] where
    `low_open`), and an example value for the fix."""

    low: float
    high: float
    example: float
    integer: bool = False
    low_open: bool = False
    unit: str = ""

    def holds(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        if self.integer and not isinstance(value, int):
            return False
        return (value > self.low if self.low_open else value >= self.low) and value <= self.high

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        unit = f" of {self.unit}" if self.unit else ""
        return f"{kind}{unit} in {'(' if self.low_open else '['}{_plain(self.low)}, {_plain(self.high)}]"


def _plain(x: float) -> str:
    """A bound as typed: 86400, 2147483647, 0.5 (not 86400.0 or 2.14748e+09)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _seconds(example: float, *, zero_ok: bool = False) -> NumberRange:
    """A wait: finite, at most a day (`MAX_WAIT_S`, the serving client's own bound), > 0 unless `zero_ok`."""
    return NumberRange(0, MAX_WAIT_S, example, low_open=not zero_ok, unit="seconds")


def _count(low: int, high: int, example: int) -> NumberRange:
    return NumberRange(low, high, example, integer=True)


# Every numeric key of the engine groups (rollout/embedded, rollout/sglang, rollout/step/*), shipped or one `+` may
# add that the constructor reads; checked where present. Waits are finite and at most a day, counts sane.
ENGINE_NUMBERS: dict[str, NumberRange] = {
    **{f"rollout.engine.timeouts.{f.name}": _seconds(f.default, zero_ok=f.name in Timeouts.ALLOWANCES)
       for f in dataclasses.fields(Timeouts)},
    "rollout.engine.retries.max_retries": _count(0, MAX_RETRIES, Retries.max_retries),
    "rollout.engine.retries.backoff_s": _seconds(Retries.backoff_s, zero_ok=True),
    "rollout.engine.retries.max_backoff_s": _seconds(Retries.max_backoff_s, zero_ok=True),
    "rollout.engine.num_servers": _count(1, 1024, 1),
    "rollout.engine.tp_size": _count(1, 64, 1),  # GPUs per server, on one node
    "rollout.engine.weight_bucket_bytes": _count(1, 2**40, 536870912),
    "rollout.engine.max_concurrency": _count(1, 65536, 64),
    "rollout.engine.max_batch_size": _count(1, 65536, 64),
    "rollout.engine.progress_interval_s": _seconds(30, zero_ok=True),
    "rollout.engine.router_kwargs.max_retries": _count(0, MAX_RETRIES, 3),
    "rollout.engine.router_kwargs.max_backoff_ms": _count(1, int(MAX_WAIT_S * 1000), 2000),
    "rollout.engine.router_kwargs.health_check_interval_s": _count(1, int(MAX_WAIT_S), 5),
    "rollout.engine.router_kwargs.startup_timeout_s": _seconds(60),
    "rollout.engine.server_kwargs.max_total_tokens": _count(1, 2**31 - 1, 8192),
    "rollout.engine.server_kwargs.startup_timeout_s": _seconds(240),
    "rollout.engine.server_kwargs.progress_interval_s": _seconds(30, zero_ok=True),
    "rollout.step.env_timeout_s": _seconds(30),
    "rollout.step.agent_timeout_s": _seconds(120),
    "rollout.step.max_failed_frac": NumberRange(0, 1, 0.5),
}


def validate_engine_numbers(cfg: DictConfig) -> None:
    """Every `ENGINE_NUMBERS` key the config sets lies in its range: `abc`, `inf` and a billion retries fail
    here naming the key, not as a TypeError when the engine or step is built, or as a wait without end."""
    for key, allowed in ENGINE_NUMBERS.items():
        parent, _, name = key.rpartition(".")
        node = OmegaConf.select(cfg, parent, default=None)
        if not isinstance(node, DictConfig) or name not in node:
            continue
        value = node[name]
        if not allowed.holds(value):
            _fail(key, value, allowed.describe(), f"set {key} in that range, e.g. {key}={_plain(allowed.example)}")


def target_class(node: DictConfig) -> Any:
    """The class a `_target_` entry builds (a `Class.factory` classmethod target resolves to its class)."""
    target = get_object(str(node["_target_"]))
    return getattr(target, "__self__", target)


def world_size(cfg: DictConfig) -> int:
    """trainer.devices x trainer.num_nodes where both are integers (else 1: Lightning checks once it knows)."""
    devices = cfg.trainer.get("devices", 1)
    nodes = cfg.trainer.get("num_nodes", 1)
    if isinstance(devices, int) and isinstance(nodes, int):
        return devices * nodes
    return 1  # "auto" / device lists: checked again by Lightning once the devices are known


def target_parameters(target: str) -> list[str] | None:
    """The keyword names a `_target_` accepts; None when it takes any (**kwargs). A `Class.factory` classmethod
    taking **kwargs passes them on to the class (the engines' `for_policy` do), so the class's own names count."""
    obj = get_object(target)
    names, open_ended = _signature_names(obj)
    owner = getattr(obj, "__self__", None)
    if open_ended and isinstance(owner, type):
        init_names, open_ended = _signature_names(owner)
        names += [n for n in init_names if n not in names]
    return None if open_ended else names


def _signature_names(obj: Any) -> tuple[list[str], bool]:
    """(the parameter names of `obj`'s signature but self, in order; whether it takes **kwargs). A class's are its
    `__init__`'s, which gets every keyword (a `__new__` that picks a subclass may take **kwargs)."""
    params = inspect.signature(obj.__init__ if isinstance(obj, type) else obj).parameters.values()
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


# Engine keys that moved into a nested group (issue 36: one shape for the serving limits): old name -> new path.
MOVED_KEYS = {f"{name}_timeout_s": f"timeouts.{name}_s"
              for name in ("connect", "first_byte", "per_token", "transfer", "weight_update", "per_gb")}


def validate_target_kwargs(node: DictConfig, path: str) -> None:
    """The keys of the `_target_` node at `path` must be parameters of its target, unless that takes **kwargs:
    Hydra's `+` adds any key, and the constructor would fail with a raw TypeError only when it is called (the
    trainer and optimizer after the model loaded and the engine started)."""
    params = target_parameters(str(node._target_))
    if params is None:
        return
    for key in node:
        if str(key).startswith("_") or key in params or (key == "enabled" and path.startswith("callbacks.")):
            continue  # Hydra's own keys; a callback entry's switch is read by train.py, not passed on
        if path == "rollout.engine" and key in ENGINE_KEYS:
            continue  # the placement plan's (`placement_of`), not passed on
        if key in MOVED_KEYS and MOVED_KEYS[key].split(".")[0] in params:
            _fail(f"{path}.{key}", node._get_node(key)._value(), f"absent: it moved to {path}.{MOVED_KEYS[key]}",
                  f"set {path}.{MOVED_KEYS[key]} instead")
        near = difflib.get_close_matches(str(key), sorted(params), n=1, cutoff=0.5)
        _fail(f"{path}.{key}", node._get_node(key)._value(),
              f"a parameter of {node._target_} ({', '.join(params)})",
              (f"did you mean {path}.{near[0]}? " if near else "") + "fix the spelling, or drop the key")


def target_annotations(target: str) -> dict[str, Any]:
    """The annotation of each keyword a `_target_` accepts (a `Class.factory` classmethod's and its class's)."""
    obj = get_object(target)
    owner = getattr(obj, "__self__", None)
    found: dict[str, Any] = {}
    for source in (obj, owner) if isinstance(owner, type) else (obj,):
        for param in inspect.signature(source).parameters.values():
            found.setdefault(param.name, param.annotation)
    return found


def _dataclass_in(annotation: Any) -> type | None:
    """The dataclass an annotation names (`Timeouts | Mapping[str, float] | None` -> `Timeouts`), else None."""
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def validate_target_groups(node: DictConfig, path: str) -> None:
    """A nested group passed to a parameter typed with a dataclass (`rollout.engine.timeouts` -> `Timeouts`,
    `rollout.engine.retries` -> `Retries`): its keys must be fields of that dataclass and its values pass the
    dataclass's own checks, now rather than when the engine is built after the model loaded."""
    annotations = target_annotations(str(node._target_))
    for key in node:
        child = node._get_node(key)
        if not isinstance(child, DictConfig) or child._is_interpolation() or child._is_none() or "_target_" in child:
            continue
        kind = _dataclass_in(annotations.get(str(key)))
        if kind is None:
            continue
        valid = [f.name for f in dataclasses.fields(kind)]
        for sub in child:
            if sub not in valid:
                near = difflib.get_close_matches(str(sub), valid, n=1, cutoff=0.5)
                _fail(f"{path}.{key}.{sub}", child._get_node(sub)._value(),
                      f"a field of {kind.__name__} ({', '.join(valid)})",
                      (f"did you mean {path}.{key}.{near[0]}? " if near else "") + "fix the spelling, or drop the key")
        try:
            kind(**OmegaConf.to_container(child, resolve=True))
        except (TypeError, ValueError) as err:
            raise ValueError(f"config {path}.{key}: {err}") from None


def validate_targets(node: DictConfig | ListConfig, path: str = "") -> None:
    """`validate_target_kwargs` for every `_target_` node of the config (trainer, trainer.plugins, model, task,
    optimizer, algo.loss, rollout.engine, callbacks.*, ...). Interpolations are skipped: their source is checked
    where it is defined (`data.advantage: ${algo.advantage}`)."""
    if isinstance(node, DictConfig) and "_target_" in node and path:
        validate_target_kwargs(node, path)
        validate_target_groups(node, path)
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        if not path and key == "hydra":
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig | ListConfig) and not child._is_interpolation() and not child._is_none():
            validate_targets(child, f"{path}.{key}" if path else str(key))


def validate_booleans(cfg: DictConfig) -> None:
    for key in BOOLEAN_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and not isinstance(value, bool):
            _fail(key, value, "true or false", f"set {key}=true or {key}=false")


def validate_sampling(cfg: DictConfig) -> None:
    for rule in SAMPLING_RULES:
        try:
            check_sampling_value(rule, cfg.rollout[rule.name], key=f"config rollout.{rule.name}")
        except ValueError as err:
            raise ValueError(str(err).replace(" must be ", ": must be ", 1)) from None
    for key in ("n_samples", "max_new_tokens", "prompts_per_step"):
        _positive_int(cfg, f"rollout.{key}", f"set rollout.{key} to a positive integer")
    if "max_candidates" in cfg.rollout:
        _positive_int(cfg, "rollout.max_candidates", "set rollout.max_candidates to the largest candidate set an "
                      "engine may record (default 4096)")
        validate_sglang_candidates(cfg)


def validate_sglang_candidates(cfg: DictConfig) -> None:
    """An engine with a candidate cap (`RolloutEngine.max_candidates`, e.g. SGLangEngine) aborts every sample whose
    kept set outgrows it; at max_candidates=1 that is every sample a truncating sampler keeps two ids for, so the
    first step stopped (all samples aborted) after the ~60 s server start. Checked here, before it. Greedy
    (top_k=1) and untruncated sampling (no mask asked) work."""
    engine, r = cfg.rollout.get("engine"), cfg.rollout
    if not isinstance(engine, DictConfig) or "_target_" not in engine:
        return
    engine_class = target_class(engine)
    # The MRO, not issubclass: a Protocol with data members refuses issubclass.
    if not (isinstance(engine_class, type) and RolloutEngine in engine_class.__mro__):
        return
    if engine_class.max_candidates is None:  # records sets of any size (the embedded engine)
        return
    value = engine.get("max_candidates", r.max_candidates)
    truncates = SamplingParams(top_p=r.top_p, top_k=r.top_k, min_p=r.min_p).truncates
    if value < SGLANG_MIN_CANDIDATES and truncates and r.top_k != 1:
        _fail("rollout.max_candidates", value, f">= {SGLANG_MIN_CANDIDATES} with rollout=sglang and truncated "
              f"sampling (top_p={r.top_p}, top_k={r.top_k}, min_p={r.min_p}): the engine aborts every sample whose "
              f"kept set holds more than {value} id, so the first step would stop with its samples aborted",
              f"set rollout.max_candidates={SGLANG_MIN_CANDIDATES} or more (default 4096)")


def _capabilities(cfg: DictConfig) -> type[StrategyCapabilities]:
    """What the configured strategy class states it is (defaults without one)."""
    strategy = cfg.parallel.get("strategy")
    known = isinstance(strategy, DictConfig) and "_target_" in strategy
    return capabilities_of(target_class(strategy) if known else None)


def _is_fsdp(cfg: DictConfig) -> bool:
    return _capabilities(cfg).shards_hf_backbone


def validate_fsdp(cfg: DictConfig, world: int) -> None:
    """parallel=fsdp shards the HF backbone over data-parallel ranks only: what it cannot honour is refused here."""
    p = cfg.parallel
    offload = p.get("cpu_offload", False)
    if not isinstance(offload, bool):
        _fail("parallel.cpu_offload", offload, "true or false", "set parallel.cpu_offload=true or false")
    if offload and cfg.trainer.get("accelerator") == "cpu":
        _fail("parallel.cpu_offload", True, "false on a CPU run (the weights already live in host memory)",
              "set parallel.cpu_offload=false, or train on GPUs (trainer=gpu)")
    engine = cfg.rollout.engine
    evaluation = next((c for c in callback_entries(cfg) if c.get("every_n_steps") and "num_prompts" in c), None)
    if engine.get("share_weights") and evaluation is not None and evaluation.num_prompts < world:
        # A shared engine gathers the sharded model around each generate, on every rank together: a rank with no
        # evaluation prompt would skip it and leave the others waiting.
        _fail("eval.num_prompts", evaluation.num_prompts, f">= the world size ({world}) with parallel=fsdp and "
              "rollout.engine.share_weights=true (every rank must generate in each evaluation)",
              f"set eval.num_prompts={world} or more, or rollout.engine.share_weights=false")


def validate_device_counts(cfg: DictConfig) -> None:
    """trainer.devices / num_nodes as counts must be >= 1 (0 divided the prompts by a zero data-parallel size)."""
    for key in ("devices", "num_nodes"):
        value = cfg.trainer.get(key, 1)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            fix = ", or trainer.devices=auto for every device of the node" if key == "devices" else " (1: one machine)"
            _fail(f"trainer.{key}", value, "an integer >= 1", f"set trainer.{key}=1 or more{fix}")


# Why a key is refused under a layout, where the generic "it does not read it" says too little.
LAYOUT_KEY_REASONS = {
    ("topp_rl.fsdp.strategy.FSDPStrategy", "distributed_optimizer"): (
        "FSDP2 already shards the AdamW state over the ranks, with the weights and gradients; megatron-core's "
        "DistributedOptimizer is the Megatron layouts' ZeRO-1"),
}


def validate_layout_keys(cfg: DictConfig) -> None:
    """A `parallel.*` key the chosen layout does not read (one that `+` added, e.g. `+parallel.distributed_
    optimizer=true` with parallel=fsdp) would do nothing: refused, naming the layouts that read it."""
    strategy = cfg.parallel.get("strategy")
    target = str(strategy._target_) if isinstance(strategy, DictConfig) and "_target_" in strategy else None
    layouts = parallel_keys()
    if target not in layouts:
        return  # a user's own strategy class: its constructor checks its own settings
    known, names = layouts[target]
    for key in sorted(set(cfg.parallel) - known):
        readers = [n for t, (keys, options) in layouts.items() if key in keys for n in options]
        reason = LAYOUT_KEY_REASONS.get((target, key), f"the keys it reads: {', '.join(sorted(known))}")
        _fail(f"parallel.{key}", cfg.parallel._get_node(key)._value(),
              f"absent with parallel={'/'.join(names)} ({reason})",
              "drop the key" + (f", or pick a layout that reads it (parallel={'/'.join(readers)})" if readers else ""))


def parallel_plan(cfg: DictConfig) -> ParallelPlan:
    """The run's `ParallelPlan` (its construction checks every size and how they combine with the world size)."""
    p = cfg.parallel
    return ParallelPlan(world=world_size(cfg), tp=p.tp_size, cp=p.cp_size, ep=p.ep_size, pp=p.get("pp_size", 1),
                        vpp=p.get("vpp_size", 1), fsdp=_is_fsdp(cfg), cp_mode=p.get("cp_mode", "zigzag"))


def placement_of(cfg: DictConfig) -> Placement | None:
    """Where the run's trainer ranks and SGLang servers go on GPUs (`topp_rl.parallel.placement`); None where
    nothing is placed: an engine without the placement keys (rollout=embedded), servers it connects to
    (router_url / urls) or a CPU run. Refuses, with the numbers, a placement that cannot work."""
    engine = cfg.rollout.get("engine")
    if not isinstance(engine, DictConfig) or "placement" not in engine:
        return None
    settings = {key: engine.get(key) for key in ENGINE_KEYS}
    if isinstance(settings["gpus"], ListConfig):
        settings["gpus"] = list(settings["gpus"])
    elsewhere = next((k for k in ("router_url", "urls") if engine.get(k) is not None), None)
    if elsewhere or _on_cpu(cfg):
        _check_unplaced(settings, elsewhere)
        return None
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    for key, value in (("devices", devices), ("num_nodes", nodes)):
        if not isinstance(value, int) or isinstance(value, bool):
            _fail(f"trainer.{key}", value, "a count with rollout=sglang on GPUs (the placement plan puts each "
                  "trainer rank and server on its GPUs before anything starts)", f"set trainer.{key}=N")
    return plan_placement(parallel_plan(cfg), nodes=nodes, devices=devices, placement=settings["placement"],
                          gpus=settings["gpus"], tp_size=settings["tp_size"], mem_fraction=settings["mem_fraction"],
                          num_servers=engine.get("num_servers", 1))


def _on_cpu(cfg: DictConfig) -> bool:
    return cfg.trainer.get("accelerator") == "cpu"


def _check_unplaced(settings: dict, elsewhere: str | None) -> None:
    """Servers that are not placed on GPUs (connected ones, or a CPU run) take none of the plan's GPU keys; a CPU
    run may still be colocated (the release / push cycle, with the memory calls doing nothing)."""
    why = (f"with rollout.engine.{elsewhere} (those servers run elsewhere)" if elsewhere
           else "on a CPU run (trainer.accelerator=cpu: the servers run on the host's CPUs)")
    fix = "" if elsewhere else ", or train on GPUs (trainer=gpu)"
    allowed = {"placement": (None,) if elsewhere else (None, "colocated"), "gpus": (None,), "tp_size": (1,),
               "mem_fraction": (None,)}
    for key, values in allowed.items():
        if settings[key] not in values:
            _fail(f"rollout.engine.{key}", settings[key], f"{' or '.join(map(str, values))} {why}".replace(
                "None", "null"), f"drop rollout.engine.{key}{fix}")


def engine_placement_mode(cfg: DictConfig) -> str | None:
    """How the run's servers share devices with the trainer: "colocated", "disaggregated", or None (no placement
    keys, connected servers, or a CPU run that leaves `rollout.engine.placement` null)."""
    if (placement := placement_of(cfg)) is not None:
        return placement.mode
    engine = cfg.rollout.get("engine")
    return engine.get("placement") if isinstance(engine, DictConfig) and "placement" in engine else None


def weight_sync_of(cfg: DictConfig) -> str | None:
    """`rollout.engine.weight_sync` with null resolved by the placement: tensor handles colocated, an NCCL broadcast
    disaggregated (a trainer rank and servers on GPUs of their own), else disk; None for an engine without the key."""
    engine = cfg.rollout.get("engine")
    if not isinstance(engine, DictConfig) or "weight_sync" not in engine:
        return None
    if engine.weight_sync is not None:
        return engine.weight_sync
    return {"colocated": "tensor", "disaggregated": "distributed"}.get(engine_placement_mode(cfg), "disk")


def validate_placement(cfg: DictConfig) -> None:
    """The placement plan computes (after the parallel sizes: it places their ranks), and a colocated engine gets
    what it needs."""
    mode = engine_placement_mode(cfg)
    engine = cfg.rollout.get("engine")
    if mode != "colocated":
        if isinstance(engine, DictConfig) and engine.get("weight_sync") == "tensor":
            _fail("rollout.engine.weight_sync", "tensor", "disk, distributed or null unless rollout.engine.placement="
                  "colocated (tensor handles point into the trainer's own memory: the servers must share its devices)",
                  "set rollout.engine.placement=colocated, or rollout.engine.weight_sync=null")
        return
    staleness = check_staleness_key(cfg.rollout.get("max_staleness", 0), overlap=cfg.rollout.get("overlap", False))
    if staleness:
        _fail("rollout.max_staleness", staleness, "0 with rollout.engine.placement=colocated (the servers give their "
              "memory back while the trainer trains, so they cannot generate the next steps meanwhile)",
              "set rollout.max_staleness=0 (and rollout.overlap=false), or give the servers their own GPUs "
              "(rollout.engine.placement=disaggregated rollout.engine.gpus=...)")
    if engine.get("weight_sync") == "distributed":
        _fail("rollout.engine.weight_sync", "distributed", "tensor, disk or null with rollout.engine.placement="
              "colocated (a broadcast group would hold a trainer rank and a server on one GPU, which NCCL refuses)",
              "set rollout.engine.weight_sync=null (tensor: CUDA IPC on GPUs, shared memory on CPU)")


def validate_parallel(cfg: DictConfig) -> None:
    validate_device_counts(cfg)
    validate_layout_keys(cfg)
    p, world = cfg.parallel, world_size(cfg)
    for key in ("tp_size", "cp_size", "ep_size", "pp_size", "vpp_size"):
        if key in p:  # pp_size / vpp_size may be absent from a config written before they existed: 1
            _positive_int(cfg, f"parallel.{key}", f"use parallel.{key}=1 to disable it")
    for key in ("tp_size", "cp_size", "ep_size", "pp_size"):
        if p.get(key, 1) > 1 and not p.get("strategy"):
            _fail(f"parallel.{key}", p[key], "1 without a parallel strategy (parallel=none runs the HF model whole)",
                  "pick a Megatron layout instead: parallel=tp2, cp2, tp2_cp2, ep2, tp2_ep2, pp2, tp2_pp2 or pp2_cp2")
    fsdp = _is_fsdp(cfg)
    parallel_plan(cfg)  # the sizes together: FSDP alone, divisors of the world, pp = 1
    if fsdp:
        validate_fsdp(cfg, world)
    megatron = p.get("strategy") and not fsdp
    coeff = _number(cfg, "module.moe_aux_loss_coeff")
    if coeff < 0:
        _fail("module.moe_aux_loss_coeff", coeff, ">= 0", "use 0 (off, the RL default) or a small positive weight")
    if not megatron and coeff > 0:
        _fail("module.moe_aux_loss_coeff", coeff, "0 with the HF backbone (it does not add the load-balancing "
              "loss; the Megatron backbone does)", "use a Megatron parallel/ config (e.g. parallel=ep2) or set 0")
    cp_mode = p.get("cp_mode", "zigzag")
    if p.get("strategy") and p.cp_size > 1 and cp_mode not in (modes := _capabilities(cfg).cp_modes):
        _fail("parallel.cp_mode", cp_mode, f"one of {', '.join(map(repr, modes))} with this layout (the Megatron "
              "backbone's THD RoPE and transformer-engine's CP attention assume the zigzag split; all-gather CP "
              "exists only in the ops)", f"use parallel.cp_mode={modes[0]}")
    if megatron and cfg.module.get("gradient_checkpointing"):
        _fail("module.gradient_checkpointing", True, "false with the Megatron backbone (it is the HF backbone's "
              "layer recompute; the Megatron model is built without it)", "set module.gradient_checkpointing=false")
    _validate_distributed_optimizer(cfg)
    _validate_pipeline(cfg)
    parallel_plan(cfg).check_prompts(cfg.rollout.prompts_per_step)
    if world > 1 and not p.get("strategy"):
        # PolicyModule runs several backward passes per DDP forward (one per micro-batch); plain DDP is
        # not wired for that, so multi-rank runs need a parallel/ config that brings its own strategy.
        _fail("trainer.devices * trainer.num_nodes", world, "1 with parallel=none (plain DDP is not supported)",
              "use parallel=fsdp (the HF model sharded over the ranks), a Megatron layout (parallel=tp2, ...), "
              "or trainer.devices=1")


def _validate_pipeline(cfg: DictConfig) -> None:
    """pp > 1 (the Megatron backbone's pipeline stages): what the 1F1B schedule does not carry yet is refused here,
    and the layer split is checked when the model config names its layer count."""
    pp = cfg.parallel.get("pp_size", 1)
    if pp == 1:
        return
    layers = cfg.model.get("layers")
    if isinstance(layers, int):
        parallel_plan(cfg).check_layers(layers)
    vpp = cfg.parallel.get("vpp_size", 1)
    if vpp > 1 and cfg.parallel.get("distributed_optimizer", False):
        _fail("parallel.distributed_optimizer", True, f"false with parallel.vpp_size={vpp} (the sharded optimizer "
              "wraps one model per rank in megatron's DDP; virtual stages hold a list of chunks)",
              "set parallel.distributed_optimizer=false or parallel.vpp_size=1")
    family = cfg.model.get("family")
    if vpp > 1 and family is not None and "moe" in str(family):
        _fail("parallel.vpp_size", vpp, f"1 with an MoE model (model.family={family}: each stage sends its MoE figures "
              "once per micro-batch, and a rank with several chunks would send several)", "set parallel.vpp_size=1")
    samples = cfg.rollout.prompts_per_step // parallel_plan(cfg).dp * cfg.rollout.n_samples
    if vpp > 1 and samples < pp:
        _fail("parallel.vpp_size", vpp, f"1 when a data-parallel rank draws fewer samples a step ({samples} = "
              "rollout.prompts_per_step / data-parallel size x rollout.n_samples) than parallel.pp_size="
              f"{pp} (megatron's interleaved schedule runs at least pp_size micro-batches)",
              "raise rollout.prompts_per_step or rollout.n_samples, or set parallel.vpp_size=1")


def _loss_scaled_fp16(cfg: DictConfig) -> bool:
    """Whether the trainer runs `LossScaledFP16` (trainer=cpu_fp16 / gpu_fp16)."""
    plugins = cfg.trainer.get("plugins") or []
    return any("LossScaledFP16" in (str(p.get("_target_")) if isinstance(p, DictConfig) else str(p)) for p in plugins)


def _validate_distributed_optimizer(cfg: DictConfig) -> None:
    flag = cfg.parallel.get("distributed_optimizer", False)
    if not isinstance(flag, bool):
        _fail("parallel.distributed_optimizer", flag, "true or false", "use parallel.distributed_optimizer=true")
    if not flag:
        return
    target = cfg.optimizer.get("_target_")
    if target != "torch.optim.AdamW":
        _fail("optimizer._target_", target, "torch.optim.AdamW with parallel.distributed_optimizer=true (megatron-core's "
              "DistributedOptimizer shards only Adam state, and accepts torch's Adam only without transformer-engine)",
              "use optimizer._target_=torch.optim.AdamW or parallel.distributed_optimizer=false")
    if _loss_scaled_fp16(cfg):
        _fail("parallel.distributed_optimizer", True, "false with an fp16 loss scale (trainer=cpu_fp16 / gpu_fp16: "
              "the scaler unscales the optimizer's gradients before the clip, and the sharded optimizer's shards "
              "receive theirs only in the clip)", "train in fp32 or bf16, or set parallel.distributed_optimizer=false")
    if cfg.parallel.ep_size > 1:
        _fail("parallel.distributed_optimizer", True, f"false with parallel.ep_size={cfg.parallel.ep_size} (the "
              "sharded optimizer covers dense models only; experts would need their own over the expert-data-"
              "parallel group)", "set parallel.distributed_optimizer=false")


def validate_weight_sync(cfg: DictConfig) -> None:
    """Without a weight sync the engine keeps sampling with the initial weights: every step after the first
    trains off-policy while the config claims on-policy updates. Refused unless asked for explicitly."""
    if any(issubclass(target_class(c), WeightSync) for c in callback_entries(cfg)) or cfg.get("allow_stale_weights"):
        return
    _fail("callbacks.weight_sync", None, "a WeightSync callback (the engine must sample with the trained weights "
          "for on-policy training)", "keep callbacks.weight_sync, or set allow_stale_weights=true to train "
          "off-policy against the initial weights on purpose")


def callback_entries(cfg: DictConfig) -> list[DictConfig]:
    """The `callbacks` entries train.py builds: set, and not switched off by `enabled: false`."""
    entries = (cfg.get("callbacks") or {}).values()
    return [c for c in entries if c is not None and c.get("enabled", True)]


# Settings node -> (the callback it configures, what makes it act, the entry name in callbacks/default.yaml).
CALLBACK_SETTINGS = {
    "eval": ("topp_rl.callbacks.evaluation.Evaluation", "every_n_steps", "evaluation"),
    "export": ("topp_rl.run.export.HFExport", "hf", "export"),
}


def validate_callback_settings(cfg: DictConfig) -> None:
    """`eval.every_n_steps=10` or `export.hf=true` with no callback to act on it (callbacks=minimal has neither,
    `callbacks.export=null` drops one) would do nothing: refused, naming the switch that does what was meant."""
    for c in callback_entries(cfg):
        if not isinstance(c.get("enabled", True), bool):
            _fail("callbacks enabled", c.enabled, "true or false", "set the switch the entry names to true or false")
    built = {target_class(c) for c in callback_entries(cfg)}
    for node, (target, switch, entry) in CALLBACK_SETTINGS.items():
        settings = cfg.get(node)
        if not isinstance(settings, DictConfig) or not settings.get(switch):
            continue
        cls = get_object(target)
        if not any(issubclass(b, cls) for b in built):
            _fail(f"{node}.{switch}", settings[switch], f"off without a callbacks.{entry} entry ({cls.__name__}); "
                  "this callbacks choice has none, so nothing would act on it",
                  f"set {node}.{switch}={'false' if switch == 'hf' else 0}, or use callbacks=default")


def validate_eval_source(cfg: DictConfig) -> None:
    """eval.split / eval.task pick the held-out prompts; with no evaluation (eval.every_n_steps=0, the default, or
    absent under callbacks=minimal) nothing reads them, and the run would silently never evaluate."""
    settings = cfg.get("eval")
    if not isinstance(settings, DictConfig) or settings.get("every_n_steps"):
        return
    for key in ("split", "task"):
        value = settings.get(key)
        if value is not None:
            shown = value.get("_target_", value) if isinstance(value, DictConfig) else value
            _fail(f"eval.{key}", shown, f"null with eval.every_n_steps={settings.get('every_n_steps', 0)} (no "
                  "evaluation runs, so nothing reads it)", f"set eval.every_n_steps=N to evaluate on it every N "
                  f"steps, or drop eval.{key}")


def validate_staleness(cfg: DictConfig) -> None:
    """rollout.max_staleness=K >= 1 (or rollout.overlap=true, K = 1) trains on samples up to K weight updates old:
    the engine must keep its own weights while the trainer updates them; partial rollouts need rollouts ahead."""
    rollout = cfg.rollout
    k = check_staleness_key(rollout.get("max_staleness", 0), overlap=rollout.get("overlap", False))
    partial = rollout.get("partial_rollouts", False)
    if partial and not k:
        _fail("rollout.partial_rollouts", True, "false with rollout.max_staleness=0 (every step is generated with "
              "the weights it trains, so no update meets a response)", "set rollout.max_staleness=1 or more")
    if not k:
        return
    if rollout.engine.get("share_weights"):
        _fail("rollout.engine.share_weights", True, f"false with rollout.max_staleness={k} (the next steps are "
              "generated while this one updates the weights)", "set rollout.engine.share_weights=false (the "
              "embedded engine keeps its own copy), or use rollout=sglang")
    batching = rollout.engine.get("batching")
    if partial and batching not in (None, "continuous"):
        _fail("rollout.engine.batching", batching, "continuous with rollout.partial_rollouts=true (a weight update "
              "lands between two decode steps of the responses in flight)", "set rollout.engine.batching=continuous")
    from hydra.utils import instantiate

    loss = instantiate(cfg.algo.loss)  # the loss says what it corrects; cheap, and its own checks run now
    if not loss.corrects_staleness:
        log.warning("rollout.max_staleness=%d trains on samples up to %d weight updates old without a correction of "
                    "the importance ratio to them; set algo.loss.tis_cap=2.0 (or algo.loss.icepop_low=0.5 "
                    "algo.loss.icepop_high=2.0) to correct it per token", k, k)


def validate_vllm(cfg: DictConfig) -> None:
    """rollout=vllm (`VLLMEngine`) reads each kept set from vLLM's top-(top_k + 1) processed log-probs: truncated
    sampling needs 0 < top_k <= max_candidates (`topp_rl.engines.vllm.protocol.check_params`, the same rule at
    generate time), checked here before the model loads and the server starts."""
    engine = cfg.rollout.get("engine")
    if not isinstance(engine, DictConfig) or "_target_" not in engine:
        return
    engine_class = target_class(engine)
    if not (isinstance(engine_class, type) and issubclass(engine_class, VLLMEngine)):
        return
    r = cfg.rollout
    cap = engine.get("max_candidates", r.get("max_candidates", VLLMEngine.max_candidates))
    if engine.get("weight_sync") not in (None, *VLLM_SYNC_METHODS):
        _fail("rollout.engine.weight_sync", engine.weight_sync, f"null or one of {', '.join(VLLM_SYNC_METHODS)} with "
              "rollout=vllm (tensor handles are rollout=sglang's colocated mode)", "set rollout.engine.weight_sync="
              "distributed, or null (from disk)")
    kept_sets = engine.get("kept_sets", "auto")
    check_kept_sets(kept_sets, launched=not engine.get("urls"))
    if kept_sets == "native" and not 0 < r.top_k <= cap:
        _fail("rollout.top_k", r.top_k, f"in [1, rollout.max_candidates={cap}] with rollout.engine.kept_sets=native "
              "(vLLM serves a --return-sampling-mask server only with top_k > 0: it bounds the mask)",
              "set rollout.top_k (e.g. rollout.top_k=20)")
    if SamplingParams(top_p=r.top_p, top_k=r.top_k, min_p=r.min_p).truncates and not 0 < r.top_k <= cap:
        _fail("rollout.top_k", r.top_k, f"in [1, rollout.max_candidates={cap}] with rollout=vllm and top_p={r.top_p}, "
              f"min_p={r.min_p} (the kept set is read from vLLM's top-(top_k + 1) processed log-probs, which an "
              "unbounded set does not fit)", "set rollout.top_k (e.g. rollout.top_k=20), or use rollout=sglang "
              "(native masks up to max_candidates) or rollout=embedded")


def validate_refill(cfg: DictConfig) -> None:
    """data.refill / data.max_refill_factor (dynamic sampling), checked as the datamodule checks them."""
    data = cfg.data
    check_refill(refill=data.get("refill", False), drop_zero_variance_groups=data.drop_zero_variance_groups,
                 max_refill_factor=data.get("max_refill_factor", 4.0),
                 max_staleness=check_staleness_key(cfg.rollout.get("max_staleness", 0),
                                                   overlap=cfg.rollout.get("overlap", False)))


def validate_turns(cfg: DictConfig) -> None:
    """rollout.max_turns > 1 needs a multi-turn step (the agent loop): the single-turn step answers once; the
    agent loop needs an environment. It runs at any world size and with either engine: the failure share is summed
    over DP ranks (`AgentLoopStep.check`), TP / CP peers get the source's trajectories, and each layout's and
    engine's exactness through the loop is measured (tests/test_agent_dist.py, docs/agents.md)."""
    turns = _positive_int(cfg, "rollout.max_turns", "use 1 for single-turn tasks")
    _positive_int(cfg, "rollout.max_trajectory_tokens", "set the response tokens a trajectory may hold")
    step = target_class(cfg.rollout.step)
    agent = issubclass(step, AgentLoopStep | EndpointStep)  # the multi-turn steps
    if issubclass(step, EndpointStep):
        _check_agent_fn(cfg)
    if issubclass(step, AgentLoopStep):
        check_environment_config(cfg.rollout.step)
    if turns > 1 and not agent:
        _fail("rollout.max_turns", turns, f"1 with rollout.step={cfg.rollout.step._target_} (it answers each "
              "prompt once)", "select the agent loop (rollout/step=agent, with an environment) or an agent "
              "function (task=agent task.agent=pkg.mod:fn), or set rollout.max_turns=1")


def validate_overlong(cfg: DictConfig) -> None:
    """algo.overlong (`Overlong.check`: the soft penalty's buffer inside rollout.max_new_tokens, both set or
    neither); the penalty reads a sample's length against one answer's budget, so multi-turn steps refuse it."""
    node = cfg.algo.get("overlong")
    if node is None:
        return
    from hydra.utils import instantiate

    overlong = instantiate(node)
    if not isinstance(overlong, Overlong):
        _fail("algo.overlong._target_", node._target_, "topp_rl.rollout.overlong.Overlong or a subclass",
              "set algo.overlong._target_=topp_rl.rollout.overlong.Overlong")
    overlong.check(max_new_tokens=cfg.rollout.max_new_tokens)
    step = target_class(cfg.rollout.step)
    if overlong.penalises and issubclass(step, AgentLoopStep | EndpointStep):
        _fail("algo.overlong.penalty", overlong.penalty, f"0 with rollout.step={cfg.rollout.step._target_} (the "
              "penalty compares one response with rollout.max_new_tokens; a trajectory spans several turns)",
              "set algo.overlong.penalty=0 algo.overlong.buffer=0 (algo.overlong.filter=true still leaves the "
              "trajectories ended by a budget out of the loss)")


def validate_entropy_bonus(cfg: DictConfig) -> None:
    coeff = _number(cfg, "algo.entropy_coeff") if "entropy_coeff" in cfg.algo else 0.0
    if not (math.isfinite(coeff) and coeff >= 0):
        _fail("algo.entropy_coeff", coeff, "a finite number >= 0", "use e.g. algo.entropy_coeff=1e-3, or 0 (off)")


def _check_agent_fn(cfg: DictConfig) -> None:
    """rollout/step=endpoint: its agent function must import and be `async def`, refused now naming it."""
    try:
        spec = cfg.rollout.step.agent  # task=agent sets it to ${task.agent}
    except (MissingMandatoryValue, InterpolationToMissingValueError):
        spec = "???"
    if spec == "???":
        _fail("task.agent", "???", "an agent function, pkg.mod:fn or path/to/file.py:fn (async def "
              "fn(client, record) -> float | dict)", "set task.agent=<your function> (e.g. "
              "task.agent=topp_rl.tasks.agents.lookup:lookup_agent); without task=agent: rollout.step.agent=...")
    resolve_agent(str(spec), key="task.agent" if "agent" in cfg.task else "rollout.step.agent")


def is_replay(cfg: DictConfig) -> bool:
    """rollout=replay: the engine hands back a recording's samples."""
    engine = cfg.rollout.get("engine")
    if not isinstance(engine, DictConfig) or "_target_" not in engine:
        return False
    engine_class = target_class(engine)
    return isinstance(engine_class, type) and issubclass(engine_class, ReplayEngine)


def validate_replay_keys(cfg: DictConfig) -> None:
    """rollout=replay trains each recorded step as it comes, with no engine: what needs one is refused, and so is a
    recording that cannot give this run's steps (another data stream, fewer steps, rollouts ahead)."""
    if not is_replay(cfg):
        return
    r = cfg.rollout
    if r.get("record", False):
        _fail("rollout.record", True, "false with rollout=replay (the replayed samples are on disk already)",
              "set rollout.record=false")
    k = check_staleness_key(r.get("max_staleness", 0), overlap=r.get("overlap", False))
    if k or r.get("partial_rollouts", False):
        key, value = ("rollout.partial_rollouts", True) if not k else ("rollout.max_staleness", k)
        _fail(key, value, "0 / false with rollout=replay (rollouts ahead schedule generations beside training; a "
              "replay has none, and trains each recorded step in order)", "set rollout.max_staleness=0 "
              "rollout.overlap=false rollout.partial_rollouts=false")
    every = (cfg.get("eval") or {}).get("every_n_steps", 0)
    if every:  # validate_callback_settings: an Evaluation callback acts on it
        _fail("eval.every_n_steps", every, "0 with rollout=replay (evaluation samples the current policy, which "
              "needs an engine; a replay has only recorded samples)", "set eval.every_n_steps=0, and evaluate "
              "a checkpoint of the replay with an engine (ckpt_path=... rollout=embedded)")
    if OmegaConf.is_missing(r, "path"):
        _fail("rollout.path", "???", "the directory of a recording (rollout.record=true writes <run dir>/rollouts)",
              "set rollout.path=<the recording run's dir>/rollouts")
    manifest = Manifest.read(r.path)
    if manifest.max_staleness:
        _fail("rollout.path", r.path, f"an on-policy recording (this one was recorded with rollout.max_staleness="
              f"{manifest.max_staleness}: its steps were trained on weights that a replay does not reproduce)",
              "record the run with rollout.max_staleness=0")
    mine = json.loads(json.dumps(recorded_settings(cfg)))
    changed = {k: (v, mine.get(k)) for k, v in manifest.settings.items() if mine.get(k) != v}
    if changed:
        detail = "; ".join(f"{k}: recorded {old!r}, this run {new!r}" for k, (old, new) in changed.items())
        _fail("rollout.path", r.path, f"replayed with the settings it was recorded with (they decide each step's "
              f"prompts and scores); these differ: {detail}",
              "set them to the recorded values (" + " ".join(f"{k}={json.dumps(v[0])}" for k, v in changed.items())
              + ")")
    held = recorded_steps(r.path)
    steps = cfg.trainer.max_steps
    if held < steps:
        _fail("trainer.max_steps", steps, f"<= {held} with rollout.path={r.path!r} (it holds {held} complete steps, "
              f"0..{held - 1}, for each of its {manifest.dp_size} data-parallel ranks)",
              f"set trainer.max_steps={held} or fewer, or record a longer run")


def validate_replay(cfg: DictConfig, model, tokenizer) -> None:
    """rollout=replay: the recording's token ids must mean the same tokens to this run's policy (the same
    tokenizer vocabulary, vocab size and model family), refused naming both."""
    if not is_replay(cfg):
        return
    recorded = Manifest.read(cfg.rollout.path).identity
    differences = recorded.differences(PolicyIdentity.of(model, tokenizer))
    if differences:
        _fail("rollout.path", cfg.rollout.path, f"a recording of this run's policy; {'; '.join(differences)}",
              "replay with the model and tokenizer the recording was sampled with (the model=... keys of its "
              "config.yaml)")


def validate_with_model(cfg: DictConfig, model) -> None:
    """What can be checked once the model is built, before any engine starts: routing replay and the multi-turn
    trajectory budget against the model's context."""
    validate_routing(cfg, model)
    step = cfg.rollout.get("step")
    if isinstance(step, DictConfig) and issubclass(target_class(step), AgentLoopStep | EndpointStep):
        check_context(max_trajectory_tokens=cfg.rollout.max_trajectory_tokens,
                      context=getattr(model.config, "max_position_embeddings", None))


def validate_routing(cfg: DictConfig, model) -> None:
    """rollout.routing_replay=true forces the rollout's recorded experts in training: it needs recorded routes and
    a model with MoE layers. The agent loop's trajectories take their routes from the last model turn's call, which
    covers the whole transcript; the endpoint records none yet."""
    step = cfg.rollout.get("step")
    if (isinstance(step, DictConfig) and issubclass(target_class(step), EndpointStep)
            and cfg.rollout.get("record_routes", False) and moe_routing(model) is not None):
        _fail("rollout.record_routes", True, f"false for an MoE model ({type(model).__name__}) with "
              "rollout/step=endpoint (it does not merge routes across requests yet)", "set "
              "rollout.record_routes=false rollout.routing_replay=false, or use the agent loop (rollout/step=agent)")
    if not cfg.rollout.get("routing_replay", False):
        return
    if not cfg.rollout.get("record_routes", False):
        _fail("rollout.routing_replay", True, "false when rollout.record_routes=false (replay forces the routes the "
              "engine recorded)", "set rollout.record_routes=true, or rollout.routing_replay=false")
    if moe_routing(model) is None:
        _fail("rollout.routing_replay", True, f"false for a dense model ({type(model).__name__} has no MoE layers, "
              "so there are no expert routes to replay)", "set rollout.routing_replay=false, or train an MoE model "
              "(e.g. model=tiny model.family=qwen3_moe)")


def validate_teacher(cfg: DictConfig) -> None:
    """The teacher group (`topp_rl.teacher`, docs/distillation.md): algo=opd and algo.teacher_kl_coeff > 0 need a
    teacher; teacher keys need a teacher; a kept-set teacher needs the kept-set student (module.use_mask)."""
    teacher = cfg.get("teacher")
    coeff = _number(cfg, "algo.teacher_kl_coeff") if "teacher_kl_coeff" in cfg.algo else 0.0
    if not coeff >= 0:
        _fail("algo.teacher_kl_coeff", coeff, ">= 0", "use 0 to train without the teacher's KL")
    if not teacher:
        if cfg.algo.name == "opd" or coeff > 0:
            raise ValueError(f"config algo={cfg.algo.name} with algo.teacher_kl_coeff={coeff} needs a teacher, but "
                             "teacher=none: add teacher=hf_path teacher.path=DIR, or set algo.teacher_kl_coeff=0 with "
                             "an RL algo")
        return
    if "_target_" not in teacher:
        raise ValueError(f"config teacher.* keys {sorted(teacher)} are set with teacher=none (nothing reads them): "
                         "choose a teacher (teacher=hf_path teacher.path=DIR) or drop the teacher.* overrides")
    if issubclass(target_class(teacher), SGLangTeacher):
        if teacher.get("use_candidate_mask"):
            _fail("teacher.use_candidate_mask", True, "false with teacher=sglang (the server returns each token's "
                  "log-prob over the full vocabulary, not over the student's kept set)",
                  "set teacher.use_candidate_mask=false, or use teacher=hf_path for a kept-set teacher")
        if cfg.rollout.temperature != 1:
            _fail("rollout.temperature", cfg.rollout.temperature, "1 with teacher=sglang (SGLang's prompt log-probs "
                  "are at temperature 1, the student's at the rollout temperature)",
                  "set rollout.temperature=1, or use teacher=hf_path (scored at the rollout temperature)")
    if teacher.get("use_candidate_mask") and not cfg.module.use_mask:
        _fail("teacher.use_candidate_mask", True, "false when module.use_mask=false (the student is then scored "
              "over the full vocabulary, so there is no kept set to score the teacher on)",
              "set teacher.use_candidate_mask=false, or module.use_mask=true")


def validate_config(cfg: DictConfig, *, check_rewards: bool = True) -> None:
    """Raise ValueError on the first invalid setting (see module docstring). `check_rewards=False`: the task's
    rewards are Python callables given to `topp_rl.fit` (the config records their names, which need not import)."""
    validate_known_keys(cfg)
    validate_engine_numbers(cfg)  # before validate_targets builds Timeouts / Retries from them
    validate_targets(cfg)
    validate_booleans(cfg)
    validate_sampling(cfg)
    validate_weight_sync(cfg)
    validate_callback_settings(cfg)
    validate_eval_source(cfg)
    validate_replay_keys(cfg)  # before the staleness and refill rules: under replay their keys are refused
    validate_staleness(cfg)
    validate_vllm(cfg)
    validate_refill(cfg)
    validate_turns(cfg)
    validate_overlong(cfg)
    validate_entropy_bonus(cfg)
    validate_teacher(cfg)
    if check_rewards:  # imports each named reward: a wrong module name fails before the model loads
        # The multi-turn steps take their rewards from the environment or the agent, never from the task.
        step = target_class(cfg.rollout.step)
        check_reward_config(cfg.task, required=not issubclass(step, AgentLoopStep | EndpointStep), step=step.__name__)
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
    validate_placement(cfg)
