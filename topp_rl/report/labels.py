"""Curve labels for a report of several runs: what differs between their configs, read from each job's recorded
overrides (`<job>/.hydra/overrides.yaml`, written at start by `topp_rl.run.rundir.RunDir`).

A key one job overrides and another does not takes, for the other, its config group's choice
(`.hydra/hydra.yaml`) or its value in `config.yaml`. Keys that only say where and how the run started (`hydra.*`,
`ckpt_path`, `paths.*`) are left out. Jobs without recorded overrides, or whose overrides leave two of them alike,
are labelled by their directories instead.
"""

import os
from pathlib import Path

from omegaconf import OmegaConf

NOT_SET = "(unset)"
_START_KEYS = ("hydra.", "paths.", "ckpt_path")  # where / how a run started, not what it trained


def override_values(job_dir: Path) -> dict[str, str] | None:
    """{key: value as typed} of the job's recorded overrides (`+key=v` as `key`); None without the file."""
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([str(o) for o in OmegaConf.load(path)])
    return {o.key_or_group: o.get_value_element_as_str() for o in parsed
            if not o.is_delete() and not o.key_or_group.startswith(_START_KEYS)}


def default_value(job_dir: Path, key: str) -> str:
    """`key`'s value in a job that does not override it: its config group's choice, else its config value."""
    try:
        choices = OmegaConf.load(job_dir / ".hydra" / "hydra.yaml").hydra.runtime.choices
        if key in choices:
            return str(choices[key])
        value = OmegaConf.select(OmegaConf.load(job_dir / "config.yaml"), key, default=NOT_SET,
                                 throw_on_resolution_failure=False)
    except (OSError, AttributeError):
        return NOT_SET
    return "null" if value is None else str(value)


def override_labels(job_dirs: list[Path]) -> dict[Path, str] | None:
    """{job dir: `key=value,...` of the keys whose values differ between the jobs}, keys in first-typed order;
    None where a job has no recorded overrides or two jobs' labels come out equal (nothing tells them apart)."""
    recorded = {job: override_values(job) for job in job_dirs}
    if any(values is None for values in recorded.values()):
        return None
    keys = list(dict.fromkeys(key for values in recorded.values() for key in values))
    full = {job: {k: values[k] if k in values else default_value(job, k) for k in keys}
            for job, values in recorded.items()}
    differing = [k for k in keys if len({values[k] for values in full.values()}) > 1]
    labels = {job: ",".join(f"{k}={values[k]}" for k in differing) for job, values in full.items()}
    return labels if len(set(labels.values())) == len(labels) and all(labels.values()) else None


def dir_labels(job_dirs: list[Path]) -> dict[Path, str]:
    """{job dir: its path below the jobs' common parent}."""
    parent = Path(os.path.commonpath([p.resolve() for p in job_dirs]))
    below = {job: job.resolve().relative_to(parent) for job in job_dirs}
    return {job: str(path) if path != Path(".") else job.resolve().name for job, path in below.items()}


def run_labels(job_dirs: list[Path]) -> dict[Path, str]:
    """The labels of several runs' curves: their differing overrides, else their directories."""
    return override_labels(job_dirs) or dir_labels(job_dirs)
