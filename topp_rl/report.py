"""`python -m topp_rl.report RUN_DIR [--out DIR]`: PNG plots of a training run, or of every job of a sweep.

Reads the Lightning CSV log every logger option writes (`<job>/csv/version_<n>/metrics.csv`; `logger=wandb`
and `logger=tensorboard` write it next to their own files), never W&B's private transaction log. A job is the
directory holding a `csv/` dir; several versions in one job (resumes) are merged in version order, later ones
winning on the same step and metric. Pointed at a sweep directory (several jobs), each plot draws one curve per
job, labelled by the job's directory name. Also reads the candidate-set size counts the `SupportStats` callback
saves (`support_size_counts.json`, per job). Renders:
- `reward.png`: rollout/reward_mean per step (band: +- rollout/reward_std; accuracy when logged);
- `mismatch.png`: mean |train - rollout| log-prob on the on-policy pass, with and without the candidate mask;
- `val.png`: held-out evaluation (val/accuracy, val/pass@k, val/mean@k), when the run evaluated;
- `support_size_hist.png`: histogram of candidate-set sizes over the run's trainable tokens.
With `--group-seeds` (a sweep over seeds), jobs whose names differ only in `seed<N>` form one variant, and
`seeds.png` draws each variant's mean over seeds with a min-max band, one panel per metric of `SEED_PANELS`, and
`seeds.md` tabulates each metric's start and end per variant (mean over seeds of the first / last `SUMMARY_POINTS`
logged values; `val/*` metrics: the first / last evaluation), with the range over seeds.
"""

import argparse
import csv
import json
import math
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

COUNTS_FILE = "support_size_counts.json"  # written by callbacks.SupportStats

History = dict[str, list[tuple[float, float]]]  # metric -> [(step, value)], sorted by step
Jobs = dict[str, History]  # job label ("" for a single run) -> its history

REWARD = "rollout/reward_mean"
MISMATCH = ("train/rollout_logprob_abs_diff", "train/rollout_logprob_abs_diff_unmasked")
SEED_PANELS = (  # (metric, title) of seeds.png
    (REWARD, "rollout reward mean"), ("val/accuracy", "held-out greedy accuracy"), ("val/mean@k", "held-out mean@k"),
    ("train/entropy", "entropy"), ("train/clip_frac", "clip fraction"), ("train/grad_norm", "grad norm"),
    (MISMATCH[0], "|train - rollout|, mask on"), (MISMATCH[1], "|train - rollout|, mask off"),
)


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


def load_jobs(run_dir: Path) -> Jobs:
    """{job label: history}; one job (label "") for a single run's directory."""
    jobs = job_csvs(run_dir)
    if not jobs:
        raise ValueError(
            f"no metrics found under {run_dir}: expected a Lightning metrics.csv (<run dir>/csv/version_*/"
            "metrics.csv, written with logger=csv, wandb or tensorboard); pass a run's or a sweep's output directory"
        )
    several = len(jobs) > 1
    return {_label(job, run_dir, several): read_csv_history(paths) for job, paths in jobs.items()}


def load_history(run_dir: Path) -> History:
    """The history of a single run (refuses a sweep directory: use `load_jobs`)."""
    jobs = load_jobs(run_dir)
    if len(jobs) > 1:
        raise ValueError(f"{run_dir} holds {len(jobs)} jobs ({', '.join(jobs)}); read it with load_jobs")
    return next(iter(jobs.values()))


def _name(job: str, what: str) -> str:
    return f"{job}: {what}" if job else what


def reward_figure(jobs: Jobs) -> Figure | None:
    present = {job: h for job, h in jobs.items() if REWARD in h}
    if not present:
        return None
    fig, ax = plt.subplots(figsize=(7 if len(present) > 1 else 6, 4))
    for job, history in present.items():
        steps, mean = zip(*history[REWARD], strict=True)
        (line,) = ax.plot(steps, mean, marker="o", ms=3, label=_name(job, "reward mean"))
        std = dict(history.get("rollout/reward_std", []))
        if std and all(s in std for s in steps):
            low = [m - std[s] for s, m in zip(steps, mean, strict=True)]
            high = [m + std[s] for s, m in zip(steps, mean, strict=True)]
            ax.fill_between(steps, low, high, alpha=0.2 / len(present), color=line.get_color(),
                            label=None if job else "+- std")
        if "rollout/accuracy" in history:
            ax.plot(*zip(*history["rollout/accuracy"], strict=True), ls="--", color=line.get_color(),
                    label=_name(job, "accuracy"))
    ax.set(xlabel="step", ylabel="reward", title="Reward")
    ax.legend(fontsize="small")
    return fig


def mismatch_figure(jobs: Jobs) -> Figure | None:
    if not any(k in h for h in jobs.values() for k in MISMATCH):
        return None
    fig, ax = plt.subplots(figsize=(7 if len(jobs) > 1 else 6, 4))
    values = []
    for i, (job, history) in enumerate(jobs.items()):
        colour = f"C{i}" if job else None  # one colour per job; a single run keeps one colour per curve
        for key, label, style in zip(MISMATCH, ("mask on", "mask off (full vocabulary)"), ("-", "--"), strict=True):
            if key in history:
                steps, v = zip(*history[key], strict=True)
                ax.plot(steps, v, marker="o", ms=3, ls=style if job else "-", color=colour, label=_name(job, label))
                values += v
    if min(values) > 0:
        ax.set_yscale("log")
    else:  # an exact zero would vanish on a log axis
        ax.set_yscale("symlog", linthresh=1e-9)
    ax.set(xlabel="step", ylabel="mean |log p_train - log p_rollout|", title="On-policy log-prob mismatch")
    ax.legend(fontsize="small")
    return fig


VAL = (("val/accuracy", "greedy accuracy", "-"), ("val/pass@k", "pass@k", "--"), ("val/mean@k", "mean@k", ":"))


def val_figure(jobs: Jobs) -> Figure | None:
    """Held-out evaluation (`eval.every_n_steps`): greedy accuracy, pass@k and mean@k per evaluation."""
    if not any(key in h for h in jobs.values() for key, _, _ in VAL):
        return None
    fig, ax = plt.subplots(figsize=(7 if len(jobs) > 1 else 6, 4))
    for i, (job, history) in enumerate(jobs.items()):
        colour = f"C{i}" if job else None
        for key, label, style in VAL:
            if key in history:
                steps, v = zip(*history[key], strict=True)
                ax.plot(steps, v, marker="o", ms=3, ls=style, color=colour, label=_name(job, label))
    ax.set(xlabel="step", ylabel="held-out score", title="Evaluation", ylim=(-0.02, 1.02))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")
    return fig


def read_counts(run_dir: Path) -> dict[str, dict[int, int]]:
    """{job label: {candidate-set size: tokens}} from each job's support_size_counts.json."""
    files = sorted(run_dir.rglob(COUNTS_FILE))  # SupportStats writes it into the job's run dir
    several = len(files) > 1
    out = {}
    for path in files:
        counts = {int(k): int(v) for k, v in json.loads(path.read_text())["counts"].items()}
        if counts:
            out[_label(path.parent, run_dir, several)] = counts
    return out


def support_figure(counts_by_job: dict[str, dict[int, int]]) -> Figure | None:
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
    ax.set(xlabel="candidate-set size", ylabel="tokens", title=f"Candidate-set sizes ({total} tokens)")
    if len(counts_by_job) > 1 or "" not in counts_by_job:
        ax.legend(fontsize="small")
    return fig


def variant_of(job: str) -> str:
    """A job label without its sweep number and seed: `3-p0.9-maskTrue-seed1` -> `p0.9-maskTrue`."""
    name = re.sub(r"^\d+-", "", Path(job).name)
    return re.sub(r"[-_]?seed\d+", "", name) or name


def group_seeds(jobs: Jobs) -> dict[str, list[History]]:
    groups: dict[str, list[History]] = defaultdict(list)
    for job, history in jobs.items():
        groups[variant_of(job)].append(history)
    return dict(groups)


def seed_band(histories: list[History], key: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """(steps, mean, min, max) over the histories holding `key`, at the steps every one of them logged."""
    series = [dict(h[key]) for h in histories if key in h]
    if not series:
        return [], [], [], []
    steps = sorted(set.intersection(*(set(s) for s in series)))
    values = [[s[step] for s in series] for step in steps]
    return steps, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


SUMMARY_POINTS = 5


def seed_summary(groups: dict[str, list[History]]) -> list[dict]:
    """Per variant and metric of SEED_PANELS: start / end (mean over seeds) and the end's min / max over seeds."""
    rows = []
    for variant, histories in groups.items():
        for key, _ in SEED_PANELS:
            series = [[v for _, v in h[key]] for h in histories if h.get(key)]
            if not series:
                continue
            k = 1 if key.startswith("val/") else SUMMARY_POINTS
            start = [sum(s[:k]) / len(s[:k]) for s in series]
            end = [sum(s[-k:]) / len(s[-k:]) for s in series]
            rows.append({"variant": variant, "metric": key, "seeds": len(series), "start": sum(start) / len(start),
                         "end": sum(end) / len(end), "end_min": min(end), "end_max": max(end)})
    return rows


def seed_markdown(rows: list[dict]) -> str:
    lines = [f"Start / end: mean over seeds of the first / last {SUMMARY_POINTS} logged values (val/*: first / last "
             "evaluation); range: the end's min and max over seeds.", "",
             "| variant | metric | seeds | start | end | end range |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['metric']} | {r['seeds']} | {r['start']:.4g} | {r['end']:.4g} | "
              f"{r['end_min']:.4g} to {r['end_max']:.4g} |" for r in rows]
    return "\n".join(lines) + "\n"


def _write_text(text: str, path: Path) -> Path:
    path.write_text(text)
    return path


def seeds_figure(groups: dict[str, list[History]]) -> Figure | None:
    panels = [(k, t) for k, t in SEED_PANELS if any(k in h for hs in groups.values() for h in hs)]
    if not panels:
        return None
    cols = 4 if len(panels) > 4 else len(panels)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        for i, (variant, histories) in enumerate(groups.items()):
            steps, mean, low, high = seed_band(histories, key)
            if steps:
                n = sum(key in h for h in histories)
                ax.plot(steps, mean, marker="o", ms=2, color=f"C{i}", label=f"{variant} ({n} seeds)")
                ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.15)
        if key in MISMATCH:
            ax.set_yscale("log")
        ax.set(title=title, xlabel="step")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize="small")
    fig.suptitle("Mean over seeds (band: min to max)")
    fig.tight_layout(rect=(0, 0.06 + 0.02 * math.ceil(len(labels) / 3), 1, 1))
    return fig


def _save(fig: Figure | None, path: Path) -> Path | None:
    if fig is None:
        return None
    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and set sizes are integers
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render(run_dir: str | Path, *, out_dir: str | Path | None = None, seeds: bool = False) -> list[Path]:
    """Write the run's (or sweep's) PNGs into `out_dir` (default RUN_DIR/plots); returns the paths written."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist; pass a training run's output directory")
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    jobs = load_jobs(run_dir)
    written = [
        _save(reward_figure(jobs), out / "reward.png"),
        _save(mismatch_figure(jobs), out / "mismatch.png"),
        _save(val_figure(jobs), out / "val.png"),
        _save(support_figure(read_counts(run_dir)), out / "support_size_hist.png"),
        _save(seeds_figure(group_seeds(jobs)), out / "seeds.png") if seeds else None,
        _write_text(seed_markdown(seed_summary(group_seeds(jobs))), out / "seeds.md") if seeds else None,
    ]
    return [p for p in written if p is not None]


def main(argv: list[str] | None = None, *, prog: str = "python -m topp_rl.report") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])  # `topp-rl report` names itself
    parser.add_argument("run_dir", help="a training run's output directory, or a sweep's (one curve per job)")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    parser.add_argument("--group-seeds", action="store_true",
                        help="also seeds.png: jobs differing only in seed<N> as one variant (mean, min-max band)")
    args = parser.parse_args(argv)
    try:
        paths = render(args.run_dir, out_dir=args.out, seeds=args.group_seeds)
    except ValueError as err:
        parser.error(str(err))  # exit status 2 with the message, no traceback
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
