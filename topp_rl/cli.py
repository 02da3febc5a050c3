"""`topp-rl`, the installed command (pyproject's console script):

- `topp-rl train [GROUP=OPTION ...] [KEY=VALUE ...]`: the Hydra app of `python train.py`, same overrides and
  flags (`-m` sweeps, `--cfg job`, `--help`), over the config tree `topp_rl.paths.config_dir()` finds (the package's
  own copy when installed, `conf/` in a clone), so it runs from any directory;
- `topp-rl plan [GROUP=OPTION ...] [KEY=VALUE ...]`: the placement of trainer ranks and SGLang servers those
  overrides give, printed without building a model or touching a GPU (exit 0), or the reason it is refused (exit 2);
- `topp-rl export CKPT OUT_DIR` = `python -m topp_rl.export`; `topp-rl report RUN_DIR [RUN_DIR ...]` =
  `python -m topp_rl.report`.
"""

import os
import sys
from collections.abc import Sequence

from topp_rl.paths import config_dir
from topp_rl.run.host_memory import request_huge_pages

USAGE = """usage: topp-rl COMMAND [ARGS ...]

commands:
  train   train a policy: topp-rl train [GROUP=OPTION ...] [KEY=VALUE ...] (the overrides of python train.py)
  plan    print where trainer ranks and SGLang servers go: topp-rl plan [GROUP=OPTION ...] [KEY=VALUE ...]
  export  write a checkpoint's policy as an HF model dir: topp-rl export CKPT OUT_DIR
  report  plot a run, a sweep, or several overlaid, from their CSV logs: topp-rl report RUN_DIR [RUN_DIR ...]
          [--out DIR] [--group-seeds]
`topp-rl COMMAND --help` describes each; the train options follow."""


def main(argv: Sequence[str] | None = None) -> None:
    """The console script: dispatch to a command; bad usage exits with status 2, as argparse does."""
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else (None, [])
    if command == "train":
        train_command(rest)
    elif command == "plan":
        plan_command(rest)
    elif command == "export":
        from topp_rl.run import export

        export.main(rest, prog="topp-rl export")
    elif command == "report":
        from topp_rl import report

        report.main(rest, prog="topp-rl report")
    elif command in ("-h", "--help"):
        print(USAGE + "\n", flush=True)
        train_command(["--help"])
    else:
        problem = f"unknown command {command!r}" if command else "no command given"
        print(f"{USAGE}\ntopp-rl: error: {problem}; use train, plan, export or report", file=sys.stderr)
        sys.exit(2)


def plan_command(overrides: Sequence[str]) -> None:
    """Compose the config from `overrides`, check it as a run's start does and print its placement; exit 2 with the
    reason where the config is refused. Nothing is built or started."""
    if any(o in ("-h", "--help") for o in overrides):
        print("usage: topp-rl plan [GROUP=OPTION ...] [KEY=VALUE ...]\n\nThe placement plan of the run those "
              "overrides (the ones of topp-rl train) describe: each trainer rank's node and GPU, each SGLang server's "
              "GPUs, launch settings and memory fraction, and which rank pushes the weights to it.", flush=True)
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from topp_rl.api import compose
    from topp_rl.config import placement_of, validate_config, weight_sync_of
    from topp_rl.parallel.placement import render

    try:
        cfg = compose(overrides)
        validate_config(cfg)
        placement = placement_of(cfg)
    except (ValueError, HydraException, OmegaConfBaseException) as err:  # a refused config or override: the reason
        print(f"topp-rl plan: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    if placement is None:
        print("[topp_rl] placement: none (no SGLang servers launched on GPUs: rollout=embedded, a CPU run "
              "(trainer=cpu), or rollout.engine.router_url / urls)", flush=True)
    else:
        print(render(placement, weight_sync=weight_sync_of(cfg)), flush=True)


def train_command(overrides: Sequence[str]) -> None:
    """Run the Hydra app on `overrides` (exactly what `python train.py <overrides>` does)."""
    os.environ.setdefault("WANDB_MODE", "offline")  # never reach the network unless a user opts in
    os.environ.setdefault("WANDB_QUIET", "true")  # no W&B history block at the end: the run prints its own summary
    request_huge_pages()  # before torch is imported: torch reads it once (topp_rl.run.host_memory)
    import hydra

    # Lightning starts a multi-device run's other ranks by re-running `sys.argv` (+ the run dir): that must be the
    # command as typed (`topp-rl train ...`), while Hydra parses the overrides alone from `sys.argv[1:]`.
    launched_as = list(sys.argv)

    def job(cfg) -> None:
        sys.argv = launched_as
        from topp_rl.train import train  # imported here so `--help` / `--cfg job` stay fast

        train(cfg)

    app = hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(job)
    sys.argv = [launched_as[0] if launched_as else "topp-rl", *overrides]  # hydra.main parses sys.argv[1:]
    try:
        app()
    finally:
        sys.argv = launched_as


if __name__ == "__main__":
    main()
