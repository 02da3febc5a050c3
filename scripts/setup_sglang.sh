#!/usr/bin/env bash
# Build an SGLang 0.5.23 server venv (idempotent) and print its python path on stdout: the CPU venv by default,
# the GPU venv with --gpu (docs/sglang.md, "The SGLang venv" and "SGLang on GPUs").
#
# Each venv lives OUTSIDE the clone, in ${TOPP_RL_CACHE:-$HOME/.cache/topp_rl}/sglang-venv-<key> (CPU) or
# sglang-gpu-venv-<key> (GPU), where <key> hashes this script, that venv's pins (and the CPU stand-ins) and our
# patch: a rebuilt clone reuses it, a changed pin builds a new one. SGLang's own pins (torch 2.14 CUDA,
# sglang-kernel, flashinfer) conflict with the project venv, hence venvs of their own.
#
# CPU, order matters: torch==2.13.0 (the CPU build) first, then sglang --no-deps, then only the runtime deps its
# imports need (scripts/sglang-requirements.txt, constrained by scripts/sglang-constraints.txt), then the router
# (smg, `python -m smg launch`), the two CPU stand-ins (scripts/sglang_standins/) and our patch (patches/sglang/).
# GPU: sglang and smg with all their declared dependencies from PyPI in one resolve (CUDA torch 2.14.1,
# sglang-kernel, flashinfer), held to the set in scripts/sglang-gpu-constraints.txt, then our patch; no stand-ins.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
sglang_version=0.5.23

usage() {
  cat <<EOF
usage: scripts/setup_sglang.sh [--gpu] [--print-path]
Build the SGLang $sglang_version server venv if needed (minutes, once) and print its python path on stdout.
  (no option)   the CPU venv: CPU torch 2.13.0 and two CPU stand-ins (tests and CPU runs)
  --gpu         the GPU venv: sglang with its own CUDA dependencies from PyPI (scripts/sglang-gpu-constraints.txt)
  --print-path  print the path if that venv is built, exit 1 otherwise (never builds)
  -h, --help    print this help
Venvs are cached in \${TOPP_RL_CACHE:-~/.cache/topp_rl}; \$TOPP_RL_SGLANG_BASE_PYTHON (default python3) creates them.
EOF
}

variant=cpu
print_only=false
for arg in "$@"; do
  case "$arg" in
    --gpu) variant=gpu ;;
    --print-path) print_only=true ;;
    -h | --help) usage; exit 0 ;;
    *) echo "setup_sglang.sh: unknown option '$arg'; see --help" >&2; usage >&2; exit 2 ;;
  esac
done

# Files of a folder that go into the key (not Python's byte-code caches).
source_files() { LC_ALL=C find "$@" -type f ! -name '*.pyc' ! -path '*__pycache__*' | LC_ALL=C sort; }
# Our patches to SGLang, in the order they apply (their README is not part of the key).
patch_files() { LC_ALL=C ls patches/sglang/*.patch | LC_ALL=C sort; }

case "$variant" in
  cpu)
    name=sglang-venv
    label=CPU
    build_cmd=scripts/setup_sglang.sh
    pins=(scripts/sglang-requirements.txt scripts/sglang-constraints.txt $(source_files scripts/sglang_standins)) ;;
  gpu)
    name=sglang-gpu-venv
    label=GPU
    build_cmd="scripts/setup_sglang.sh --gpu"
    pins=(scripts/sglang-gpu-constraints.txt) ;;
esac
key=$({ echo "$variant"; cat scripts/setup_sglang.sh "${pins[@]}" $(patch_files); } | sha256sum | cut -c1-12)
cache=${TOPP_RL_CACHE:-$HOME/.cache/topp_rl}
venv=$cache/$name-$key
python=$venv/bin/python
stamp=$venv/.topp_rl-sglang-ready
pip=("$python" -m pip install -q --disable-pip-version-check)

print_if_built() {
  if [ -f "$stamp" ]; then echo "$python"; exit 0; fi
}

site_packages() { "$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# A patch whose reverse already applies is skipped, so a rerun after a failure is safe.
apply_patches() {
  local site p
  site=$(site_packages)
  for p in $(patch_files); do
    if patch -d "$site" -p1 -R --dry-run -s -f < "$p" > /dev/null 2>&1; then
      echo "[setup_sglang] $p already applied" >&2
    else
      patch -d "$site" -p1 --forward -s < "$p" >&2
    fi
  done
}

install_cpu() {
  local cons=(-c scripts/sglang-constraints.txt)
  "${pip[@]}" "${cons[@]}" torch==2.13.0 >&2
  "${pip[@]}" --no-deps "sglang==$sglang_version" >&2
  # pip then lists "sglang 0.5.23 requires X, which is not installed / but you have Y": expected, since sglang's
  # metadata pins the CUDA stack (torch 2.14.1, sglang-kernel, flashinfer, ...) that we replace on purpose.
  "${pip[@]}" "${cons[@]}" -r scripts/sglang-requirements.txt >&2
  # The SGLang model gateway (router). --no-deps: `smg launch` imports only setproctitle and PyYAML (both above);
  # its declared grpcio deps serve `smg serve` / gRPC workers, which we do not use.
  "${pip[@]}" --no-deps "smg==$(sed -n 's/^smg==//p' scripts/sglang-constraints.txt)" >&2

  local site
  site=$(site_packages)
  rm -rf "$site/sgl_kernel" "$site/torchvision_cpu_fix"
  cp -r scripts/sglang_standins/sgl_kernel scripts/sglang_standins/torchvision_cpu_fix "$site/"
  # A .pth line runs in every interpreter of the venv, including SGLang's spawned scheduler processes.
  echo "import torchvision_cpu_fix" > "$site/torchvision_cpu_fix.pth"
}

install_gpu() {
  # One resolve, sglang's own metadata choosing the CUDA stack; the constraints hold every package to the pinned set.
  "${pip[@]}" -c scripts/sglang-gpu-constraints.txt "sglang==$sglang_version" smg >&2
}

# Import check of the server entry point (fails here, not in the first test, when a dependency is missing).
check_cpu() {
  SGLANG_USE_CPU_ENGINE=1 "$python" -c \
    "import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, torchvision, smg.launch_router" >&2
}

# The same modules, with no GPU needed: the build may run on a machine without one (a cluster's login node). These
# imports need no NVIDIA driver; `import sgl_kernel` does (it loads libcuda.so.1), so it is only found, not run.
check_gpu() {
  "$python" -c "import importlib.util, torch
assert torch.version.cuda, f'torch {torch.__version__} is not a CUDA build'
assert importlib.util.find_spec('sgl_kernel'), 'sgl_kernel (sglang-kernel) is not installed'
import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, smg.launch_router" >&2
}

print_if_built
if $print_only; then
  echo "SGLang $label venv not built ($venv); run $build_cmd" >&2
  exit 1
fi
mkdir -p "$cache"
exec 9>"$cache/$name.lock"
flock 9  # two builds at once (parallel CI jobs) would corrupt the venv
print_if_built
echo "[setup_sglang] building $venv ..." >&2
[ -x "$python" ] || "${TOPP_RL_SGLANG_BASE_PYTHON:-python3}" -m venv "$venv"
"install_$variant"
apply_patches
"check_$variant"
echo "$key" > "$stamp"
echo "[setup_sglang] done" >&2
echo "$python"
