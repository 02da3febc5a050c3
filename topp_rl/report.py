"""`python -m topp_rl.report RUN_DIR [--out DIR]`: PNG plots of one training run.

Reads the run's metrics from Lightning CSV files (`**/metrics.csv`) or, when there are none, from W&B offline
runs (`**/run-*.wandb`, the transaction log W&B writes: LevelDB-style 32 KiB blocks of protobuf records, read
here without a W&B service), plus the candidate-set size counts the `SupportStats` callback saves
(`**/support_size_counts.json`). Renders:
- `reward.png`: rollout/reward_mean per step (band: +- rollout/reward_std; accuracy when logged);
- `mismatch.png`: mean |train - rollout| log-prob on the on-policy pass, with and without the candidate mask;
- `support_size_hist.png`: histogram of candidate-set sizes over the run's trainable tokens.
"""

import argparse
import csv
import json
import math
import struct
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

COUNTS_FILE = "support_size_counts.json"  # written by callbacks.SupportStats

History = dict[str, list[tuple[float, float]]]  # metric -> [(step, value)], sorted by step

REWARD = "rollout/reward_mean"
MISMATCH = ("train/rollout_logprob_abs_diff", "train/rollout_logprob_abs_diff_unmasked")


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


_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[bytes]:
    """Payloads of a W&B transaction log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
    records with a 7-byte header (crc32, length, type), split FIRST/MIDDLE/LAST across block ends."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log (no ':W&B' header); pass a run-*.wandb file")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        space = _BLOCK - pos % _BLOCK
        if space < 7:  # block trailer padding
            pos += space
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
        elif kind == 0 and length == 0:  # zero fill at the end of a block
            pos += space - 7
        else:
            raise ValueError(f"{path}: unknown record type {kind} at byte {pos}; the file may be corrupt")


def wandb_run_finished(path: Path) -> bool:
    """Whether the transaction log holds the run's exit record (the run finished and its tail is written)."""
    from wandb.proto import wandb_internal_pb2 as pb

    return any(pb.Record.FromString(p).WhichOneof("record_type") == "exit" for p in wandb_records(path))


def read_wandb_history(paths: list[Path]) -> History:
    """Numeric history items; x = `trainer/global_step` when Lightning logged it, else W&B's own step."""
    from wandb.proto import wandb_internal_pb2 as pb

    merged: dict[str, dict[float, float]] = defaultdict(dict)
    for path in paths:
        for payload in wandb_records(path):
            record = pb.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") != "history":
                continue
            items = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                value = json.loads(item.value_json) if item.value_json else None
                if isinstance(value, int | float) and not isinstance(value, bool):
                    items[key] = float(value)
            step = items.pop("trainer/global_step", float(record.history.step.num))
            for key, value in items.items():
                if not key.startswith("_"):
                    merged[key][step] = value
    return {k: sorted(v.items()) for k, v in merged.items()}


def load_history(run_dir: Path) -> History:
    csvs = sorted(run_dir.rglob("metrics.csv"))
    if csvs:
        return read_csv_history(csvs)
    logs = sorted(run_dir.rglob("run-*.wandb"))
    if logs:
        return read_wandb_history(logs)
    raise ValueError(
        f"no metrics found under {run_dir}: expected a Lightning metrics.csv (logger=csv) or a W&B offline run "
        "(logger=wandb); pass the run's output directory"
    )


def plot_reward(history: History, out: Path) -> Path | None:
    if REWARD not in history:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    steps, mean = zip(*history[REWARD], strict=True)
    ax.plot(steps, mean, marker="o", ms=3, label="reward mean")
    std = dict(history.get("rollout/reward_std", []))
    if std and all(s in std for s in steps):
        low = [m - std[s] for s, m in zip(steps, mean, strict=True)]
        high = [m + std[s] for s, m in zip(steps, mean, strict=True)]
        ax.fill_between(steps, low, high, alpha=0.2, label="+- std")
    if "rollout/accuracy" in history:
        ax.plot(*zip(*history["rollout/accuracy"], strict=True), ls="--", label="accuracy")
    ax.set(xlabel="step", ylabel="reward", title="Reward")
    ax.legend()
    return _save(fig, out / "reward.png")


def plot_mismatch(history: History, out: Path) -> Path | None:
    present = [k for k in MISMATCH if k in history]
    if not present:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    values = []
    for key, label in zip(MISMATCH, ("mask on", "mask off (full vocabulary)"), strict=True):
        if key in history:
            steps, v = zip(*history[key], strict=True)
            ax.plot(steps, v, marker="o", ms=3, label=label)
            values += v
    if min(values) > 0:
        ax.set_yscale("log")
    else:  # an exact zero would vanish on a log axis
        ax.set_yscale("symlog", linthresh=1e-9)
    ax.set(xlabel="step", ylabel="mean |log p_train - log p_rollout|", title="On-policy log-prob mismatch")
    ax.legend()
    return _save(fig, out / "mismatch.png")


def plot_support(run_dir: Path, out: Path) -> Path | None:
    files = sorted(run_dir.rglob(COUNTS_FILE))
    if not files:
        return None
    counts = {int(k): int(v) for k, v in json.loads(files[-1].read_text())["counts"].items()}
    if not counts:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = sorted(counts)
    ax.bar(sizes, [counts[s] for s in sizes], width=0.9 if len(sizes) < 200 else 1.0)
    if max(counts.values()) > 100 * min(counts.values()):
        ax.set_yscale("log")
    ax.set(
        xlabel="candidate-set size",
        ylabel="tokens",
        title=f"Candidate-set sizes ({sum(counts.values())} tokens)",
    )
    return _save(fig, out / "support_size_hist.png")


def _save(fig, path: Path) -> Path:
    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and set sizes are integers
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render(run_dir: str | Path, *, out_dir: str | Path | None = None) -> list[Path]:
    """Write the run's PNGs into `out_dir` (default RUN_DIR/plots); returns the paths written."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist; pass a training run's output directory")
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    history = load_history(run_dir)
    written = [plot_reward(history, out), plot_mismatch(history, out), plot_support(run_dir, out)]
    return [p for p in written if p is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m topp_rl.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a training run's output directory")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        paths = render(args.run_dir, out_dir=args.out)
    except ValueError as err:
        parser.error(str(err))  # exit status 2 with the message, no traceback
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
