"""The figures the README quotes for its main command, `train.py algo=grpo rollout.top_p=0.9`: runs that command
(the default run is seeded, and on one CPU it repeats to the last digit) and reads what its summary prints.

    .venv/bin/python scripts/readme_figures.py           # run it, print the figures and whether README.md holds them
    .venv/bin/python scripts/readme_figures.py --write   # run it and write the figures into README.md

Each figure sits in a phrase of README.md (`PHRASES`); `--write` replaces the numbers inside those phrases only.
tests/test_readme_figures.py runs this and fails when the README quotes other numbers for this machine's CPU kind.
The figures depend on the CPU kind, not on its load: an Intel Xeon gives the same ones under AVX2 and AVX-512
kernels, an AMD EPYC (AVX2) others, because its kernels round differently and a seeded run then samples other
tokens. The README quotes both kinds (`PHRASES`, by a name in the CPU's model name). The wall time is printed, not
checked: it depends on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMAND = ("algo=grpo", "rollout.top_p=0.9")  # the README's main command

# Phrases of README.md holding one CPU kind's figures by name (whitespace matches any line break), keyed by a name
# in the CPU's model name (/proc/cpuinfo).
PHRASES = {
    "Intel(R) Xeon(R)": (
        "reward mean {reward_first} in the first fifth of the run, {reward_last} in the last fifth",
        "match the rollout's to {masked} with the mask (`train/rollout_logprob_abs_diff`; largest {masked_max})",
        "against {unmasked} over the full vocabulary",
    ),
    "AMD EPYC": ("On an AMD EPYC the same run prints {reward_first} and {reward_last}, {masked} (largest {masked_max}) "
                 "and {unmasked} unmasked",),
}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or platform.processor() where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def cpu_kind(name: str) -> str | None:
    """The key of `PHRASES` whose figures a CPU named `name` prints, or None for a kind the README does not quote."""
    return next((kind for kind in PHRASES if kind in name), None)


def run_default(run_dir: Path) -> dict[str, float]:
    """Runs the README's command in `run_dir` and returns its `summary.json`."""
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *COMMAND, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"train.py {' '.join(COMMAND)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def short_exp(value: float) -> str:
    """3 significant digits in the README's style: 3.72e-7, not 3.72e-07."""
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def figures(summary: dict[str, float]) -> dict[str, str]:
    """The README's figures as it prints them (the summary's rounding)."""
    return {
        "reward_first": f"{summary['reward_first']:.3f}",
        "reward_last": f"{summary['reward_last']:.3f}",
        "masked": short_exp(summary["train/rollout_logprob_abs_diff"]),
        "masked_max": short_exp(summary["train/rollout_logprob_abs_diff_max"]),
        "unmasked": f"{summary['train/rollout_logprob_abs_diff_unmasked']:.3f}",
    }


def phrase_pattern(phrase: str) -> re.Pattern[str]:
    """A phrase as a regex: each {name} a group of one number, each run of spaces any whitespace."""
    parts = re.split(r"\{(\w+)\}", phrase)
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(rf"(?P<{part}>[-+.\w]+?)")
        else:
            out.append(r"\s+".join(re.escape(word) for word in part.split(" ")))
    return re.compile("".join(out))


def quoted(text: str, kind: str) -> dict[str, str]:
    """The figures `text` quotes for CPU `kind` (`PHRASES`); a phrase found other than once is an error naming it."""
    out: dict[str, str] = {}
    for phrase in PHRASES[kind]:
        matches = list(phrase_pattern(phrase).finditer(text))
        if len(matches) != 1:
            raise ValueError(f"README.md holds the phrase {phrase!r} {len(matches)} times; it must hold it once")
        out |= matches[0].groupdict()
    return out


def rewrite(text: str, values: dict[str, str], kind: str) -> str:
    """`text` with the figures of CPU `kind`'s phrases replaced by `values`, everything else as it was."""
    quoted(text, kind)  # each phrase once
    for phrase in PHRASES[kind]:
        match = phrase_pattern(phrase).search(text)
        spans = sorted(((match.start(g), match.end(g), values[g]) for g in match.groupdict()), reverse=True)
        for start, end, value in spans:
            text = text[:start] + value + text[end:]
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the figures into README.md")
    args = parser.parse_args(argv)
    name = cpu_name()
    kind = cpu_kind(name)
    if kind is None:
        print(f"README.md quotes the figures of {' and '.join(PHRASES)} CPUs; this one ({name or 'unnamed'}) is "
              "neither: add its phrase to PHRASES to quote it", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_default(Path(tmp) / "run")
    values = figures(summary)
    print(f"train.py {' '.join(COMMAND)} on {name}: {summary['steps']} steps, {summary['wall_s']:.1f} s of training")
    for key, value in values.items():
        print(f"  {key}: {value}")
    text = README.read_text()
    if args.write:
        README.write_text(rewrite(text, values, kind))
        print(f"written into {README} ({kind})")
        return 0
    stale = {k: v for k, v in quoted(text, kind).items() if v != values[k]}
    print(f"README.md quotes other figures for {kind}: {stale}" if stale else f"README.md quotes these ({kind})")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
