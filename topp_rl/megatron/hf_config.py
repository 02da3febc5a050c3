"""Facts read off an HF Qwen2 / Llama config that the Megatron backbone and the weight conversion both need.

Kept apart from `backbone` and `convert` so that neither imports the other for them.
"""

from __future__ import annotations

import torch
from torch import Tensor

SUPPORTED_ARCHS = ("qwen2", "llama")


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def model_type(hf_config) -> str:
    kind = getattr(hf_config, "model_type", None)
    if kind not in SUPPORTED_ARCHS:
        raise ValueError(
            f"model_type={kind!r} is not supported by the Megatron backbone (supported: {SUPPORTED_ARCHS}); "
            "use the HF backbone for this model"
        )
    return kind


def hf_inv_freq(hf_config) -> Tensor:
    """RoPE inverse frequencies exactly as HF computes them (default or llama3 scaling)."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        base = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = head_dim(hf_config)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type != "llama3":
        raise ValueError(
            f"rope_type={rope_type!r} is not supported by the Megatron backbone (supported: 'default', "
            "'llama3'); use the HF backbone for this model"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    assert scaling == 1.0, "llama3 RoPE has no attention scaling"
    return inv_freq
