"""Shared pytest setup: offline W&B, no network, `gpu` tests skipped without CUDA, and the session's shared
SGLang server for tiny training runs. Plain helpers (the tiny config, metrics.csv) are in helpers.py."""

import os
import platform

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cpu_model() -> str:
    """The CPU's model name and the kernels torch picks for it: 16-bit rounding differs between CPU kinds (an Intel
    Xeon with AMX and an AMD EPYC give other bf16 figures), so the figures a run prints name the CPU they came from."""
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, torch kernels {torch.backends.cpu.get_cpu_capability()}"


def pytest_terminal_summary(terminalreporter) -> None:  # also under -q, which hides the report header
    terminalreporter.write_line(f"cpu: {cpu_model()}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; this machine has no GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def tiny_sglang_url(tmp_path_factory) -> str:
    """The URL of one SGLang server per test module for `model=tiny` runs that need no fresh server. Per module,
    not per session: an idle SGLang CPU scheduler keeps a core busy (measured: 82%), and a server kept for the
    session would slow every later test and make three servers at once beside the multinode test. Runs connect with
    `rollout.engine.urls=[url]` instead of launching their own (~20 s each on CPU). It is launched the way a
    `rollout=sglang` run launches one (same factory and server settings, on the tiny policy's initial weights).
    What an earlier run left on it does not matter: a run pushes its policy's weights at train start (WeightSync,
    with an explicit weight version) and every push flushes the server's prefix cache."""
    from helpers import launched_server_url
    from sglang_checks import require_sglang

    require_sglang()
    with launched_server_url(tmp_path_factory.mktemp("tiny-sglang"), "rollout=sglang") as url:
        yield url
