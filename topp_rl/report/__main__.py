"""`python -m topp_rl.report RUN_DIR [RUN_DIR ...] [--out DIR]` (see `topp_rl.report.plots`)."""

from topp_rl.report.plots import main

main()
