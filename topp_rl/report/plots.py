"""`python -m topp_rl.report RUN_DIR [RUN_DIR ...] [--out DIR]`: PNG plots of a training run, of every job of a
sweep, or of several runs overlaid.

Reads the Lightning CSV log every logger option writes (`<job>/csv/version_<n>/metrics.csv`; `logger=wandb`
and `logger=tensorboard` write it next to their own files), never W&B's private transaction log. A job is the
directory holding a `csv/` dir; several versions in one job (resumes) are merged in version order, later ones
winning on the same step and metric. Pointed at a sweep directory (several jobs), each plot draws one curve per
job, labelled by the job's directory name. Several run (or sweep) dirs overlay all their jobs, each labelled by
the overrides that differ between them (`topp_rl.report.labels`). Also reads the candidate-set size counts the
`SupportStats` callback saves (`support_size_counts.json`, per job). Renders, each with a title naming the run or sweep and labelled axes:
- `reward.png`: rollout/reward_mean per step (band: +- rollout/reward_std, clipped to the reward's range: the
  job's task's, `curves.task_reward_range`, or `--range`; accuracy when logged);
- `mismatch.png`: mean |train - rollout| log-prob on the on-policy pass, with and without the candidate mask;
- `val.png`: held-out evaluation (val/accuracy, val/pass@k, val/mean@k), when the run evaluated;
- `support_size_hist.png`: histogram of candidate-set sizes over the run's trainable tokens;
- with `--group-seeds`, `seeds.png` and `seeds.md` (`topp_rl.report.seeds`).
Curves are drawn faint as logged and thick as a centred moving average (`topp_rl.report.curves`; `--smooth N` points).
"""

import argparse
import csv
import json
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from topp_rl.report.curves import (  # noqa: E402
    MISMATCH,
    REWARD,
    Bounds,
    History,
    Jobs,
    bounds_note,
    draw_band,
    draw_curve,
    figure_legend,
    figure_title,
    figure_window,
    parse_range,
    task_reward_range,
)
from topp_rl.report.labels import run_labels  # noqa: E402
from topp_rl.report.seeds import group_seeds, seed_band, seed_markdown, seed_summary, seeds_figure, variant_of  # noqa: E402

COUNTS_FILE = "support_size_counts.json"  # written by callbacks.SupportStats
RunDirs = str | Path | Sequence[str | Path]  # one run's or sweep's dir, or several to overlay

__all__ = ["MISMATCH", "REWARD", "History", "Jobs", "group_seeds", "load_history", "load_jobs", "render",
           "seed_band", "seed_markdown", "seed_summary", "seeds_figure", "variant_of"]


def read_csv_history(paths: list[Path]) -> History:
    """Merge Lightning CSV files (later files win on the same step and metric)."""
    merged: dict[str, dict[float, float]] = defaultdict(dict)
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step = float(row.get("step") or "nan")
                for key, value in row.items():
                    if key not in ("step", "epoch") and value not in ("", None) and not math.isnan(step):
                        merged[key][step] = float(value)
    return {k: sorted(v.items()) for k, v in merged.items()}


def _version(path: Path) -> tuple[int, str]:
    """Sort key of `.../version_<n>/metrics.csv`: n numerically (version_10 after version_9)."""
    m = re.fullmatch(r"version_(\d+)", path.parent.name)
    return (int(m[1]) if m else -1, str(path))


def _job_dir(path: Path, run_dir: Path) -> Path:
    """The job of `<job>/<logger name>/version_<n>/metrics.csv`; `run_dir` when the CSV sits higher up."""
    job = path.parent.parent.parent
    return job if job == run_dir or run_dir in job.parents else run_dir


def job_csvs(run_dir: Path) -> dict[Path, list[Path]]:
    """Each job directory under `run_dir` with its CSV files in version order."""
    jobs: dict[Path, list[Path]] = defaultdict(list)
    for path in run_dir.rglob("metrics.csv"):
        jobs[_job_dir(path, run_dir)].append(path)
    return {job: sorted(paths, key=_version) for job, paths in sorted(jobs.items())}


def _label(job: Path, run_dir: Path, several: bool) -> str:
    return str(job.relative_to(run_dir)) if several else ""


def _as_dirs(run_dirs: RunDirs) -> list[Path]:
    return [Path(run_dirs)] if isinstance(run_dirs, str | Path) else [Path(d) for d in run_dirs]


def labelled_jobs(run_dirs: RunDirs) -> dict[str, tuple[Path, list[Path]]]:
    """{job label: (job dir, its CSV files)}. One dir: label "" for a run, the job's path below it for a sweep;
    several dirs: every job of each, labelled by what differs between their configs (`labels.run_labels`)."""
    dirs = _as_dirs(run_dirs)
    for run_dir in dirs:
        if not job_csvs(run_dir):
            raise ValueError(
                f"no metrics found under {run_dir}: expected a Lightning metrics.csv (<run dir>/csv/version_*/"
                "metrics.csv, written with logger=csv, wandb or tensorboard); pass a run's or a sweep's output "
                "directory"
            )
    if len(dirs) == 1:
        jobs = job_csvs(dirs[0])
        return {_label(job, dirs[0], len(jobs) > 1): (job, paths) for job, paths in jobs.items()}
    jobs = {job: paths for run_dir in dirs for job, paths in job_csvs(run_dir).items()}
    labels = run_labels(list(jobs))
    return {labels[job]: (job, paths) for job, paths in jobs.items()}


def load_jobs(run_dirs: RunDirs) -> Jobs:
    """{job label: history}; one job (label "") for a single run's directory."""
    return {label: read_csv_history(paths) for label, (_, paths) in labelled_jobs(run_dirs).items()}


def reward_ranges(run_dirs: RunDirs, ranges: dict[str, Bounds] | None = None) -> dict[str, Bounds]:
    """{job label: its reward's range}: `ranges[REWARD]` when given (--range), else the job's task's
    (`task_reward_range`: the built-in generated tasks'; others unbounded)."""
    return {label: ranges[REWARD] if ranges and REWARD in ranges else task_reward_range(job)
            for label, (job, _) in labelled_jobs(run_dirs).items()}


def load_history(run_dir: Path) -> History:
    """The history of a single run (refuses a sweep directory: use `load_jobs`)."""
    jobs = load_jobs(run_dir)
    if len(jobs) > 1:
        raise ValueError(f"{run_dir} holds {len(jobs)} jobs ({', '.join(jobs)}); read it with load_jobs")
    return next(iter(jobs.values()))


def _name(job: str, what: str) -> str:
    return f"{job}: {what}" if job else what


def reward_figure(jobs: Jobs, *, smooth: int | None = None, reward_ranges: dict[str, Bounds] | None = None,
                  run: str = "") -> Figure | None:
    """rollout/reward_mean per step with its moving average, a +- rollout/reward_std band clipped to the job's
    reward range (`reward_ranges[job]`, else unbounded), and rollout/accuracy (dashed) when logged."""
    present = {job: h for job, h in jobs.items() if REWARD in h}
    if not present:
        return None
    several = len(present) > 1
    window = figure_window([h[REWARD] for h in present.values()], smooth)
    fig, ax = plt.subplots(figsize=(10 if several else 8.5, 4.5))
    for i, (job, history) in enumerate(present.items()):
        colour, bounds = f"C{i}", (reward_ranges or {}).get(job, (None, None))
        steps, mean = zip(*history[REWARD], strict=True)
        draw_curve(ax, steps, mean, label=_name(job, "reward mean"), colour=colour, window=window,
                   raw_label=None if several else "reward mean, each step")
        std = dict(history.get("rollout/reward_std", []))
        if std and all(s in std for s in steps):
            draw_band(ax, steps, [m - std[s] for s, m in zip(steps, mean, strict=True)],
                      [m + std[s] for s, m in zip(steps, mean, strict=True)], bounds=bounds, window=window,
                      colour=colour, alpha=max(0.2 / len(present), 0.06),
                      label=None if several else f"± std of the step's rewards{bounds_note(bounds)}")
        if "rollout/accuracy" in history:
            draw_curve(ax, *zip(*history["rollout/accuracy"], strict=True), label=_name(job, "accuracy"),
                       colour=colour, window=window, style="--")
    ax.set(xlabel="rollout step", ylabel="reward (accuracy: share of samples correct)",
           title=figure_title("Rollout reward", run))
    figure_legend(ax, window)
    return fig


def mismatch_figure(jobs: Jobs, *, smooth: int | None = None, run: str = "") -> Figure | None:
    """Mean |train - rollout| log-prob of the on-policy pass, with the candidate mask (solid) and without (dashed;
    at top_p = 1 and no top-k / min-p the two coincide). One colour per job; a single run's two curves differ."""
    if not any(k in h for h in jobs.values() for k in MISMATCH):
        return None
    several = len(jobs) > 1
    window = figure_window([h[k] for h in jobs.values() for k in MISMATCH if k in h], smooth)
    fig, ax = plt.subplots(figsize=(10 if several else 8.5, 4.5))
    values = []
    for i, (job, history) in enumerate(jobs.items()):
        for j, (key, label, style) in enumerate(zip(MISMATCH, ("mask on", "mask off (full vocabulary)"), ("-", "--"),
                                                    strict=True)):
            if key in history:
                steps, v = zip(*history[key], strict=True)
                draw_curve(ax, steps, v, label=_name(job, label), colour=f"C{i if several else j}", window=window,
                           style=style)
                values += v
    if min(values) > 0:
        ax.set_yscale("log")
    else:  # an exact zero would vanish on a log axis
        ax.set_yscale("symlog", linthresh=1e-9)
    ax.set(xlabel="rollout step", ylabel="mean |log p_train - log p_rollout|",
           title=figure_title("On-policy log-prob mismatch (same weights as the rollout)", run))
    figure_legend(ax, window)
    return fig


VAL = (("val/accuracy", "greedy accuracy", "-"), ("val/pass@k", "pass@k", "--"), ("val/mean@k", "mean@k", ":"))


def val_figure(jobs: Jobs, *, smooth: int | None = None, run: str = "") -> Figure | None:
    """Held-out evaluation (`eval.every_n_steps`): greedy accuracy, pass@k and mean@k per evaluation."""
    if not any(key in h for h in jobs.values() for key, _, _ in VAL):
        return None
    window = figure_window([h[k] for h in jobs.values() for k, _, _ in VAL if k in h], smooth)
    fig, ax = plt.subplots(figsize=(10 if len(jobs) > 1 else 8.5, 4.5))
    for i, (job, history) in enumerate(jobs.items()):
        for j, (key, label, style) in enumerate(VAL):
            if key in history:
                steps, v = zip(*history[key], strict=True)
                draw_curve(ax, steps, v, label=_name(job, label), colour=f"C{i}" if job else f"C{j}", window=window,
                           style=style)
    ax.set(xlabel="rollout step", ylabel="share of held-out prompts / samples correct",
           title=figure_title("Held-out evaluation", run), ylim=(-0.02, 1.02))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure_legend(ax, window)
    return fig


def read_counts(run_dirs: RunDirs) -> dict[str, dict[int, int]]:
    """{job label: {candidate-set size: tokens}} from each job's support_size_counts.json."""
    dirs = _as_dirs(run_dirs)
    if len(dirs) == 1:  # SupportStats writes it into the job's run dir
        files = sorted(dirs[0].rglob(COUNTS_FILE))
        labelled = {_label(path.parent, dirs[0], len(files) > 1): path for path in files}
    else:
        labelled = {label: job / COUNTS_FILE for label, (job, _) in labelled_jobs(dirs).items()
                    if (job / COUNTS_FILE).is_file()}
    out = {}
    for label, path in labelled.items():
        counts = {int(k): int(v) for k, v in json.loads(path.read_text())["counts"].items()}
        if counts:
            out[label] = counts
    return out


def support_figure(counts_by_job: dict[str, dict[int, int]], *, run: str = "") -> Figure | None:
    if not counts_by_job:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    everything = [c for counts in counts_by_job.values() for c in counts.values()]
    for job, counts in counts_by_job.items():
        sizes = sorted(counts)
        if job:  # several jobs: outlines, so every job stays visible
            ax.step(sizes, [counts[s] for s in sizes], where="mid", label=f"{job} ({sum(counts.values())} tokens)")
        else:
            ax.bar(sizes, [counts[s] for s in sizes], width=0.9 if len(sizes) < 200 else 1.0)
    if max(everything) > 100 * min(everything):
        ax.set_yscale("log")
    total = sum(everything)
    ax.set(xlabel="candidate-set size (ids kept by the sampler)", ylabel="trainable tokens",
           title=figure_title(f"Candidate-set sizes ({total} tokens)", run))
    if len(counts_by_job) > 1 or "" not in counts_by_job:
        ax.legend(fontsize="small")
    return fig


def _write_text(text: str, path: Path) -> Path:
    path.write_text(text)
    return path


def _save(fig: Figure | None, path: Path) -> Path | None:
    if fig is None:
        return None
    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and set sizes are integers
    if not fig.legends:  # a figure-level legend (seeds.png) was laid out with the room it needs below the panels
        fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


MAX_TITLE_CHARS = 90


def _run_label(run_dirs: list[Path], jobs: Jobs) -> str:
    """The figure titles' second line: the run dir's name, the sweep's with its job count, or the runs' names."""
    names = [d.resolve().name for d in run_dirs]
    if len(names) > 1:
        label = f"{len(names)} runs: {', '.join(names)}"
        return label if len(label) <= MAX_TITLE_CHARS else label[: MAX_TITLE_CHARS - 3] + "..."
    return f"sweep {names[0]} ({len(jobs)} jobs)" if len(jobs) > 1 else f"run {names[0]}"


def check_run_dirs(run_dirs: list[Path]) -> None:
    for run_dir in run_dirs:
        if not run_dir.is_dir():
            raise ValueError(f"run directory {run_dir} does not exist; pass a training run's output directory")
    given = [d.resolve() for d in run_dirs]
    for i, run_dir in enumerate(given):
        if run_dir in given[:i] or any(p in given for p in run_dir.parents):
            raise ValueError(f"run directory {run_dirs[i]} is given twice (or inside another one given); pass "
                             "each run or sweep dir once")


def check_out_dir(out: Path) -> None:
    """The PNGs' directory (--out) may be absent (it is created) or a directory; a file there (or above it) would
    make mkdir raise a raw FileExistsError / NotADirectoryError."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == out else f"is below the file {existing}"
        raise ValueError(f"--out {out} {where}: the plots go into a directory; pass a directory path (absent: it "
                         "is created), or leave --out out for RUN_DIR/plots")


def check_logged(jobs: Jobs, run_dirs: list[Path]) -> None:
    """Every metrics.csv empty (a run stopped before its first logged step) would write no plot and exit 0."""
    if not any(jobs.values()):
        files = [str(p) for run_dir in run_dirs for paths in job_csvs(run_dir).values() for p in paths]
        raise ValueError(f"no logged values in {', '.join(files)} (empty, or its header only: the run logged no "
                         "step yet); plot a run that trained at least one step (it logs every trainer."
                         "log_every_n_steps steps)")


def default_out_dir(run_dirs: list[Path]) -> Path:
    """RUN_DIR/plots for one run or sweep; FIRST_RUN_DIR/plots/compare for several (a run's own plots stay)."""
    return run_dirs[0] / "plots" / ("compare" if len(run_dirs) > 1 else "")


def render(run_dirs: RunDirs, *, out_dir: str | Path | None = None, seeds: bool = False, smooth: int | None = None,
           ranges: dict[str, Bounds] | None = None) -> list[Path]:
    """Write the run's (or sweep's, or several runs' overlaid) PNGs into `out_dir` (default `default_out_dir`);
    returns the paths written. `smooth`: the moving average's window in points (None: about a sixth of the points;
    0 or 1: none). `ranges`: {metric: (low, high)} over the name-based ranges of `curves.METRIC_RANGES`."""
    dirs = _as_dirs(run_dirs)
    check_run_dirs(dirs)
    if smooth is not None and smooth < 0:
        raise ValueError(f"smooth={smooth}: the moving average's window must be >= 0 points (0 or 1: no smoothing)")
    out = Path(out_dir) if out_dir is not None else default_out_dir(dirs)
    check_out_dir(out)
    jobs = load_jobs(dirs)
    check_logged(jobs, dirs)
    out.mkdir(parents=True, exist_ok=True)
    run = _run_label(dirs, jobs)
    style = {"smooth": smooth, "run": run}
    written = [
        _save(reward_figure(jobs, reward_ranges=reward_ranges(dirs, ranges), **style), out / "reward.png"),
        _save(mismatch_figure(jobs, **style), out / "mismatch.png"),
        _save(val_figure(jobs, **style), out / "val.png"),
        _save(support_figure(read_counts(dirs), run=run), out / "support_size_hist.png"),
        _save(seeds_figure(group_seeds(jobs), ranges=ranges, **style), out / "seeds.png") if seeds else None,
        _write_text(seed_markdown(seed_summary(group_seeds(jobs))), out / "seeds.md") if seeds else None,
    ]
    return [p for p in written if p is not None]


def main(argv: list[str] | None = None, *, prog: str = "python -m topp_rl.report") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])  # `topp-rl report` names itself
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a training run's output directory, or a sweep's (one curve per job); several: their "
                             "curves overlaid, labelled by the overrides that differ between them")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/plots; several dirs: "
                                                    "FIRST_RUN_DIR/plots/compare)")
    parser.add_argument("--group-seeds", action="store_true",
                        help="also seeds.png, seeds.md: jobs differing only in seed<N> or seed=N as one variant "
                             "(mean, min-max band)")
    parser.add_argument("--smooth", type=int, default=None, metavar="N",
                        help="centred moving average over N logged points (default: about a sixth of them; 0: none)")
    parser.add_argument("--range", action="append", default=[], metavar="METRIC=LOW:HIGH", dest="ranges",
                        help="the range METRIC's values can take, for clipping its band (e.g. rollout/reward_mean=0:1;"
                             " fractions and non-negative metrics are known by name); repeatable")
    args = parser.parse_args(argv)
    try:
        ranges = dict(parse_range(text) for text in args.ranges)
        paths = render(args.run_dirs, out_dir=args.out, seeds=args.group_seeds, smooth=args.smooth, ranges=ranges)
    except ValueError as err:
        parser.error(str(err))  # exit status 2 with the message, no traceback
    for path in paths:
        print(path)

