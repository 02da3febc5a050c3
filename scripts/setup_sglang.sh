#!/usr/bin/env bash
# Build the SGLang 0.5.23 server venv for CPU (idempotent) and print its python path on stdout.
#
# The venv lives OUTSIDE the clone, in ${TOPP_RL_CACHE:-$HOME/.cache/topp_rl}/sglang-venv-<key>, where <key>
# hashes this script, the pins, the stand-ins and our patch: a rebuilt clone reuses it, a changed pin builds a
# new one. SGLang's own pins (torch 2.14 CUDA, sgl-kernel, flashinfer) conflict with the project venv, hence a
# venv of its own. Order matters: torch==2.13.0 (the CPU build) first, then sglang --no-deps, then only the
# runtime deps its imports need (scripts/sglang-requirements.txt, constrained by scripts/sglang-constraints.txt),
# then the router (smg, `python -m smg launch`), the two CPU stand-ins (scripts/sglang_standins/) and our patch
# (patches/sglang/).
#
#   scripts/setup_sglang.sh               build if needed (a few minutes from nothing), print the python path
#   scripts/setup_sglang.sh --print-path  print the path if built, exit 1 otherwise (never builds)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
inputs=(scripts/setup_sglang.sh scripts/sglang-requirements.txt scripts/sglang-constraints.txt
  $(LC_ALL=C find scripts/sglang_standins patches/sglang -type f ! -name '*.pyc' ! -path '*__pycache__*' | LC_ALL=C sort))
key=$(cat "${inputs[@]}" | sha256sum | cut -c1-12)
cache=${TOPP_RL_CACHE:-$HOME/.cache/topp_rl}
venv=$cache/sglang-venv-$key
stamp=$venv/.topp_rl-sglang-ready
if [ -f "$stamp" ]; then
  echo "$venv/bin/python"
  exit 0
fi
if [ "${1:-}" = "--print-path" ]; then
  echo "SGLang venv not built; run scripts/setup_sglang.sh" >&2
  exit 1
fi

mkdir -p "$cache"
exec 9>"$cache/sglang-venv.lock"
flock 9  # two builds at once (parallel CI jobs) would corrupt the venv
if [ -f "$stamp" ]; then echo "$venv/bin/python"; exit 0; fi
echo "[setup_sglang] building $venv ..." >&2
base_python=${TOPP_RL_SGLANG_BASE_PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$base_python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
cons=(-c scripts/sglang-constraints.txt)
"${pip[@]}" "${cons[@]}" torch==2.13.0 >&2
"${pip[@]}" --no-deps sglang==0.5.23 >&2
# pip then lists "sglang 0.5.23 requires X, which is not installed / but you have Y": expected, since sglang's
# metadata pins the CUDA stack (torch 2.14.1, sglang-kernel, flashinfer, ...) that we replace on purpose.
"${pip[@]}" "${cons[@]}" -r scripts/sglang-requirements.txt >&2
# The SGLang model gateway (router). --no-deps: `smg launch` imports only setproctitle and PyYAML (both above);
# its declared grpcio deps serve `smg serve` / gRPC workers, which we do not use.
"${pip[@]}" --no-deps "smg==$(sed -n 's/^smg==//p' scripts/sglang-constraints.txt)" >&2

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/sgl_kernel" "$site/torchvision_cpu_fix"
cp -r scripts/sglang_standins/sgl_kernel scripts/sglang_standins/torchvision_cpu_fix "$site/"
# A .pth line runs in every interpreter of the venv, including SGLang's spawned scheduler processes.
echo "import torchvision_cpu_fix" > "$site/torchvision_cpu_fix.pth"

for p in $(LC_ALL=C ls patches/sglang/*.patch | LC_ALL=C sort); do
  if patch -d "$site" -p1 -R --dry-run -s -f < "$p" > /dev/null 2>&1; then
    echo "[setup_sglang] $p already applied" >&2
  else
    patch -d "$site" -p1 --forward -s < "$p" >&2
  fi
done
# Import check of the server entry point (fails here, not in the first test, when a dependency is missing).
SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -c \
  "import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, torchvision, smg.launch_router" >&2
echo "$key" > "$stamp"
echo "[setup_sglang] done" >&2
echo "$venv/bin/python"
