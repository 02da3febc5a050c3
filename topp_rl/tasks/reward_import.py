"""Reward functions named in config, and the start-up check of every reward a task config names.

A function is named `pkg.mod:fn` (imported from `sys.path`) or `path/to/file.py:fn` (loaded from that file; a
relative path is taken from the working directory). `python train.py` puts the script's directory on `sys.path`,
not the working directory, so a `myrewards.py` beside the user is not importable as `myrewards`: the error says
so, names the working directory and gives the `file.py:fn` form.

`check_reward_config` runs in `validate_config`, before any model loads, so a wrong name fails in a second.
"""

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def resolve_reward_fn(spec: str, *, key: str = "reward_fn") -> Callable:
    """ "pkg.mod:fn" or "path/to/file.py:fn" -> the function (`key`: the config key named in errors)."""
    target, sep, attr = str(spec).rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(
            f"{key} ({spec!r}) must look like 'package.module:function' or 'path/to/file.py:function'"
        )
    module = _load_file(target, spec, key) if target.endswith(".py") else _import(target, spec, key)
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{key} {spec!r}: {target} has no attribute {attr!r}; check the name")
    if not callable(fn):
        raise ValueError(f"{key} {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def _import(module_name: str, spec: str, key: str = "reward_fn"):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # The module itself (or its package) is missing, not something it imports.
        if err.name is not None and (module_name == err.name or module_name.startswith(f"{err.name}.")):
            raise ValueError(_not_importable(module_name, spec, err.name, key)) from err
        raise ValueError(
            f"{key} {spec!r}: importing {module_name} raised ModuleNotFoundError: {err}; install what it imports"
        ) from err
    except Exception as err:
        raise ValueError(f"{key} {spec!r}: importing {module_name} raised {type(err).__name__}: {err}") from err


def _not_importable(module_name: str, spec: str, missing: str, key: str = "reward_fn") -> str:
    cwd = Path.cwd()
    file = module_name.replace(".", "/") + ".py"
    attr = str(spec).rpartition(":")[2]
    found = cwd / file
    fix = (
        f"{found} exists: name it by its file, {file}:{attr}"
        if found.is_file()
        else f"name its file instead, e.g. {Path(file).name}:{attr} or path/to/{Path(file).name}:{attr} (a relative "
        "path is taken from the working directory), or install the module or put its directory on PYTHONPATH"
    )
    return (
        f"{key} {spec!r} cannot be imported: no module named {missing!r} on sys.path (the script's directory, "
        f"PYTHONPATH and installed packages; the working directory is {cwd}); {fix}"
    )


def _load_file(path_text: str, spec: str, key: str = "reward_fn"):
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ValueError(
            f"{key} {spec!r}: file {path} does not exist (working directory: {Path.cwd()}); pass an existing "
            ".py file"
        )
    # A private module name per file: two reward files both called rewards.py must not replace each other.
    name = f"topp_rl_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before exec: dataclasses / pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(f"{key} {spec!r}: loading {path} raised {type(err).__name__}: {err}") from err
    return module


def check_reward_config(task: Mapping[str, Any], *, required: bool = True, step: str = "") -> None:
    """Resolve every reward function and `_target_` class that `task` (a task config node) names; raises the
    ValueError of the first that does not resolve. Nothing is built (a reward model's weights load later).
    A task that takes `reward_fn` / `rewards` must set one where the rollout step calls the task's reward
    (`required`; `step`: its class, named in the message); the multi-turn steps never do."""
    if required and "reward_fn" in task and not task.get("reward_fn") and not task.get("rewards"):
        raise ValueError(f"config task.reward_fn=None / task.rewards={task.get('rewards')!r}: must set one with "
                         f"rollout.step={step or 'SingleTurnStep'} (it scores each response with the task's "
                         "reward); set task.reward_fn=pkg.mod:fn or path/to/file.py:fn, or task.rewards=[{fn: ..., "
                         "weight: ...}, ...] (a multi-turn step, rollout/step=agent or task=agent, needs neither)")
    named = [task["reward_fn"]] if task.get("reward_fn") else []
    for entry in task.get("rewards") or ():
        fn = entry.get("fn", entry) if isinstance(entry, Mapping) else entry
        named.append(fn)
    for item in named:
        if isinstance(item, str):
            resolve_reward_fn(item)
        elif isinstance(item, Mapping) and "_target_" in item:
            _check_target(str(item["_target_"]))


def _check_target(target: str) -> None:
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise ValueError(f"reward _target_ ({target!r}) must be a dotted path, e.g. topp_rl.tasks.RewardModel")
    module = _import(module_name, f"{module_name}:{attr}")
    if not callable(getattr(module, attr, None)):
        raise ValueError(f"reward _target_ {target!r}: {module_name} has no class or function {attr!r}")
