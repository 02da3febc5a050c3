"""megatron-core TransformerConfig and per-layer specs equivalent to an HF config (see `hf_config` for families).

- Attention: GQA with optional QKV bias (Qwen2) and optional per-head RMSNorm on q and k before RoPE (Qwen3,
  megatron's `qk_layernorm`); `kv_channels` is HF's `head_dim`, which may differ from hidden / heads.
- MLP: SwiGLU; Qwen3-MoE layers use megatron's `MoELayer` (SequentialMLP experts, TopKRouter) where HF's rule
  (`decoder_sparse_step`, `mlp_only_layers`) puts a sparse block, dense MLPs elsewhere (`moe_layer_freq` list).
- Router: HF Qwen3-MoE takes softmax over all experts, then top-k, then (norm_topk_prob) divides by the top-k
  sum. Megatron's `moe_router_pre_softmax=False` takes top-k of the logits, then softmax over those k:
  exp(l_i) / sum_topk exp(l_j) = p_i / sum_topk p_j, the same value (top-k of logits and of their softmax pick
  the same experts). Without norm_topk_prob it is `moe_router_pre_softmax=True` (softmax, then top-k) with no
  scaling. Both are tested against HF in test_megatron_equivalence.py.
- CPU / pure-torch path: megatron's local spec with the shims of `cpu_shims` / `moe`; GPU with
  transformer-engine and 16-bit weights: TE's spec, whose attention cannot take a sliding window here.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from topp_rl.megatron import cpu_shims, moe
from topp_rl.megatron.hf_config import attention_window, head_dim, model_type, moe_layers, qk_norm, qkv_bias
from topp_rl.megatron.pipeline import pipeline_config_fields


def use_transformer_engine(dtype: torch.dtype) -> bool:
    """transformer-engine layers on CUDA with TE installed and a 16-bit dtype (TE's THD attention kernels are
    bf16 / fp16 only); float32 runs keep the exact pure-torch attention."""
    return (dtype in (torch.bfloat16, torch.float16) and torch.cuda.is_available()
            and importlib.util.find_spec("transformer_engine") is not None)


def _check_divisible(hf_config, *, tp_size: int, ep_size: int) -> None:
    if hf_config.vocab_size % tp_size:
        raise ValueError(
            f"vocab_size={hf_config.vocab_size} is not divisible by tensor parallel size {tp_size}; exact "
            "log-probs need unpadded even vocab shards: choose a TP size dividing vocab_size, or resize the "
            "model's embeddings to a multiple of it"
        )
    for name in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(hf_config, name)
        if value % tp_size:
            raise ValueError(
                f"{name}={value} is not divisible by tensor parallel size {tp_size}; choose a TP size that "
                f"divides {name}"
            )
    experts = getattr(hf_config, "num_experts", 0) or 0
    if ep_size > 1 and not any(moe_layers(hf_config)):
        raise ValueError(f"parallel.ep_size={ep_size} needs a mixture-of-experts model; set parallel.ep_size=1")
    if experts and experts % ep_size:
        raise ValueError(
            f"num_experts={experts} is not divisible by parallel.ep_size={ep_size}; choose an ep_size that "
            "divides the number of experts"
        )


def _moe_fields(hf_config, *, ep_size: int, te: bool) -> dict:
    pattern = moe_layers(hf_config)
    if not any(pattern):
        return {}
    k, norm = hf_config.num_experts_per_tok, bool(hf_config.norm_topk_prob)
    if k == 1 and norm:
        raise ValueError(
            "num_experts_per_tok=1 with norm_topk_prob=true gives every token weight 1.0 and no router gradient; "
            "megatron's router cannot express it: set norm_topk_prob=false or use the HF backbone"
        )
    return dict(
        num_moe_experts=hf_config.num_experts,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_layer_freq=[int(m) for m in pattern],
        moe_router_topk=k,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not norm,  # see the module docstring
        moe_router_topk_scaling_factor=None,
        moe_router_load_balancing_type="none",  # the aux loss is `moe.TopPMoELayer`'s (see there why)
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall" if te else "allgather",  # CPU: the allgather one, shimmed in `moe`
        expert_model_parallel_size=ep_size,
    )


def transformer_config(hf_config, *, tp_size: int, cp_size: int, ep_size: int = 1, pp_size: int = 1,
                       vpp_size: int = 1, dtype: torch.dtype = torch.float32):
    """megatron-core TransformerConfig equivalent to `hf_config` (dropout 0); at pp_size > 1 with the pipeline
    schedule's fields (`pipeline.pipeline_config_fields`, vpp_size > 1: the interleaved schedule's)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_type(hf_config)
    _check_divisible(hf_config, tp_size=tp_size, ep_size=ep_size)
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported by the Megatron backbone; use the HF backbone")
    te = use_transformer_engine(dtype)
    window = attention_window(hf_config)
    if window is not None and te:
        raise ValueError(
            f"sliding_window={window}: the transformer-engine attention path does not run HF's window here; "
            "train in float32 (the exact pure-torch attention honours it) or use the HF backbone"
        )
    # The pure-torch attention path (CPU, or GPU without transformer-engine) runs with no fused CUDA kernels.
    extra = {} if te else dict(cpu_shims.CPU_CONFIG_OVERRIDES)
    fields = pipeline_config_fields(pp_size, vpp_size) | _moe_fields(hf_config, ep_size=ep_size, te=te)
    # An MoE model pipelined on the all-gather dispatcher (CPU): megatron refuses it with variable_seq_lengths,
    # since its dispatcher gathers equal row counts over TP x EP; `moe.TopPMoELayer` pads every forward's rows to
    # the group's largest count, so the flag (the shapes sent between stages) is set after that check.
    variable = fields.get("moe_token_dispatcher_type") == "allgather" and fields.pop("variable_seq_lengths", False)
    config = TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        qk_layernorm=qk_norm(hf_config),
        window_size=None if window is None else (window - 1, 0),  # TE's (left, right); read by the torch shim
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        context_parallel_size=cp_size,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        **fields,
        **extra,
    )
    if variable:
        config.variable_seq_lengths = True
    return config


def layer_specs(config, dtype: torch.dtype, *, moe_aux_loss_coeff: float = 0.0):
    """TransformerBlockSubmodules with one spec per layer (dense or MoE): transformer-engine's when available,
    otherwise megatron-core's local spec with the pure-torch THD / zigzag-CP attention of `cpu_shims`.
    Every MoE layer is `moe.TopPMoELayer` (TP without sequence parallelism; CPU shims when CUDA is absent)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


    te = use_transformer_engine(dtype)
    pattern = config.moe_layer_freq if config.num_moe_experts else [0] * config.num_layers

    def one(experts: int | None):
        if te:
            spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm)
        else:
            spec = gpt_layer_specs.get_gpt_layer_local_spec(
                num_experts=experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm,
                normalization="RMSNorm")
            spec.submodules.self_attention.submodules.core_attention = cpu_shims.TorchCoreAttention
        if experts is not None:
            moe.use_topp_moe_layer(spec.submodules.mlp, cpu=cpu_shims.needs_cpu_shims(),
                                   aux_loss_coeff=moe_aux_loss_coeff)
        return spec

    dense, sparse = one(None), (one(config.num_moe_experts) if any(pattern) else None)
    if te:
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        from megatron.core.transformer.transformer_block import LayerNormImpl as final_norm
    return TransformerBlockSubmodules(layer_specs=[sparse if m else dense for m in pattern], layer_norm=final_norm)
