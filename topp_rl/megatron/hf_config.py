"""Facts read off an HF config that the Megatron backbone and the weight conversion both need.

Kept apart from `backbone` and `convert` so that neither imports the other for them. Families: Qwen2 (QKV bias),
Llama (optional llama3 RoPE), Qwen3 (QK-norm, explicit head_dim), Qwen3-MoE (Qwen3 attention, sparse MoE
blocks) and Mistral (Llama-shaped, optional sliding window).

Sliding windows: a window used by every layer (Mistral's `sliding_window`; Qwen2/3 with `use_sliding_window`
and `max_window_layers=0`) is honoured exactly by the pure-torch attention (`cpu_shims.TorchCoreAttention`,
float32 on CPU or GPU); a window on only some layers (Qwen's `layer_types` mixing full and sliding layers) is
rejected at start, and so is any window on the transformer-engine path (see `backbone.transformer_config`).
"""

from __future__ import annotations

import torch
from torch import Tensor

SUPPORTED_ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe", "mistral")
QK_NORM_ARCHS = ("qwen3", "qwen3_moe")


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


def qk_norm(hf_config) -> bool:
    """RMSNorm over each head's query and key before RoPE (Qwen3's q_norm / k_norm)."""
    return model_type(hf_config) in QK_NORM_ARCHS


def qkv_bias(hf_config) -> bool:
    return model_type(hf_config) == "qwen2" or bool(getattr(hf_config, "attention_bias", False))


def attention_window(hf_config) -> int | None:
    """The sliding window every layer uses (a query sees keys at positions > q - window), or None."""
    kinds = getattr(hf_config, "layer_types", None)
    window = getattr(hf_config, "sliding_window", None)
    if kinds is not None:
        sliding = [k == "sliding_attention" for k in kinds]
        if any(sliding) and not all(sliding):
            raise ValueError(
                f"layer_types={list(kinds)} mixes full and sliding-window attention layers; the Megatron backbone "
                "runs one attention window for every layer: set max_window_layers=0 (all layers sliding) or "
                "use_sliding_window=false, or use the HF backbone"
            )
        if not any(sliding):
            return None
    if window is None:
        return None
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r} must be a positive int or null (no window)")
    return window


def moe_layers(hf_config) -> list[bool]:
    """Per decoder layer: a sparse MoE block (True) or a dense MLP (False), by HF Qwen3-MoE's own rule."""
    n = hf_config.num_hidden_layers
    experts = getattr(hf_config, "num_experts", 0) or 0
    if model_type(hf_config) != "qwen3_moe" or experts == 0:
        return [False] * n
    step = hf_config.decoder_sparse_step
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]


def is_moe(hf_config) -> bool:
    return any(moe_layers(hf_config))


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
