"""`python -m study ratios [options] [hydra overrides...]`: the ratio table of issue 13.

The project's Hydra config is composed from `conf/` with the overrides (`experiment=`, `model=`, `task=`, `seed=`,
...): the model, task (its first `--prompts` examples) and seed come from it; the sampling grid comes from the
options below (`rollout.*` sampling keys are not used). Example, the committed run:
    python -m study ratios experiment=study_countdown --engines embedded,sglang \
        --out docs/results --plot docs/img/ratios.png
Engines run apart (one process each, or on other machines) merge into one table:
    python -m study merge DIR_A DIR_B --out docs/results --plot docs/img/ratios.png
"""

import argparse
import sys
import time
from pathlib import Path

from study.grid import TEMPERATURES, TRUNCATIONS


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m study", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ratios", help="importance ratios with and without the mask, per sampling setting")
    p.add_argument("--engines", default="embedded", help="comma list of embedded, sglang (default: embedded)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per setting (default 64)")
    p.add_argument("--sglang-prompts", type=int, default=16,
                   help="prompts per setting for the SGLang server (CPU: slow; default 16)")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per response at most (default 64)")
    p.add_argument("--truncations", default=",".join(TRUNCATIONS), help="comma list of rule=value")
    p.add_argument("--temperatures", default=",".join(map(str, TEMPERATURES)), help="comma list")
    p.add_argument("--out", type=Path, default=Path("outputs/study_ratios"),
                   help="where ratios.md / .csv / .json go (default outputs/study_ratios)")
    p.add_argument("--plot", type=Path, default=None, help="the PNG (default OUT/ratios.png)")
    p.add_argument("overrides", nargs="*", help="hydra overrides, e.g. experiment=study_countdown model=tiny")
    m = sub.add_parser("merge", help="one table and plot from several ratios runs' output dirs (figures.pt)")
    m.add_argument("dirs", nargs="+", type=Path, help="output dirs (their figures.pt) or partial-<engine>.pt files")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--plot", type=Path, default=None, help="the PNG (default OUT/ratios.png)")
    # Overrides may sit on either side of the options: argparse leaves the later ones over.
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-") or args.command != "ratios"]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "merge":
        return args
    args.overrides = [*args.overrides, *rest]
    engines = args.engines.split(",")
    bad = sorted(set(engines) - {"embedded", "sglang"})
    if bad:
        parser.error(f"--engines {args.engines}: unknown {bad}; choose from embedded, sglang")
    for name in ("prompts", "sglang_prompts", "samples", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 1")
    args.engines = engines
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    from study.run import merge_ratios, run_ratios  # heavy imports after the argument check

    start = time.perf_counter()
    try:
        paths = (run_ratios if args.command == "ratios" else merge_ratios)(args)
    except ValueError as err:
        raise SystemExit(f"python -m study ratios: {err}") from err
    for path in paths:
        print(path)
    print(f"[study] done in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
