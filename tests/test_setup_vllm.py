"""scripts/setup_vllm.sh without building anything: its options, the CPU and GPU venvs' separate cache keys, and the
built case (a stamp file) answered at once. Every run gets an empty TOPP_RL_CACHE of its own; the base python that
would create a venv is `false`, so a build that should not start fails at once instead of reaching a package index."""

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup_vllm(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOPP_RL_CACHE": str(cache), "TOPP_RL_VLLM_BASE_PYTHON": shutil.which("false")}
    return subprocess.run(["bash", str(ROOT / "scripts/setup_vllm.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def unbuilt_venv(*args: str, cache: Path) -> Path:
    run = setup_vllm(*args, "--print-path", cache=cache)
    assert run.returncode == 1 and run.stdout == "", run.stderr
    named = re.search(r"not built \((.+?)\); run (scripts/setup_vllm.sh[^\n]*)", run.stderr)
    assert named, run.stderr
    assert named.group(2) == " ".join(["scripts/setup_vllm.sh", *args])
    return Path(named.group(1))


def test_help_and_unknown_options(tmp_path):
    run = setup_vllm("--help", cache=tmp_path)
    assert run.returncode == 0 and run.stdout.startswith("usage: scripts/setup_vllm.sh [--gpu] [--print-path]")
    run = setup_vllm("--cuda", cache=tmp_path)
    assert run.returncode == 2 and "unknown option '--cuda'" in run.stderr and run.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_cpu_and_gpu_venvs_have_their_own_keys_and_a_built_one_is_printed_at_once(tmp_path):
    cpu, gpu = unbuilt_venv(cache=tmp_path), unbuilt_venv("--gpu", cache=tmp_path)
    assert cpu.parent == gpu.parent == tmp_path and cpu.name.startswith("vllm-venv-")
    assert gpu.name.startswith("vllm-gpu-venv-") and cpu.name.split("-")[-1] != gpu.name.split("-")[-1]
    assert list(tmp_path.iterdir()) == []  # --print-path never builds
    cpu.mkdir()
    (cpu / ".topp_rl-vllm-ready").write_text("x")
    for args in ((), ("--print-path",)):  # built: printed without building (the base python is `false`)
        run = setup_vllm(*args, cache=tmp_path)
        assert run.returncode == 0 and run.stdout == f"{cpu}/bin/python\n", run.stderr
