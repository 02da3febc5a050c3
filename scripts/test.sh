#!/usr/bin/env bash
# The README's test command: set up the venvs (idempotent, quick when built) and run every test except `gpu`.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m "not sglang" -x`).
# `--fast` first: the inner loop, every test that needs no SGLang or vLLM server, no subprocess, no GPU and is not slow
# (markers in pyproject.toml); further arguments still go to pytest. CI runs it without arguments (everything).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
# The real SGLang server's own venv, cached outside the clone; engines and tests read its python from here.
TOPP_RL_SGLANG_PYTHON=$(bash scripts/setup_sglang.sh); export TOPP_RL_SGLANG_PYTHON  # (export X=$(...) would hide a failure)
# The real vLLM server's own venv (CPU build), likewise.
TOPP_RL_VLLM_PYTHON=$(bash scripts/setup_vllm.sh); export TOPP_RL_VLLM_PYTHON
export WANDB_MODE=offline HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ $# -eq 0 ]; then set -- -m "not gpu"
elif [ "$1" = --fast ]; then shift; set -- -m "not gpu and not sglang and not vllm and not slow and not distributed and not subprocess" "$@"
fi
exec .venv/bin/python -m pytest -q --timeout=900 "$@"
