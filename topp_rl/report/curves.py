"""What every curve of the report (`topp_rl.report`) shares: the range a metric's values can take (from its name),
the centred moving average drawn over the raw values, and the drawing itself (faint raw line, thick smoothed
line, band clipped to the metric's range).

Smoothing is a centred moving average over `window` consecutive logged points (odd; at the ends the window
shrinks to the points there are, so the smoothed line starts and ends on the data and does not lag as an EMA
does). `smoothing_window` picks about a sixth of the points; 1 means no smoothing.
"""

import math
import re
from collections.abc import Sequence
from pathlib import Path

import yaml
from matplotlib.axes import Axes

History = dict[str, list[tuple[float, float]]]  # metric -> [(step, value)], sorted by step
Jobs = dict[str, History]  # job label ("" for a single run) -> its history
Bounds = tuple[float | None, float | None]  # (lowest, highest) value a metric can take; None: unbounded

REWARD = "rollout/reward_mean"
MISMATCH = ("train/rollout_logprob_abs_diff", "train/rollout_logprob_abs_diff_unmasked")

# First match wins. Rewards are left unbounded here: a reward function may return any float (`task_reward_range`
# knows the built-in tasks'; the report's --range rollout/reward_mean=0:1 declares one).
METRIC_RANGES: tuple[tuple[str, Bounds], ...] = (
    (r"(_frac|_rate)(_unmasked)?$|^rollout/(accuracy|support_coverage)$|^val/(accuracy|pass@k|mean@k)$"
     r"|^health/", (0.0, 1.0)),
    (r"abs_diff|_std$|entropy|grad_norm|length|^perf/|is_ratio|ratio_mean$|kl_k3|^train/lr$|support_size"
     r"|num_micro_batches|weight_staleness", (0.0, None)),
)
MAX_WINDOW = 51
# The built-in generated tasks (topp_rl/tasks/generated.py) score 1 for a right answer, the config key's credit for
# a partial one, else 0.
TASK_CREDIT_KEYS = {
    "topp_rl.tasks.generated.CopyDigitTask": "digit_credit",
    "topp_rl.tasks.generated.ArithmeticTask": "partial_credit",
    "topp_rl.tasks.generated.CountdownTask": "format_credit",
}


def metric_range(key: str, ranges: dict[str, Bounds] | None = None) -> Bounds:
    """The range of `key`'s values: `ranges[key]` when given, else the first METRIC_RANGES pattern it matches,
    else unbounded."""
    if ranges and key in ranges:
        return ranges[key]
    for pattern, bounds in METRIC_RANGES:
        if re.search(pattern, key):
            return bounds
    return (None, None)


def task_reward_range(job_dir: Path) -> Bounds:
    """The reward range of the run in `job_dir`, from its `config.yaml`: [min(0, credit), max(1, credit)] for a
    built-in generated task scored by its own reward; unbounded for any other task, a task given other reward
    functions (`task.rewards` / `task.reward_fn`), or a run dir without the file."""
    try:
        task = (yaml.safe_load((job_dir / "config.yaml").read_text()) or {}).get("task") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return (None, None)
    key = TASK_CREDIT_KEYS.get(task.get("_target_")) if isinstance(task, dict) else None
    if key is None or task.get("rewards") or task.get("reward_fn"):
        return (None, None)
    credit = task.get(key, 0.0)
    if isinstance(credit, bool) or not isinstance(credit, int | float):  # e.g. an unresolved ${...}
        return (None, None)
    return (min(0.0, float(credit)), max(1.0, float(credit)))


def parse_range(text: str) -> tuple[str, Bounds]:
    """`KEY=LO:HI` (either side may be empty: unbounded) -> (KEY, (LO, HI))."""
    key, sep, bounds = text.partition("=")
    low, colon, high = bounds.partition(":")
    try:
        parsed = tuple(float(v) if v.strip() else None for v in (low, high))
    except ValueError:
        parsed = ()
    if not (key and sep and colon and len(parsed) == 2) or (None not in parsed and parsed[0] >= parsed[1]):
        raise ValueError(f"--range {text!r}: expected METRIC=LOW:HIGH with LOW < HIGH, either side may be empty "
                         "(e.g. --range rollout/reward_mean=0:1 or --range train/loss=0:)")
    return key, parsed


def clip(values: Sequence[float], bounds: Bounds) -> list[float]:
    low, high = (-math.inf if bounds[0] is None else bounds[0]), (math.inf if bounds[1] is None else bounds[1])
    return [min(max(v, low), high) for v in values]


def smoothing_window(points: int, requested: int | None = None) -> int:
    """The moving average's window: `requested` (made odd) when given, else about a sixth of the points, odd,
    at most MAX_WINDOW; 1 (no smoothing) for fewer than 12 points."""
    window = requested if requested is not None else min(points // 6, MAX_WINDOW)
    window = max(window, 1)
    return window if window % 2 else window + 1


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Centred moving average: point i is the mean of values[i - h : i + h + 1] (h = window // 2), cut at the ends."""
    half = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half): i + half + 1]
        out.append(sum(part) / len(part))
    return out


def smoothing_note(window: int) -> str:
    return f"{window}-point centred moving average" if window > 1 else "no smoothing"


def draw_curve(ax: Axes, steps: Sequence[float], values: Sequence[float], *, label: str, colour: str, window: int,
               style: str = "-", raw_label: str | None = None) -> None:
    """The raw values as a thin faint line (labelled `raw_label`, unlabelled when None) and their moving average
    as the thick `label`led line; with window 1, the raw values alone as the `label`led line, with markers."""
    if window > 1:
        ax.plot(steps, values, lw=0.8, alpha=0.35, ls=style, color=colour, label=raw_label or "_nolegend_")
        ax.plot(steps, moving_average(values, window), lw=2, ls=style, color=colour, label=label)
    else:
        ax.plot(steps, values, lw=1.5, ls=style, marker="o", ms=3, color=colour, label=label)


def draw_band(ax: Axes, steps: Sequence[float], low: Sequence[float], high: Sequence[float], *, bounds: Bounds,
              window: int, colour: str, label: str | None, alpha: float = 0.2) -> None:
    """A band from `low` to `high` (each smoothed like the curve it surrounds), clipped to `bounds`."""
    if window > 1:
        low, high = moving_average(low, window), moving_average(high, window)
    ax.fill_between(steps, clip(low, bounds), clip(high, bounds), color=colour, alpha=alpha, lw=0,
                    label=label or "_nolegend_")


def bounds_note(bounds: Bounds) -> str:
    """`, clipped to [0, 1]` / `, clipped to >= 0`; empty when unbounded."""
    low, high = bounds
    if low is not None and high is not None:
        return f", clipped to [{low:g}, {high:g}]"
    if low is not None:
        return f", clipped to >= {low:g}"
    return f", clipped to <= {high:g}" if high is not None else ""


def figure_window(series: list[list], smooth: int | None) -> int:
    """One moving-average window per figure (its legend states it), sized by the longest series."""
    return smoothing_window(max((len(x) for x in series), default=0), smooth)


def figure_legend(ax: Axes, window: int) -> None:
    """The legend right of the plot (never over a curve or band), titled with the smoothing."""
    title = f"thick: {smoothing_note(window)}\nfaint: each step" if window > 1 else None
    ax.legend(fontsize="small", title=title, title_fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0),
              borderaxespad=0.0)


def figure_title(what: str, run: str) -> str:
    return f"{what}\n{run}" if run else what
