"""Megatron-core backend: a TP/CP GPTModel backbone for Qwen2 / Llama, HF <-> Megatron weights, a Lightning
strategy and weight export to the rollout engines. Needs the `megatron` extra (megatron-core 0.16.x); on CPU
the shims in `cpu_shims` stand in for the CUDA-only pieces. megatron-core itself is imported lazily.
"""

from topp_rl.megatron.backbone import MegatronBackbone, build_gpt_model, transformer_config
from topp_rl.megatron.convert import hf_to_megatron, load_hf_into, megatron_to_hf

__all__ = [
    "MegatronBackbone",
    "build_gpt_model",
    "hf_to_megatron",
    "load_hf_into",
    "megatron_to_hf",
    "transformer_config",
]
