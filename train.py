"""Hydra entry point: `python train.py algo=grpo rollout.top_p=0.9` (sweeps: `python train.py -m ...`).

The same app as the installed `topp-rl train` (`topp_rl.cli.train_command`); all behaviour lives in
`topp_rl.train.train(cfg)`, which tests call directly with a composed config, and `topp_rl.fit` from Python.
"""

import sys

from topp_rl.cli import train_command

if __name__ == "__main__":
    train_command(sys.argv[1:])
