"""`python -m topp_rl.report RUN_DIR [RUN_DIR ...]`: PNG plots of a run, a sweep or several runs overlaid (`plots`;
curve labels of several runs: `labels`), the shared curve drawing (`curves`) and `--group-seeds` (`seeds`). The
names below are the ones the docs import from `topp_rl.report`."""

from topp_rl.report.plots import COUNTS_FILE, load_history, load_jobs, main, render
from topp_rl.report.seeds import group_seeds, seed_band, variant_of

__all__ = ["COUNTS_FILE", "group_seeds", "load_history", "load_jobs", "main", "render", "seed_band", "variant_of"]
