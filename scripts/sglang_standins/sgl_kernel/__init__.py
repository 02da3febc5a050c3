"""Stand-in for `sgl_kernel` (SGLang's compiled kernel package) on a CPU-only machine, in plain torch.

CUDA assumption replaced: "sgl_kernel is always installed, with compiled kernels for this device". PyPI ships
it only as CUDA builds, yet SGLang imports it whenever `SGLANG_USE_CPU_ENGINE=1`. On the torch-native CPU path
(`--attention-backend torch_native`) it calls two ops from it, both KV-cache bookkeeping rather than model math;
they are implemented here. Every other name imports as a function that raises NotImplementedError when called,
and with `torch.ops.sgl_kernel.*` absent SGLang takes its torch-native fallbacks (no AMX GEMMs).
"""

import ctypes

import torch

__version__ = "0.0.0+topp_rl.standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i, in order, write the next `end_offset[i] - start_offset[i]` entries of
    `out_cache_loc` into `req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]` (in place)."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"token slice [{start}, {end}) is outside the pool row of length {pool_len}")
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every KV buffer b (base address `data_ptrs[b]`, slot size `strides[b]` bytes) and every j, copy slot
    `src_loc[j]` to slot `tgt_loc[j]`. SGLang hands raw addresses (its GPU kernel takes them), hence memmove."""
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for tgt, src in zip(tgt_loc.tolist(), src_loc.tolist(), strict=True):
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def __getattr__(name: str):
    # SGLang imports more ops by name at module load (speculative decoding, AMX GEMMs) than the torch-native
    # path ever calls. Importing succeeds; calling one fails loudly instead of computing something else.
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by the topp_rl CPU stand-in (scripts/sglang_standins/sgl_kernel); "
            "this SGLang code path needs the real compiled kernel"
        )

    _missing.__name__ = name
    return _missing
