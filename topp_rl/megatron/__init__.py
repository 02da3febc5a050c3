"""Megatron-core backend: a TP/CP GPTModel backbone for Qwen2 / Llama, HF <-> Megatron weights, a Lightning
strategy and weight export to the rollout engines. Needs the `megatron` extra (megatron-core 0.16.x); on CPU
the shims in `cpu_shims` stand in for the CUDA-only pieces. megatron-core itself is imported lazily.
"""

import warnings

import torch

# megatron-core warns, once per rank, about packages it falls back from (Transformer Engine and Apex: the fallbacks
# are what runs here, on CPU and in the CPU shims) and about its own default cuda_graph_scope ("full", deprecated
# by itself); without a GPU also about CUDA_DEVICE_MAX_CONNECTIONS, a CUDA stream setting. None asks anything of a
# user (16 lines at parallel=tp2): silenced by their messages, before megatron-core is imported.
KNOWN_HARMLESS = ["Transformer Engine and Apex are not installed", "Apex is not installed. Falling back to Torch Norm",
                  "full scope is deprecated"]
if not torch.cuda.is_available():
    KNOWN_HARMLESS.append("When using async grad allreduce it is recommended to set the environment variable "
                          "CUDA_DEVICE_MAX_CONNECTIONS")
for message in KNOWN_HARMLESS:
    warnings.filterwarnings("ignore", message=f"{message}.*", category=UserWarning)

from topp_rl.megatron.backbone import MegatronBackbone, build_gpt_model, transformer_config  # noqa: E402
from topp_rl.megatron.convert import hf_to_megatron, load_hf_into, megatron_to_hf  # noqa: E402

__all__ = [
    "MegatronBackbone",
    "build_gpt_model",
    "hf_to_megatron",
    "load_hf_into",
    "megatron_to_hf",
    "transformer_config",
]
