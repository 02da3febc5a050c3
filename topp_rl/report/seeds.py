"""`--group-seeds` of `topp_rl.report`: jobs of a sweep that differ only in their seed form one variant;
`seeds.png` draws each variant's mean over seeds (faint) with its moving average and a min-max band over seeds
clipped to the metric's range, one panel per metric of `SEED_PANELS`; `seeds.md` tabulates each metric's start
and end per variant (mean over seeds of the first / last `SUMMARY_POINTS` logged values; `val/*` metrics: the first
/ last evaluation), with the range over seeds.
"""

import math
import re
from collections import defaultdict
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from topp_rl.report.curves import (
    MISMATCH,
    REWARD,
    Bounds,
    History,
    Jobs,
    draw_band,
    draw_curve,
    figure_title,
    figure_window,
    metric_range,
    smoothing_note,
)

SEED_PANELS = (  # (metric, title) of seeds.png
    (REWARD, "rollout reward mean"), ("val/accuracy", "held-out greedy accuracy"), ("val/mean@k", "held-out mean@k"),
    ("train/entropy", "entropy"), ("train/clip_frac", "clip fraction"), ("train/grad_norm", "grad norm"),
    (MISMATCH[0], "|train - rollout|, mask on"), (MISMATCH[1], "|train - rollout|, mask off"),
)


def variant_of(job: str) -> str:
    """A job label without its sweep number and seed, in both job dir styles: `3-p0.9-maskTrue-seed1` (a run
    name) -> `p0.9-maskTrue`; `3-seed=1,algo=gspo` (swept keys, topp_rl.run.sweep) -> `algo=gspo`."""
    name = re.sub(r"^\d+-", "", Path(job).name)
    name = re.sub(r"(^|,)seed=\d+(?=,|$)", "", name).strip(",")
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


def seeds_figure(groups: dict[str, list[History]], *, smooth: int | None = None,
                 ranges: dict[str, Bounds] | None = None, run: str = "") -> Figure | None:
    panels = [(k, t) for k, t in SEED_PANELS if any(k in h for hs in groups.values() for h in hs)]
    if not panels:
        return None
    cols = 4 if len(panels) > 4 else len(panels)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    window = figure_window([h[k] for hs in groups.values() for h in hs for k, _ in panels if k in h], smooth)
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        bounds = metric_range(key, ranges)
        for i, (variant, histories) in enumerate(groups.items()):
            steps, mean, low, high = seed_band(histories, key)
            if steps:
                n = sum(key in h for h in histories)
                draw_curve(ax, steps, mean, label=f"{variant} ({n} seeds)", colour=f"C{i}", window=window)
                draw_band(ax, steps, low, high, bounds=bounds, window=window, colour=f"C{i}", label=None, alpha=0.15)
        if key in MISMATCH:
            ax.set_yscale("log")
        ax.set(title=title, xlabel="rollout step", ylabel=key)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize="small")
    smoothing = f"; lines: {smoothing_note(window)} (faint: each step)" if window > 1 else ""
    fig.suptitle(figure_title(f"Mean over seeds (band: min to max over seeds, clipped to each metric's range){smoothing}",
                        run))
    fig.tight_layout(rect=(0, 0.06 + 0.02 * math.ceil(len(labels) / 3), 1, 1))
    return fig
