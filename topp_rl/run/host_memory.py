"""Host (CPU) memory reuse between training steps.

PyTorch's CPU allocator has no cache: every tensor is a `malloc`, every free a `free`. glibc hands most freed
memory of a step back to the kernel (it trims the heap top, and unmaps blocks above its mmap threshold), so the
next step faults the same memory in again, 4 KiB at a time, zeroed: 1.35-1.52 million minor page faults in a
4-step SmolLM2-135M run on the CPU, with matmuls that write a fresh output running at half the rate of the same
matmul into reused memory. Two process-wide settings remove most of it (584-595 thousand faults, the step 16%
faster: docs/speed.md):

- `request_huge_pages()`: torch backs tensors of 2 MiB and more with transparent huge pages
  (`THP_MEM_ALLOC_ENABLE`, which torch reads once, at its first allocation: set before importing torch; the
  command line does, `topp_rl.cli`), one fault per 2 MiB;
- `keep_freed_memory()`: glibc keeps freed blocks of up to 32 MiB in the heap for reuse, and does not trim it
  (`mallopt`, any time; `host_memory_reuse` in the config, applied by `topp_rl.train`).

Neither changes a value: they decide only where a tensor's bytes live. Peak RSS stays the step's peak (the
memory is reused, not added); measured in docs/speed.md.
"""

import ctypes
import ctypes.util
import functools
import os
import platform

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"

# glibc's mallopt parameters (malloc.h) and the values set.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to 32 MiB come from the heap, and return to it on free
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim the heap top only past 2 GiB free
TOP_PAD = 128 << 20  # grow the heap 128 MiB at a time (pages are faulted only when touched)


def request_huge_pages() -> bool:
    """Ask torch's CPU allocator for transparent huge pages (allocations of 2 MiB and more), unless the
    environment already says otherwise; True when it is on. It takes effect only in a process that has not
    imported torch yet (torch reads it once)."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    return os.environ[HUGE_PAGES_ENV].upper() in ("1", "ON", "YES", "TRUE", "Y")


@functools.cache
def _mallopt():
    """glibc's `mallopt`, or None where the C library is not glibc (macOS, musl)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return fn


def keep_freed_memory() -> bool:
    """glibc: keep freed memory in the process for the next step's tensors (fixed 32 MiB mmap threshold, no
    heap trimming below 2 GiB, 128 MiB heap growth). True when set; False where the C library is not glibc, and
    nothing changes."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    for param, value in settings:
        if mallopt(param, value) != 1:
            raise OSError(f"glibc mallopt({param}, {value}) failed; set host_memory_reuse=false to leave malloc as is")
    return True
