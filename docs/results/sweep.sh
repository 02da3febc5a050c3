#!/usr/bin/env bash
# The learning sweep of docs/results.md (section 2). Two Hydra multiruns side by side, one per sampling
# setting, each 3 seeds x 3 scoring variants run one after another (at most two jobs at a time on 2 cores).
#   bash docs/results/sweep.sh [OUT_DIR] [extra overrides...]     (default OUT_DIR: multirun/study)
# Then: python -m topp_rl.report OUT_DIR/top_p0.9 --group-seeds (and OUT_DIR/top_k20).
# Committed run (docs/results.md): 18 jobs in 22.4 min of wall time on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-multirun/study}; shift || true
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
sweep() {  # $1: name, then the setting's overrides
  local name=$1; shift
  # seed first: Hydra varies the last list fastest, so every variant of seed 0 runs before seed 1.
  WANDB_MODE=offline nohup "$py" train.py -m seed=0,1,2 \
    experiment=study_arith_masked,study_arith_tis,study_arith_full "$@" \
    hydra.sweep.dir="$out/$name" > "$out/$name.log" 2>&1 &
  echo $!
}
sweep top_p0.9 rollout.top_p=0.9 rollout.top_k=0 "$@" > "$out/pids"
sweep top_k20 rollout.top_p=1.0 rollout.top_k=20 "$@" >> "$out/pids"
echo "sweep started (pids $(tr '\n' ' ' < "$out/pids")); logs: $out/*.log"
