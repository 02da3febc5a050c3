#!/usr/bin/env bash
# The README's test command: set up both venvs (idempotent, quick when built) and run every test except `gpu`.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not sglang" -x`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
# The real SGLang server's own venv, cached outside the clone; engines and tests read its python from here.
TOPP_RL_SGLANG_PYTHON=$(bash scripts/setup_sglang.sh); export TOPP_RL_SGLANG_PYTHON  # (export X=$(...) would hide a failure)
export WANDB_MODE=offline HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ $# -eq 0 ]; then set -- -m "not gpu"; fi
exec .venv/bin/python -m pytest -q --timeout=900 "$@"
