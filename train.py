"""Hydra entry point: `python train.py algo=grpo rollout.top_p=0.9` (sweeps: `python train.py -m ...`).

All behaviour lives in `topp_rl.train.train(cfg)`, which tests call directly with a composed config.
"""

import os

os.environ.setdefault("WANDB_MODE", "offline")  # never reach the network unless a user opts in
os.environ.setdefault("WANDB_QUIET", "true")  # no W&B history block at the end: the run prints its own summary

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import topp_rl  # noqa: E402, F401  (registers the resolver of hydra.sweep.subdir; light: no torch, no Lightning)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from topp_rl.train import train  # imported here so `--help` / `--cfg job` stay fast

    train(cfg)


if __name__ == "__main__":
    main()
