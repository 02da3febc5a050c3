"""The table a sweep (`python train.py -m ...`) ends with: one row per job with the values of the swept keys,
reward first / last, the last step's mismatch (`train/rollout_logprob_abs_diff`), wall time (each job's
`summary.json`) and the job's dir, then the command that plots every job of the sweep.

`SweepTable` (a Hydra callback, conf/config.yaml `hydra.callbacks`) prints it from the process that ran the sweep,
after the last job. It reads the sweep dir rather than the jobs' return values, so a launcher that runs jobs in other
processes (on a shared filesystem) gets the same table. A job without `summary.json` (it stopped before its end)
shows `-` for its figures.
"""

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from topp_rl.run.commands import report_command
from topp_rl.run.sweep import sweep_keys_of, swept_values

# (column header, summary.json key, format)
FIGURES = (("reward first", "reward_first", "{:.3f}"), ("reward last", "reward_last", "{:.3f}"),
           ("mismatch last", "mismatch_last", "{:.3g}"), ("wall s", "wall_s", "{:.1f}"))
_JOB_NUMBER = re.compile(r"(\d+)-")  # conf/config.yaml's job dirs: <job number>-<swept key=value,...>


@dataclass(frozen=True)
class SweepJob:
    dir: Path
    overrides: list[str]  # as the job recorded them (.hydra/overrides.yaml)
    summary: dict[str, Any]  # its summary.json; empty when it has none


def sweep_jobs(sweep_dir: Path) -> list[SweepJob]:
    """The jobs of a sweep: the dirs below `sweep_dir` where a run started (`.hydra/overrides.yaml`, written once
    the run dir accepted the start), in job-number order."""
    jobs = []
    for overrides in sweep_dir.glob("*/.hydra/overrides.yaml"):
        job = overrides.parent.parent
        summary = job / "summary.json"
        jobs.append(SweepJob(dir=job, overrides=[str(o) for o in OmegaConf.load(overrides)],
                             summary=json.loads(summary.read_text()) if summary.is_file() else {}))
    return sorted(jobs, key=_job_order)


def _job_order(job: SweepJob) -> tuple[int, str]:
    number = _JOB_NUMBER.match(job.dir.name)
    return (int(number[1]) if number else -1, job.dir.name)


def figure(summary: dict[str, Any], key: str, fmt: str) -> str:
    value = summary.get(key)
    if value is None:
        return "-"
    return value if isinstance(value, str) else fmt.format(value)  # "nan" / "inf" are written as strings


def table_lines(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns two spaces apart, each as wide as its widest cell."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in (header, *rows)]


def sweep_table(sweep_dir: str | Path) -> list[str]:
    """The lines printed at the end of a sweep: a title, one row per job, the plot command."""
    sweep_dir = Path(sweep_dir)
    jobs = sweep_jobs(sweep_dir)
    if not jobs:
        return [f"[topp_rl] sweep finished: no job started in {sweep_dir}"]
    keys = sweep_keys_of(sweep_dir, jobs[0].overrides)
    rows = []
    for job in jobs:
        values = swept_values(job.overrides, keys)
        rows.append([values.get(k, "-") for k in keys] + [figure(job.summary, key, fmt) for _, key, fmt in FIGURES]
                    + [job.dir.name])
    header = keys + [name for name, _, _ in FIGURES] + ["job dir"]
    return [f"[topp_rl] sweep finished: {len(jobs)} jobs in {sweep_dir}", *table_lines(header, rows),
            f"  plots of every job: {report_command()} {shlex.quote(str(sweep_dir))}"]


class SweepTable(Callback):
    """Hydra callback: prints `sweep_table` after a multirun's last job."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        print("\n".join(sweep_table(config.hydra.sweep.dir)), flush=True)
