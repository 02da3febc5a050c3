"""The keys the shipped config defines, per closed section (and per rollout choice): `validate_known_keys`
refuses any other, since Hydra's `+` adds any key and nothing would ever read a misspelt one."""

import difflib
import functools
from pathlib import Path

import yaml
from omegaconf import DictConfig

from topp_rl.parallel.options import parallel_options
from topp_rl.paths import config_dir

# Sections whose keys are a closed set: everything the code reads there is defined in the shipped yaml, so a key
# they do not define (`+rollout.topp=0.9`: Hydra's `+` adds it, nothing reads it) is a typo. "" is the top level.
# `algo` is closed to the keys its options define (name, loss, advantage: `+algo.kl_coef` meant algo.loss.kl_coef).
# Checked elsewhere: `_target_` nodes against their constructor (`topp_rl.config.validate_targets`: model, task,
# data, optimizer, rollout.engine, algo.loss, trainer, logger.*, callbacks.*: `+callbacks.<name>` adds a
# callback) and `parallel` per layout (`parallel_keys`). Not checked: `hydra`.
CLOSED_SECTIONS = ("", "paths", "module", "lr_schedule", "eval", "checkpoint", "export", "resume", "rollout", "algo")


def _yaml_keys(path: Path) -> set[str]:
    """Top-level keys a group option defines, with those its `<file>@_here_` defaults merge in."""
    data = yaml.safe_load(path.read_text()) or {}
    keys = set(data) - {"defaults"}
    for entry in data.get("defaults", []):
        if isinstance(entry, str) and entry.endswith("@_here_"):
            keys |= _yaml_keys(path.parent / f"{entry.removesuffix('@_here_')}.yaml")
        elif isinstance(entry, dict):  # a nested group (rollout/step): its node is a key of this option
            keys |= {k for k in entry if not k.startswith("override ")}
    return keys


@functools.cache
def shipped_keys() -> dict[str, frozenset[str]]:
    """Per closed section, the keys the shipped yaml defines: `conf/config.yaml` (its defaults' group names at
    the top level) and the nodes the `callbacks` options bring (`eval`, `export`)."""
    conf = config_dir()
    main = yaml.safe_load((conf / "config.yaml").read_text())
    groups = {next(iter(d)) for d in main["defaults"] if isinstance(d, dict)}
    top = set(main) - {"defaults"} | {g for g in groups if not g.startswith("override ")}
    sections = {section: set(main.get(section) or ()) for section in CLOSED_SECTIONS[1:]}
    for path in (conf / "callbacks").glob("*.yaml"):  # `# @package _global_`: nodes beside `callbacks`
        for name, node in (yaml.safe_load(path.read_text()) or {}).items():
            top.add(name)
            if name in sections and isinstance(node, dict):
                sections[name] |= set(node)
    sections.pop("rollout")  # per choice: `rollout_keys`
    sections["algo"] = set().union(*(_yaml_keys(path) for path in (conf / "algo").glob("*.yaml")))
    return {"": frozenset(top)} | {k: frozenset(v) for k, v in sections.items()}


@functools.cache
def rollout_keys() -> dict[str, frozenset[str]]:
    """Per rollout choice, keyed by its engine's `_target_`: the `rollout.*` keys that choice defines (a key of
    another choice does nothing under this one, e.g. `rollout.max_candidates` under rollout=embedded)."""
    out = {}
    for path in sorted((config_dir() / "rollout").glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        out[data["engine"]["_target_"]] = frozenset(_yaml_keys(path))
    return out


@functools.cache
def parallel_keys() -> dict[str | None, tuple[frozenset[str], tuple[str, ...]]]:
    """Per layout, keyed by its strategy's `_target_` (None: parallel=none): (the `parallel.*` keys its options
    define, those options' names). Any other key does nothing under that layout (`+parallel.cpu_offload=true` is
    FSDP's, `+parallel.distributed_optimizer=true` Megatron's)."""
    keys: dict[str | None, set[str]] = {}
    names: dict[str | None, list[str]] = {}
    for name, node in parallel_options().items():
        strategy = node.get("strategy")
        target = strategy["_target_"] if isinstance(strategy, dict) else None
        keys.setdefault(target, set()).update(node)
        names.setdefault(target, []).append(name)
    return {target: (frozenset(keys[target]), tuple(names[target])) for target in keys}


def _known_keys(cfg: DictConfig, section: str) -> frozenset[str]:
    if section != "rollout":
        return shipped_keys()[section]
    choices = rollout_keys()
    engine = cfg.rollout.get("engine")
    target = engine.get("_target_") if isinstance(engine, DictConfig) else None
    # A user's own engine class: any key a shipped choice defines (its constructor checks its own).
    return choices.get(target) or frozenset().union(*choices.values())


def validate_known_keys(cfg: DictConfig) -> None:
    """A key the shipped config does not define, in a closed section (`CLOSED_SECTIONS`), is refused naming the
    nearest known key: Hydra's `+` adds any key, and nothing would ever read a misspelt one (or one of another
    rollout choice)."""
    for section in CLOSED_SECTIONS:
        node = cfg if not section else cfg.get(section)
        if not isinstance(node, DictConfig) or "_target_" in node:
            continue
        known = _known_keys(cfg, section)
        for key in node:
            if key in known:
                continue
            dotted = f"{section}.{key}" if section else str(key)
            near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.5)
            hint = f"did you mean {section + '.' if section else ''}{near[0]}? " if near else ""
            raise ValueError(
                f"config {dotted}={node._get_node(key)._value()!r}: must be a key the shipped config defines (in "
                f"{section or 'the top level'}: {', '.join(sorted(known))}); {hint}fix the spelling, or drop the "
                "key (Hydra's + adds any key, and nothing reads this one)"
            )
