"""HF <-> Megatron conversion (single process, no process group): exact round trips at TP 1, 2 and 4, shard shapes
and layouts, vocab padding, and the errors. The numerical meaning of the layout (logits equal HF) is checked in
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
    }


@pytest.mark.parametrize("family", ["qwen2", "llama"])
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
    assert s0["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * model.config.intermediate_size // tp, h)
    assert s0["decoder.layers.0.self_attention.linear_proj.weight"].shape == (h, h // tp)
    assert ("output_layer.weight" in s0) == (family == "llama")
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in s0) == (family == "qwen2")


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
