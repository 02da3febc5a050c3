#!/usr/bin/env bash
# GPU checks of the Megatron backend, one short script (< 8 min on one H200, no network, nothing downloaded):
#   1. the `gpu`-marked tests (backbone on CUDA vs HF: pure-torch attention exact in fp32; transformer-engine in
#      bf16 when installed),
#   2. a few RL training steps through Megatron on the GPU (parallel=megatron, trainer=gpu, tiny model).
# Needs a Python with CUDA torch, megatron-core 0.16.x and this project's deps: PY=/path/to/python (default
# .venv/bin/python). TP/CP > 1 need several GPUs; with one GPU they stay covered by the CPU gloo tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=offline HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to $PY; nothing to check" >&2
  exit 2
fi
"$PY" - <<'PYEOF'
import importlib.util, torch, megatron.core
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"transformer-engine {'present' if importlib.util.find_spec('transformer_engine') else 'absent'}")
PYEOF

echo "== gpu-marked tests"
timeout 300 "$PY" -m pytest -m gpu tests/test_megatron_gpu.py -q -x -p no:cacheprovider

echo "== a few training steps through Megatron on the GPU"
out=$(mktemp -d)
timeout 240 "$PY" train.py parallel=megatron trainer=gpu_fp32 trainer.devices=1 trainer.max_steps=4 logger=csv \
  rollout.top_p=0.9 checkpoint.every_n_steps=0 paths.output_dir="$out"
"$PY" - "$out" <<'PYEOF'
import csv, glob, math, sys
rows = list(csv.DictReader(open(glob.glob(f"{sys.argv[1]}/csv/*/metrics.csv")[0])))
def col(key):
    return [float(r[key]) for r in rows if r.get(key)]
mean, worst, unmasked = (col(f"train/rollout_logprob_abs_diff{s}") for s in ("", "_max", "_unmasked"))
print(f"gpu_check: {len(mean)} steps, train/rollout_logprob_abs_diff max {max(mean):.3g}, "
      f"per-token max {max(worst):.3g}, unmasked {min(unmasked):.3g}")
# The CPU tests' bounds (float32, on-policy pass, mask on): mean |diff| <= 1e-5, every token <= 1e-4.
assert len(mean) == 4, f"expected 4 steps of metrics, got {len(mean)}"
assert max(mean) <= 1e-5, f"masked on-policy mismatch {max(mean):.3g} > 1e-5"
assert max(worst) <= 1e-4, f"per-token masked mismatch {max(worst):.3g} > 1e-4"
assert min(unmasked) > 1e-3, "unmasked mismatch should show the top-p bias (> 1e-3)"
PYEOF
echo "gpu_check: OK"
