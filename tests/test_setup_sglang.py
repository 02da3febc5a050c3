"""scripts/setup_sglang.sh without building anything: its options, the CPU and GPU venvs' separate cache keys, and
the built case (a stamp file) answered at once. Every run gets an empty TOPP_RL_CACHE of its own, so nothing real
is read or touched; the base python that would create a venv is `false`, so a build that should not start fails at
once instead of reaching a package index."""

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "scripts/setup_sglang.sh"
# What the script reads to compute its keys (itself, the pins, the stand-ins, the patches).
KEY_INPUTS = [SCRIPT, "scripts/sglang-requirements.txt", "scripts/sglang-constraints.txt",
              "scripts/sglang-gpu-constraints.txt", "scripts/sglang_standins", "patches/sglang"]


def setup_sglang(*args: str, cache: Path, root: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOPP_RL_CACHE": str(cache), "TOPP_RL_SGLANG_BASE_PYTHON": shutil.which("false")}
    return subprocess.run(["bash", str(root / SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def unbuilt_venv(*args: str, cache: Path, root: Path = ROOT) -> Path:
    """The venv `--print-path` names when it is not built (and checks that nothing was built)."""
    run = setup_sglang(*args, "--print-path", cache=cache, root=root)
    assert run.returncode == 1, run.stderr
    assert run.stdout == ""
    named = re.search(r"not built \((.+?)\)", run.stderr)
    assert named, run.stderr
    return Path(named.group(1))


def test_help_prints_the_usage(tmp_path):
    run = setup_sglang("--help", cache=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: scripts/setup_sglang.sh [--gpu] [--print-path]")
    assert "--gpu" in run.stdout and "--print-path" in run.stdout
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_option_is_refused_by_name(tmp_path):
    run = setup_sglang("--gpu", "--cuda", cache=tmp_path)
    assert run.returncode == 2
    assert "unknown option '--cuda'" in run.stderr
    assert "usage:" in run.stderr and run.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_print_path_never_builds_and_names_the_build_command(tmp_path):
    gpu = setup_sglang("--gpu", "--print-path", cache=tmp_path)
    assert gpu.returncode == 1
    assert "SGLang GPU venv not built" in gpu.stderr and gpu.stderr.rstrip().endswith("run scripts/setup_sglang.sh --gpu")
    cpu = setup_sglang("--print-path", cache=tmp_path)
    assert cpu.returncode == 1
    assert "SGLang CPU venv not built" in cpu.stderr and cpu.stderr.rstrip().endswith("run scripts/setup_sglang.sh")
    assert list(tmp_path.iterdir()) == []  # no venv, no lock file


def test_cpu_and_gpu_venvs_have_their_own_keys(tmp_path):
    cpu, gpu = unbuilt_venv(cache=tmp_path), unbuilt_venv("--gpu", cache=tmp_path)
    assert cpu.parent == gpu.parent == tmp_path
    assert re.fullmatch(r"sglang-venv-[0-9a-f]{12}", cpu.name), cpu.name
    assert re.fullmatch(r"sglang-gpu-venv-[0-9a-f]{12}", gpu.name), gpu.name
    assert cpu.name.rsplit("-", 1)[1] != gpu.name.rsplit("-", 1)[1]
    assert unbuilt_venv("--print-path", "--gpu", cache=tmp_path) == gpu  # option order does not matter


def test_a_built_venv_is_printed_without_building(tmp_path):
    """The stamp file marks a finished build: both `--gpu` and `--gpu --print-path` print that venv's python at
    once (no pip runs: the venv has no python at all), and the CPU venv is still unbuilt."""
    gpu = unbuilt_venv("--gpu", cache=tmp_path)
    gpu.mkdir()
    (gpu / ".topp_rl-sglang-ready").write_text("stamp\n")
    for args in (["--gpu"], ["--gpu", "--print-path"]):
        run = setup_sglang(*args, cache=tmp_path)
        assert run.returncode == 0, run.stderr
        assert run.stdout == f"{gpu}/bin/python\n"
    unbuilt_venv(cache=tmp_path)


def test_each_key_hashes_only_its_own_pins(tmp_path):
    """Re-pinning the GPU set builds a new GPU venv and keeps the CPU one (and the reverse); a changed patch builds
    both, a changed patch README neither. On a copy of the files."""
    clone = tmp_path / "clone"
    for rel in KEY_INPUTS:
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (ROOT / rel).is_dir() else shutil.copy)(ROOT / rel, clone / rel)
    cache = tmp_path / "cache"

    def keys() -> tuple[str, str]:
        return unbuilt_venv(cache=cache, root=clone).name, unbuilt_venv("--gpu", cache=cache, root=clone).name

    cpu, gpu = keys()
    assert (cpu, gpu) == (unbuilt_venv(cache=cache).name, unbuilt_venv("--gpu", cache=cache).name)
    with open(clone / "scripts/sglang-gpu-constraints.txt", "a") as pins:
        pins.write("extra-package==1.0\n")
    cpu2, gpu2 = keys()
    assert cpu2 == cpu and gpu2 != gpu
    with open(clone / "scripts/sglang-constraints.txt", "a") as pins:
        pins.write("extra-package==1.0\n")
    cpu3, gpu3 = keys()
    assert cpu3 != cpu and gpu3 == gpu2
    with open(clone / "patches/sglang/0001-sampling-mask-b64.patch", "a") as patch:
        patch.write("\n")
    cpu4, gpu4 = keys()
    assert cpu4 != cpu3 and gpu4 != gpu3  # the patch goes into both venvs
    with open(clone / "patches/sglang/README.md", "a") as readme:
        readme.write("A new paragraph.\n")
    assert keys() == (cpu4, gpu4)  # its documentation does not


def pins(path: str) -> dict[str, str]:
    lines = (ROOT / path).read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_gpu_pins_agree_with_the_script_the_cpu_router_and_the_trainer():
    """The GPU set pins the SGLang the script installs, the router (smg) of the CPU set, and the torch of the
    project's GPU venv (constraints-gpu.txt): NCCL weight sync runs between the two torch builds."""
    gpu, cpu = pins("scripts/sglang-gpu-constraints.txt"), pins("scripts/sglang-constraints.txt")
    version = re.search(r"^sglang_version=(\S+)$", (ROOT / SCRIPT).read_text(), re.M).group(1)
    assert gpu["sglang"] == version == "0.5.23"
    assert gpu["smg"] == cpu["smg"]
    assert gpu["torch"] == pins("constraints-gpu.txt")["torch"] == "2.14.1"
