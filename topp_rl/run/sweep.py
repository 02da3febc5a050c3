"""Names of a Hydra sweep's parts, from the keys it sweeps: job directories (`3-rollout.top_p=0.9,algo=gspo`),
the W&B group (`2026-12-02_14-05-09-copy_digit-tiny [rollout.top_p,algo]`) and each job's W&B run name
(`copy_digit-tiny-gspo-top_p0.9-seed0 [rollout.top_p=0.9,algo=gspo]`); the `<task>-<model>` part of the default
run and sweep dirs and of W&B run names (`task_model_label`).

The swept keys are read from the sweep's `multirun.yaml` (the sweep as typed: its overrides plus
`hydra.sweeper.params`), which Hydra's sweepers write before the first job; without it, every override of the job
counts. Hydra's own `hydra.job.override_dirname` is not used: it names every override, not only the swept ones,
and copies values verbatim, so `model.path=/data/m` made the job dir an absolute path elsewhere.

`conf/config.yaml` names job dirs with the `topp_rl.job_subdir` resolver and run and sweep dirs with
`topp_rl.task_model`, registered on `import topp_rl`.
"""

import hashlib
import re
import shlex
from pathlib import Path

from omegaconf import OmegaConf

MAX_DIR_LABEL_CHARS = 100  # a job dir name stays far below the 255-byte limit of common filesystems
MAX_GROUP_CHARS = 128  # W&B's limit on a group name
_UNSAFE = re.compile(r"[^A-Za-z0-9._,=+@%-]")  # '/' would nest dirs; spaces, quotes, brackets need shell quoting
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_HYDRA_PLAIN = re.compile(r"[A-Za-z0-9_./+%@:-]*")  # a value Hydra's override grammar reads unquoted
_SHELL_DOUBLE_QUOTED = re.compile(r"[^\"$`\\!]*")  # nothing a shell expands or ends inside "..."


def swept_keys(sweep_overrides: list[str]) -> list[str]:
    """Keys the sweep varies (`a=1,2`, `b=range(3)`, `c=choice(x,y)`), in command-line order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(sweep_overrides)
    return [o.get_key_element() for o in parsed if o.is_sweep_override()]


def swept_values(job_overrides: list[str], keys: list[str]) -> dict[str, str]:
    """{swept key: its value as this job set it}, in `keys` order (keys this job lacks are left out)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    values = {o.get_key_element(): o.get_value_element_as_str()
              for o in OverridesParser.create().parse_overrides(job_overrides)}
    return {k: values[k] for k in keys if k in values}


def job_label(job_overrides: list[str], keys: list[str]) -> str:
    """`key=value` of the swept keys as this job set them, comma-separated (keys this job lacks are left out)."""
    return ",".join(f"{k}={v}" for k, v in swept_values(job_overrides, keys).items())


def sweep_keys_of(sweep_dir: str | Path, job_overrides: list[str]) -> list[str]:
    """The swept keys, from `<sweep_dir>/multirun.yaml`; every key of `job_overrides` when the file is missing
    (a sweeper that writes none) or holds no sweep."""
    try:
        recorded = OmegaConf.load(Path(sweep_dir) / "multirun.yaml").hydra
        typed = [f"{k}={v}" for k, v in (recorded.sweeper.get("params") or {}).items()]
        keys = swept_keys(typed + list(recorded.overrides.task))
    except (OSError, AttributeError):
        keys = []
    if keys:
        return keys
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [o.get_key_element() for o in OverridesParser.create().parse_overrides(job_overrides)]


def safe_dir_name(label: str, *, max_chars: int = MAX_DIR_LABEL_CHARS) -> str:
    """`label` as one directory name: characters outside `[A-Za-z0-9._,=+@%-]` become `_`, and a name longer than
    `max_chars` is cut, ending in 8 hex digits of the full label's hash (cut names of two jobs stay distinct)."""
    name = _UNSAFE.sub("_", label)
    if len(name) > max_chars:
        digest = hashlib.sha256(label.encode()).hexdigest()[:8]
        name = f"{name[: max_chars - 9]}-{digest}"
    return name


def job_subdir(num, run_name, sweep_dir, job_overrides) -> str:
    """A sweep job's directory name: `<job number>-<swept key=value,...>`, or `<job number>-<run_name>` when the job
    sets none of the swept keys (resolver `topp_rl.job_subdir` of `hydra.sweep.subdir`)."""
    overrides = [str(o) for o in (OmegaConf.to_container(job_overrides) if OmegaConf.is_config(job_overrides)
                                  else job_overrides)]
    label = job_label(overrides, sweep_keys_of(sweep_dir, overrides)) or str(run_name)
    return f"{num}-{safe_dir_name(label)}"


def sweep_id(sweep_dir: str | Path) -> str:
    """The sweep dir's name, with its parent's when that is a date (`multirun/<date>/<time>-<task>-<model>` ->
    `<date>_<time>-<task>-<model>`)."""
    path = Path(sweep_dir)
    return f"{path.parent.name}_{path.name}" if _DATE.fullmatch(path.parent.name) else path.name


def group_label(sweep_dir: str | Path, keys: list[str]) -> str:
    """The W&B group of a sweep: `<sweep id> [<swept keys>]`, at most MAX_GROUP_CHARS characters."""
    name = f"{sweep_id(sweep_dir)} [{','.join(keys)}]" if keys else sweep_id(sweep_dir)
    return name if len(name) <= MAX_GROUP_CHARS else name[: MAX_GROUP_CHARS - 4] + "...]"


def run_dir_override(path: str | Path) -> str:
    """`hydra.run.dir=PATH` as one shell word that Hydra reads back as PATH: a sweep job's dir holds `=` and `,`,
    which Hydra's override grammar takes only inside quotes (unquoted, `a=1,b=2` is a parse error or a sweep)."""
    path = str(path)
    if _HYDRA_PLAIN.fullmatch(path):
        return f"hydra.run.dir={path}"
    if "'" not in path:
        word = f"hydra.run.dir='{path}'"
    elif '"' not in path:
        word = f'hydra.run.dir="{path}"'
    else:  # both quotes: Hydra's escape inside single quotes
        word = "hydra.run.dir='" + path.replace("'", "\\'") + "'"
    return f'"{word}"' if _SHELL_DOUBLE_QUOTED.fullmatch(word) else shlex.quote(word)


def task_model_label(task: object, model: object, model_path: object = None) -> str:
    """`<task>-<model>` for the default run and sweep dirs: the config group choices (`copy_digit-tiny`), the
    model as its checkpoint's name when it has a path (`model=hf_path model.path=Qwen/Qwen3-0.6B`: `Qwen3-0.6B`)."""
    if model_path not in (None, "", "???"):
        model = Path(str(model_path).rstrip("/")).name or model
    return safe_dir_name(f"{task}-{model}")


def register_resolvers() -> None:
    """`${topp_rl.job_subdir:num,run_name,sweep_dir,overrides}` for conf/config.yaml's `hydra.sweep.subdir`,
    `${topp_rl.task_model:task,model,model_path}` in its run and sweep dirs, and
    `${topp_rl.pick:flag,if_true,if_false}` (a value that follows a boolean key, e.g. the embedded engine's
    batching, continuous under rollout.partial_rollouts)."""
    if not OmegaConf.has_resolver("topp_rl.job_subdir"):
        OmegaConf.register_new_resolver("topp_rl.job_subdir", job_subdir)
    if not OmegaConf.has_resolver("topp_rl.task_model"):
        OmegaConf.register_new_resolver("topp_rl.task_model", task_model_label)
    if not OmegaConf.has_resolver("topp_rl.pick"):
        OmegaConf.register_new_resolver("topp_rl.pick", pick)


def pick(flag: object, if_true: object, if_false: object) -> object:
    """`if_true` when `flag` is true, `if_false` when false; anything else is refused naming the value."""
    if not isinstance(flag, bool):
        raise ValueError(f"${{topp_rl.pick:...}} got {flag!r}: the flag must be true or false")
    return if_true if flag else if_false
