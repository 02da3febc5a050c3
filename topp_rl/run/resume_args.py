"""Resume from the run dir alone: `python train.py hydra.run.dir=DIR ckpt_path=last` (or `topp-rl resume DIR`)
starts from the overrides the run recorded (`DIR/.hydra/overrides.yaml`, written at each accepted start), with the
ones given now on top; the resume is then checked as any other (`resume.guarded_keys`, `topp_rl.run.rundir`).

An override's key is what it sets: `rollout.top_p=0.9` and `+rollout.top_p=0.9` set `rollout.top_p`, `rollout=sglang`
sets the group `rollout`, `~key` deletes `key`. A recorded override whose key the command line sets again is left
out, so the command line wins; the run dir and the checkpoint always come from the command line.
"""

import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

RECORDED = Path(".hydra") / "overrides.yaml"
FROM_COMMAND_LINE = ("hydra.run.dir", "ckpt_path")  # never taken from the record


def override_key(override: str) -> str:
    """The key an override sets: `+a.b=1` -> `a.b`, `rollout=sglang` -> `rollout`, `~a` -> `a`."""
    return override.split("=", 1)[0].lstrip("+~").strip()


def unquoted(value: str) -> str:
    """A value as Hydra reads it back from one pair of quotes (`sweep.run_dir_override` quotes a dir holding `=`)."""
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else value


def recorded_overrides(run_dir: Path) -> list[str] | None:
    """The overrides of the run's latest accepted start, or None when the dir has no record (not a run dir)."""
    path = Path(run_dir) / RECORDED
    if not path.is_file():
        return None
    return [str(o) for o in OmegaConf.load(path) or []]


def resume_overrides(run_dir: Path, given: Sequence[str]) -> list[str]:
    """The run's recorded overrides less those `given` sets again (or the run dir / checkpoint), then `given`."""
    recorded = recorded_overrides(run_dir)
    if recorded is None:
        raise ValueError(
            f"hydra.run.dir={run_dir}: no {RECORDED} there, so there is no recorded run to resume from; point "
            "hydra.run.dir at a run's dir (it holds checkpoints/ and .hydra/), or pass all of the run's overrides"
        )
    mine = {override_key(o) for o in given}
    kept = [o for o in recorded if override_key(o) not in mine and override_key(o) not in FROM_COMMAND_LINE]
    return [*kept, *given]


def with_recorded_overrides(overrides: Sequence[str]) -> list[str]:
    """`overrides` of a resume (`ckpt_path=...` and `hydra.run.dir=DIR` among them) with the run's recorded ones
    beneath them (`resume_overrides`, said on stderr); any other command unchanged. A sweep (`-m`) is left alone:
    its jobs' overrides are its own."""
    if any(o in ("-m", "--multirun") or o.startswith("-") for o in overrides):
        return list(overrides)
    values = {override_key(o): o.split("=", 1)[1] for o in overrides if "=" in o}
    if not values.get("ckpt_path") or values.get("ckpt_path") == "null" or "hydra.run.dir" not in values:
        return list(overrides)
    run_dir = Path(unquoted(values["hydra.run.dir"]))
    if recorded_overrides(run_dir) is None:
        return list(overrides)  # not a run dir: the resume's own check names what is missing
    merged = resume_overrides(run_dir, overrides)
    added = merged[:len(merged) - len(overrides)]
    if added:
        print(f"[topp_rl] resuming {run_dir} with its recorded overrides: {' '.join(added)}", file=sys.stderr,
              flush=True)
    return merged
