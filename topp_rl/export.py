"""`python -m topp_rl.export CKPT OUT_DIR`: the HF export of a checkpoint, as a command; the export itself is
`topp_rl.run.export`."""

from topp_rl.run.export import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
