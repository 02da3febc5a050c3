"""Host memory reuse (`topp_rl.run.host_memory`) and the per-run process settings that apply it."""

import ctypes
import ctypes.util
import resource
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from topp_rl.run import host_memory
from topp_rl.train import process_settings

BLOCK = 16 << 20  # below the 32 MiB mmap threshold; 4096 pages of 4 KiB


def _touch_and_free(libc, size: int) -> int:
    """Minor page faults of malloc + memset + free of `size` bytes."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ptr = libc.malloc(size)
    assert ptr, f"malloc({size}) failed"
    ctypes.memset(ptr, 1, size)
    libc.free(ptr)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(host_memory._mallopt() is None, reason="the C library is not glibc: nothing to set")
def test_keep_freed_memory_reuses_a_freed_block_without_faulting_it_in_again():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    assert host_memory.keep_freed_memory() is True
    first = _touch_and_free(libc, BLOCK)
    again = [_touch_and_free(libc, BLOCK) for _ in range(3)]
    # glibc's defaults unmap (or trim) the freed block and fault all 4096 pages in again the next time
    assert max(again) < 256, (first, again)


def test_request_huge_pages_sets_the_default_and_keeps_a_users_choice(monkeypatch):
    monkeypatch.delenv(host_memory.HUGE_PAGES_ENV, raising=False)
    assert host_memory.request_huge_pages() is True
    assert host_memory.os.environ[host_memory.HUGE_PAGES_ENV] == "1"
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "0")
    assert host_memory.request_huge_pages() is False
    assert host_memory.os.environ[host_memory.HUGE_PAGES_ENV] == "0"


def test_process_settings_sets_threads_for_the_run_and_restores_them():
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    with process_settings(OmegaConf.create({"num_threads": want, "host_memory_reuse": False})):
        assert torch.get_num_threads() == want
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="inside"), process_settings(OmegaConf.create({"num_threads": want})):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before


@pytest.mark.subprocess
def test_the_command_line_sets_huge_pages_before_torch_is_imported():
    """torch reads THP_MEM_ALLOC_ENABLE once, at its first allocation: `topp_rl.cli` must not import torch before
    `train_command` sets it (a fresh interpreter; this one has torch already)."""
    code = ("import os, sys; os.environ.pop('THP_MEM_ALLOC_ENABLE', None); import topp_rl.cli; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stdout + done.stderr
