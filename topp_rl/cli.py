"""`topp-rl`, the installed command (pyproject's console script):

- `topp-rl train [GROUP=OPTION ...] [KEY=VALUE ...]`: the Hydra app of `python train.py`, same overrides and
  flags (`-m` sweeps, `--cfg job`, `--help`), over the config tree `topp_rl.paths.config_dir()` finds (the package's
  own copy when installed, `conf/` in a clone), so it runs from any directory;
- `topp-rl resume RUN_DIR [KEY=VALUE ...]`: `topp-rl train hydra.run.dir=RUN_DIR ckpt_path=last`, with the overrides
  the run recorded beneath those given (`topp_rl.run.resume_args`);
- `topp-rl plan [GROUP=OPTION ...] [KEY=VALUE ...]`: the placement of trainer ranks and SGLang servers those
  overrides give, printed without building a model or touching a GPU (exit 0), or the reason it is refused (exit 2);
- `topp-rl export CKPT OUT_DIR` = `python -m topp_rl.export`; `topp-rl report RUN_DIR [RUN_DIR ...]` =
  `python -m topp_rl.report`.
"""

import os
import sys
from collections.abc import Sequence

from topp_rl.config_reference import register_help_resolver
from topp_rl.paths import config_dir
from topp_rl.run.console_log import console_to_log
from topp_rl.run.errors import exit_cleanly_on_refusal
from topp_rl.run.host_memory import request_huge_pages
from topp_rl.run.resume_args import with_recorded_overrides

USAGE = """usage: topp-rl COMMAND [ARGS ...]

commands:
  train   train a policy: topp-rl train [GROUP=OPTION ...] [KEY=VALUE ...] (the overrides of python train.py)
  resume  continue a run from its dir alone: topp-rl resume RUN_DIR [KEY=VALUE ...] (its recorded overrides, these on top)
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
    elif command == "resume":
        resume_command(rest)
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
        print(f"{USAGE}\ntopp-rl: error: {problem}; use train, resume, plan, export or report", file=sys.stderr)
        sys.exit(2)


def resume_command(args: Sequence[str]) -> None:
    """`topp-rl resume RUN_DIR [KEY=VALUE ...]` = `topp-rl train hydra.run.dir=RUN_DIR ckpt_path=last [KEY=VALUE
    ...]`: the run's recorded overrides, these on top (`topp_rl.run.resume_args`)."""
    usage = ("usage: topp-rl resume RUN_DIR [KEY=VALUE ...]\n\nContinue the run in RUN_DIR from its last checkpoint "
             "with the overrides it was started with; KEY=VALUE given here go on top (e.g. trainer.max_steps=200).")
    if args and args[0] in ("-h", "--help"):
        print(usage, flush=True)
        return
    if not args or "=" in args[0]:
        print(f"{usage}\ntopp-rl resume: error: the first argument must be the run's dir", file=sys.stderr, flush=True)
        sys.exit(2)
    train_command([f"hydra.run.dir={args[0]}", "ckpt_path=last", *args[1:]])


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

    register_help_resolver()  # --help prints each key's comment in conf/ (`${topp_rl.key_help:KEY}`)
    # Lightning starts a multi-device run's other ranks by re-running `sys.argv` (+ the run dir): that must be the
    # command as typed (`topp-rl train ...`), while Hydra parses the overrides alone from `sys.argv[1:]`.
    launched_as = list(sys.argv)

    def job(cfg) -> None:
        sys.argv = launched_as
        from topp_rl.train import train  # imported here so `--help` / `--cfg job` stay fast

        with console_to_log():  # the run's own lines in train.log too
            try:
                train(cfg)
            except Exception as err:  # noqa: BLE001 - a refusal exits 2 with its message; anything else is re-raised
                exit_cleanly_on_refusal(err)
                raise

    app = hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(job)
    try:
        overrides = with_recorded_overrides(overrides)  # a resume from its run dir alone
    except ValueError as err:
        exit_cleanly_on_refusal(err)
        raise
    sys.argv = [launched_as[0] if launched_as else "topp-rl", *overrides]  # hydra.main parses sys.argv[1:]
    try:
        app()
    finally:
        sys.argv = launched_as


if __name__ == "__main__":
    main()
