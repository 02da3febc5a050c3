"""scripts/gpu_vllm_check.py (gpu_check.sh's vLLM step) with --cpu: its checks on vLLM's CPU build (the sets from
log-probs, HF float32 agreement, a tied-head weight update), so the GPU script's own logic runs here."""

import subprocess
import sys

import pytest
from helpers import ROOT, train_env
from vllm_checks import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.subprocess]


def test_the_gpu_vllm_check_script_passes_on_a_cpu_server():
    require_vllm()
    done = subprocess.run([sys.executable, "scripts/gpu_vllm_check.py", "--cpu"], cwd=ROOT,
                          env=train_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "sets equal HF float32" in line]
    assert len(lines) == 6, done.stdout  # 3 settings, before and after the weight update
    assert "weight update" in done.stdout and done.stdout.rstrip().endswith("gpu_vllm_check: OK")
