"""Offline models and tokenizers: char tokenizer, tiny Qwen2/Llama, HF directory round trip, SmolLM2 (slow)."""

import pytest
import torch

from topp_rl.models import build_char_tokenizer, build_tiny_model, load_hf, load_smollm2, save_model


def test_char_tokenizer_round_trip():
    tok = build_char_tokenizer()
    text = "12+7=19 Ab,c?"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id], skip_special_tokens=True) == text
    assert tok.encode("0123456789", add_special_tokens=False) == list(range(3, 13))
    assert len(tok) == 84
    # Characters outside the set map to <unk> (the last id) instead of vanishing; decoding drops it.
    assert tok.encode("a\n[", add_special_tokens=False) == [tok.convert_tokens_to_ids("a"), 83, 83]
    assert tok.unk_token_id == 83 and tok.decode([83], skip_special_tokens=True) == ""


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "qwen3_moe", "mistral"])
def test_tiny_model_is_seeded_float32_and_round_trips(family, tmp_path):
    tok = build_char_tokenizer()
    a = build_tiny_model(family, vocab_size=96, seed=1, tokenizer=tok)
    b = build_tiny_model(family, vocab_size=96, seed=1, tokenizer=tok)
    c = build_tiny_model(family, vocab_size=96, seed=2, tokenizer=tok)
    assert type(a).__name__ == {
        "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM", "mistral": "MistralForCausalLM",
    }[family]
    assert all(p.dtype == torch.float32 for p in a.parameters()) and not a.training
    assert a.config.num_hidden_layers == 2 and a.config.hidden_size == 64 and a.config.eos_token_id == 2
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    ids = torch.tensor([tok.encode("1+2=", add_special_tokens=False)])
    save_model(a, tok, tmp_path)
    model, tok2 = load_hf(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, a(ids).logits, rtol=0, atol=0)
    assert type(tok2).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert tok2.encode("7*8=56", add_special_tokens=False) == tok.encode("7*8=56", add_special_tokens=False)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"family \('gpt2'\) must be one of \['llama', 'mistral', 'qwen2', 'qwen3', 'qwen3_moe'\]"):
        build_tiny_model("gpt2")
    with pytest.raises(ValueError, match=r"vocab_size \(50\) is smaller than the tokenizer \(84\)"):
        build_tiny_model(vocab_size=50)
    with pytest.raises(ValueError, match=r"hidden \(60\) must divide by heads \(8\)"):
        build_tiny_model(hidden=60, heads=8)
    with pytest.raises(ValueError, match="has no config.json"):
        load_hf(tmp_path)


@pytest.mark.slow
def test_smollm2_from_packaged_gguf():
    model, tok = load_smollm2()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = tok("What is 2+3?", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert torch.isfinite(logits).all() and logits.shape[0] == model.config.vocab_size
    assert tok.decode(tok.encode("12+7=19", add_special_tokens=False)) == "12+7=19"
