"""The shipped parallel/ config options, read from their YAML files: what each sets under `parallel`."""

import functools
from pathlib import Path

import yaml

from topp_rl.paths import config_dir


@functools.cache
def parallel_options() -> dict[str, dict]:
    """Each parallel/ option's name -> the `parallel` node it sets (with its defaults' keys: tp2 -> megatron's)."""
    return {path.stem: _parallel_node(path) for path in sorted((config_dir() / "parallel").glob("*.yaml"))}


def _parallel_node(path: Path) -> dict:
    """The `parallel` keys a parallel/ option sets, with those of the options its defaults list (tp2 -> megatron).
    parallel=none is package `parallel` (its keys at the top); the others are `_global_` with a `parallel` node."""
    data = yaml.safe_load(path.read_text()) or {}
    node = dict(data["parallel"]) if "parallel" in data else {k: v for k, v in data.items() if k != "defaults"}
    for entry in data.get("defaults", []):
        if isinstance(entry, str) and entry != "_self_":
            node = {**_parallel_node(path.parent / f"{entry}.yaml"), **node}
    return node
