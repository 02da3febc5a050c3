#!/usr/bin/env bash
# Build the TRL 1.16 venv used by benchmarks/bench_vs_trl.py (idempotent) and print its python path on stdout.
#
# The venv lives OUTSIDE the clone, in ${TOPP_RL_CACHE:-$HOME/.cache/topp_rl}/trl-venv-<key>, where <key> hashes
# this script and scripts/trl-requirements.txt: a rebuilt clone reuses it, a changed pin builds a new one. TRL
# gets a venv of its own so that its dependencies never enter the project venv; torch (CPU build) goes in first
# and stays at the project's version, then TRL and the pinned stack (scripts/trl-requirements.txt).
#
#   scripts/setup_trl.sh               build if needed (about a minute with a warm pip cache), print the path
#   scripts/setup_trl.sh --print-path  print the path if built, exit 1 otherwise (never builds)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
key=$(cat scripts/setup_trl.sh scripts/trl-requirements.txt | sha256sum | cut -c1-12)
cache=${TOPP_RL_CACHE:-$HOME/.cache/topp_rl}
venv=$cache/trl-venv-$key
stamp=$venv/.topp_rl-trl-ready
if [ -f "$stamp" ]; then
  echo "$venv/bin/python"
  exit 0
fi
if [ "${1:-}" = "--print-path" ]; then
  echo "TRL venv not built; run scripts/setup_trl.sh" >&2
  exit 1
fi

mkdir -p "$cache"
exec 9>"$cache/trl-venv.lock"
flock 9  # two builds at once would corrupt the venv
if [ -f "$stamp" ]; then echo "$venv/bin/python"; exit 0; fi
echo "[setup_trl] building $venv ..." >&2
base_python=${TOPP_RL_TRL_BASE_PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$base_python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0 >&2
"${pip[@]}" -c <(echo torch==2.13.0) -r scripts/trl-requirements.txt >&2
# Import check of what the benchmark uses (fails here, not in the middle of a benchmark).
"$venv/bin/python" -c "import torch, trl; from trl import GRPOConfig, GRPOTrainer; print('trl', trl.__version__, 'torch', torch.__version__)" >&2
echo "$key" > "$stamp"
echo "[setup_trl] done" >&2
echo "$venv/bin/python"
