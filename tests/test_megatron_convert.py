"""HF <-> Megatron conversion (single process, no process group): exact round trips at TP 1, 2 and 4 for every
family (Qwen3-MoE also at EP 2 and 4), shard shapes and layouts, vocab padding, the router mapping, and the errors. The numerical meaning of the layout (logits equal HF) is checked in
test_megatron_equivalence.py."""

import pytest
import torch

from topp_rl.megatron.convert import fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv
from topp_rl.models import build_tiny_model

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def models():
    return {
        "qwen2": build_tiny_model("qwen2", tie_embeddings=True, heads=8, kv_heads=4, seed=3),
        "llama": build_tiny_model("llama", tie_embeddings=False, heads=8, kv_heads=4, seed=4),
        "qwen3": build_tiny_model("qwen3", tie_embeddings=False, heads=8, kv_heads=4, head_dim=12, seed=5),
        "mistral": build_tiny_model("mistral", tie_embeddings=False, heads=8, kv_heads=4, sliding_window=7, seed=6),
        "qwen3_moe": build_tiny_model("qwen3_moe", tie_embeddings=False, heads=8, kv_heads=4, layers=3,
                                      mlp_only_layers=[1], seed=7),
    }


FAMILIES = ["qwen2", "llama", "qwen3", "mistral", "qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_is_bit_exact(models, family, tp):
    model = models[family]
    state = model.state_dict()
    shards = [hf_to_megatron(state, model.config, tp_size=tp, tp_rank=r) for r in range(tp)]
    back = megatron_to_hf(shards, model.config)
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    # Every shard holds 1/tp of each sharded tensor; norms are replicated.
    h = model.config.hidden_size
    s0 = shards[0]
    assert s0["embedding.word_embeddings.weight"].shape == (model.config.vocab_size // tp, h)
    d, heads = model.config.head_dim if family.startswith("qwen3") else h // 8, model.config.num_attention_heads
    assert s0["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * model.config.intermediate_size // tp, h)
    assert s0["decoder.layers.0.self_attention.linear_proj.weight"].shape == (h, heads * d // tp)
    assert ("output_layer.weight" in s0) == (family != "qwen2")
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in s0) == (family == "qwen2")
    has_qk_norm = family in ("qwen3", "qwen3_moe")
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in s0) == has_qk_norm
    if has_qk_norm:  # replicated on every TP rank: one [head_dim] vector per layer
        for r in range(tp):
            assert torch.equal(shards[r]["decoder.layers.0.self_attention.k_layernorm.weight"],
                               state["model.layers.0.self_attn.k_norm.weight"])


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 2), (1, 4), (2, 4)])
def test_moe_round_trip_over_tp_and_ep_is_bit_exact(models, tp, ep):
    """Shards listed by EP rank, then TP rank; layer 1 is dense (mlp_only_layers), layers 0 and 2 are sparse."""
    model = models["qwen3_moe"]
    config, state = model.config, model.state_dict()
    shards = [hf_to_megatron(state, config, tp_size=tp, tp_rank=t, ep_size=ep, ep_rank=e)
              for e in range(ep) for t in range(tp)]
    back = megatron_to_hf(shards, config, ep_size=ep)
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    per, inter = config.num_experts // ep, config.moe_intermediate_size
    last = shards[-1]  # EP rank ep - 1, TP rank tp - 1: the last experts' last slices
    assert sorted(n for n in last if "layers.0.mlp." in n) == sorted(
        [f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc{k}.weight" for j in range(per) for k in (1, 2)]
        + ["decoder.layers.0.mlp.router.weight"])
    assert "decoder.layers.1.mlp.linear_fc1.weight" in last  # the dense layer
    gate_up = state["model.layers.2.mlp.experts.gate_up_proj"][config.num_experts - 1]
    s = inter // tp
    assert torch.equal(last[f"decoder.layers.2.mlp.experts.local_experts.{per - 1}.linear_fc1.weight"],
                       torch.cat([gate_up[inter - s: inter], gate_up[2 * inter - s:]]))
    assert torch.equal(last["decoder.layers.2.mlp.router.weight"], state["model.layers.2.mlp.gate.weight"])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_config_equals_hf_qwen3_moe_routing(norm_topk_prob):
    """HF: softmax over all experts, top-k, renormalise if norm_topk_prob. Megatron's router with the fields
    `transformer_config` sets gives the same experts and weights (float32, ties excluded by random logits)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from topp_rl.megatron.spec import transformer_config

    model = build_tiny_model("qwen3_moe", norm_topk_prob=norm_topk_prob, num_experts=8, num_experts_per_tok=3)
    config = transformer_config(model.config, tp_size=1, cp_size=1)
    assert (config.moe_router_topk, config.moe_router_score_function) == (3, "softmax")
    assert config.moe_router_pre_softmax is not norm_topk_prob and config.moe_router_topk_scaling_factor is None
    gate = model.model.layers[0].mlp.gate
    hidden = torch.randn(200, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    _, hf_weights, hf_experts = gate(hidden)
    logits = torch.nn.functional.linear(hidden, gate.weight)
    probs, routing_map = topk_routing_with_score_function(
        logits, config.moe_router_topk, use_pre_softmax=config.moe_router_pre_softmax,
        scaling_factor=config.moe_router_topk_scaling_factor, score_function=config.moe_router_score_function)
    expected = torch.zeros_like(probs).scatter(1, hf_experts, hf_weights)
    assert torch.equal(routing_map, expected > 0)
    assert (probs - expected).abs().max() <= 1e-6
    assert torch.allclose(probs.sum(-1), torch.ones(200)) == norm_topk_prob


def test_fc1_holds_each_ranks_gate_slice_then_up_slice(models):
    model = models["llama"]
    state = model.state_dict()
    f = model.config.intermediate_size
    gate, up = state["model.layers.1.mlp.gate_proj.weight"], state["model.layers.1.mlp.up_proj.weight"]
    shard = hf_to_megatron(state, model.config, tp_size=2, tp_rank=1)["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(shard, torch.cat([gate[f // 2:], up[f // 2:]]))


def test_qkv_is_grouped_per_kv_head():
    """heads=4, groups=2, d=1: Megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1]; rank r holds group r."""
    config = build_tiny_model("qwen2", hidden=4, heads=4, kv_heads=2).config
    d = config.hidden_size // config.num_attention_heads
    assert d == 1
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    full = fuse_qkv(q, k, v, config, tp_size=1, tp_rank=0)
    assert full[:, 0].tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert fuse_qkv(q, k, v, config, tp_size=2, tp_rank=1)[:, 0].tolist() == [12, 13, 21, 31]
    parts = [fuse_qkv(q, k, v, config, tp_size=2, tp_rank=r) for r in range(2)]
    for a, b in zip(split_qkv(parts, config), (q, k, v), strict=True):
        assert torch.equal(a, b)


def test_vocab_padding_is_zero_rows_and_is_stripped(models):
    model = models["llama"]
    state = model.state_dict()
    v = model.config.vocab_size
    shards = [hf_to_megatron(state, model.config, tp_size=2, tp_rank=r, padded_vocab_size=v + 64) for r in range(2)]
    assert shards[1]["output_layer.weight"].shape[0] == (v + 64) // 2
    assert torch.count_nonzero(shards[1]["output_layer.weight"][-64:]) == 0
    back = megatron_to_hf(shards, model.config)
    assert torch.equal(back["lm_head.weight"], state["lm_head.weight"])


def test_bad_tensor_parallel_sizes_raise(models):
    model = models["qwen2"]
    with pytest.raises(ValueError, match="num_key_value_heads=4 is not divisible by tp_size=8"):
        hf_to_megatron(model.state_dict(), model.config, tp_size=8, tp_rank=0)
    with pytest.raises(ValueError, match="padded vocab 129 is not divisible"):
        hf_to_megatron(model.state_dict(), model.config, tp_size=2, tp_rank=0, padded_vocab_size=129)
    with pytest.raises(ValueError, match="padded_vocab_size=100 < vocab_size=128"):
        hf_to_megatron(model.state_dict(), model.config, tp_size=2, tp_rank=0, padded_vocab_size=100)


def test_transformer_config_rejects_unsupported_models():
    from topp_rl.megatron.backbone import transformer_config

    config = build_tiny_model("qwen2", heads=4, kv_heads=2).config
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tensor parallel size 4"):
        transformer_config(config, tp_size=4, cp_size=1)
    config.vocab_size = 130
    with pytest.raises(ValueError, match="vocab_size=130 is not divisible by tensor parallel size 4"):
        transformer_config(config, tp_size=4, cp_size=1)
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        transformer_config(config, tp_size=1, cp_size=1)


def test_moe_sizes_and_windows_are_checked_at_start():
    from topp_rl.megatron.spec import transformer_config

    moe = build_tiny_model("qwen3_moe").config  # 4 experts
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by parallel.ep_size=3"):
        transformer_config(moe, tp_size=1, cp_size=1, ep_size=3)
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by ep_size=8"):
        hf_to_megatron(build_tiny_model("qwen3_moe").state_dict(), moe, tp_size=1, tp_rank=0, ep_size=8, ep_rank=0)
    dense = build_tiny_model("qwen3").config
    with pytest.raises(ValueError, match=r"parallel.ep_size=2 needs a mixture-of-experts model"):
        transformer_config(dense, tp_size=1, cp_size=1, ep_size=2)
    mixed = build_tiny_model("qwen3", layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=1).config
    with pytest.raises(ValueError, match=r"layer_types=\['full_attention', 'sliding_attention'\] mixes"):
        transformer_config(mixed, tp_size=1, cp_size=1)
    window = build_tiny_model("mistral", sliding_window=8).config
    assert transformer_config(window, tp_size=1, cp_size=1).window_size == (7, 0)  # honoured: HF keys > q - 8
