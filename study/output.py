"""The ratio study's outputs: `ratios.md` (table + run facts), `ratios.csv`, `ratios.json` and the PNG."""

import csv
import json
from pathlib import Path

import torch

from study.ratios import EngineRun
from study.stats import table_rows

COLUMNS = ("engine", "temperature", "truncation", "scoring", "tokens", "ratio_mean", "ratio_median", "ratio_p5",
           "ratio_p95", "outside_0.9_1.1", "kl_k3", "max_abs_log_ratio", "kept_size_mean", "kept_mass_mean",
           "aborted_samples")


def rows_of(runs: list[EngineRun]) -> list[dict]:
    return [row for run in runs for setting, fig in run.figures.items()
            for row in table_rows(fig, engine=run.engine, temperature=setting.temperature,
                                  truncation=setting.truncation)]


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"
    return str(value)


def compact(rows: list[dict]) -> list[str]:
    """One line per engine x setting: the unmasked figures, and the masked ones that should be ~1."""
    pairs: dict[tuple, dict] = {}
    for r in rows:
        pairs.setdefault((r["engine"], r["temperature"], r["truncation"]), {})[r["scoring"]] = r
    lines = ["| engine | T | truncation | tokens | kept size | kept mass | unmasked ratio mean / median / p5 / p95 | "
             "unmasked outside [0.9, 1.1] | unmasked k3 KL | masked max abs log ratio | masked outside |",
             "|" + "---|" * 11]
    for (engine, temp, trunc), d in pairs.items():
        m, u = d["masked"], d["unmasked"]
        quartet = " / ".join(f"{u[k]:.3g}" for k in ("ratio_mean", "ratio_median", "ratio_p5", "ratio_p95"))
        lines.append(f"| {engine} | {temp:g} | {trunc} | {u['tokens']} | {u['kept_size_mean']:.4g} | "
                     f"{u['kept_mass_mean']:.3g} | {quartet} | {100 * u['outside_0.9_1.1']:.1f}% | {u['kl_k3']:.2g} | "
                     f"{m['max_abs_log_ratio']:.1e} | {100 * m['outside_0.9_1.1']:.0f}% |")
    return lines


def markdown(rows: list[dict], facts: dict) -> str:
    lines = ["# Importance ratios with and without the keep-sampling mask", ""]
    lines += [f"- {k}: {v}" for k, v in facts.items()] + [""]
    lines += ["## Summary", "", *compact(rows), "", "## All figures", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_tables(rows: list[dict], facts: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "ratios.md", out / "ratios.csv", out / "ratios.json"]
    paths[0].write_text(markdown(rows, facts))
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({c: r[c] for c in COLUMNS} for r in rows)
    paths[2].write_text(json.dumps({"facts": facts, "rows": rows}, indent=1) + "\n")
    return paths


def plot(runs: list[EngineRun], path: Path) -> Path:
    """Box plots of exp(train - rollout) per setting (whiskers p5-p95), masked vs unmasked; one panel per
    engine x temperature."""
    import matplotlib  # here, not at import: the tables need no plotting library

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    temps = sorted({s.temperature for run in runs for s in run.figures}, reverse=True)
    fig, axes = plt.subplots(len(runs), len(temps), figsize=(6.5 * len(temps), 3.6 * len(runs)), squeeze=False)
    for r, run in enumerate(runs):
        for c, temp in enumerate(temps):
            ax = axes[r][c]
            settings = [s for s in run.figures if s.temperature == temp]
            if not settings:  # a run stopped early (partial figures)
                ax.set_title(f"{run.engine}, T={temp:g}: not run")
                ax.axis("off")
                continue
            for k, (scoring, colour) in enumerate((("masked", "C0"), ("unmasked", "C1"))):
                data = [torch.exp(getattr(run.figures[s], scoring) - run.figures[s].rollout).numpy() for s in settings]
                pos = [3 * i + k for i in range(len(settings))]
                box = ax.boxplot(data, positions=pos, widths=0.8, whis=(5, 95), showfliers=False, patch_artist=True)
                for patch in box["boxes"]:
                    patch.set_facecolor(colour)
                ax.plot([], [], color=colour, lw=6, label=scoring)
            ax.set_xticks([3 * i + 0.5 for i in range(len(settings))], [s.truncation for s in settings],
                          rotation=30, fontsize="small")
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.set(title=f"{run.engine}, T={temp:g} ({run.prompts} prompts)", ylabel="exp(train - rollout)")
            ax.legend(fontsize="small", loc="lower left")
    fig.suptitle("Importance ratio per token, trainer over rollout (box: p25-p75, whiskers: p5-p95)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
