"""The fused decode forward (`topp_rl.engines.fused_decode`) against HF's own forward with a DynamicCache: the
same logits (to float32 rounding), and through the engine the same tokens, candidate sets and log-probs; and
the engine's `decode` selection (auto falls back where fused cannot run; fused refuses)."""

import contextlib
import dataclasses

import pytest
import torch
from transformers import DynamicCache

from topp_rl.engines import fused_decode
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.engines.fused_decode import FusedDecoder, unsupported_reason
from topp_rl.models import build_tiny_model
from topp_rl.rollout import SamplingParams
from topp_rl.trainer.lora import LoraSettings, apply_lora

FAMILIES = ["qwen2", "llama", "qwen3", "mistral"]
# Left padding of several widths (the first row is the widest); ids avoid the char tokenizer's eos (2).
PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1, 20], [1, 30, 31, 32], [1, 40, 41, 42, 43]]
PARAMS = SamplingParams(top_p=0.9, top_k=40, temperature=1.1, max_new_tokens=8)


def _model(family: str, seed: int = 0, **overrides):
    # initializer_range 0.2: peaked random logits (sets of varied sizes); 4 heads on 2 kv heads: GQA
    return build_tiny_model(family, vocab_size=96, seed=seed, initializer_range=0.2, **overrides)


def _engines(model, **kwargs) -> tuple[EmbeddedEngine, EmbeddedEngine]:
    common = dict(eos_token_id=2, record_raw_log_probs=True, progress=False, **kwargs)
    return EmbeddedEngine(model, decode="fused", **common), EmbeddedEngine(model, decode="hf", **common)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("concatenated", [True, False], ids=["qkv-concatenated", "separate"])
def test_logits_equal_hf_forward(family, concatenated, monkeypatch):
    """Prefill of left-padded prompts, then one token per step: the last-position logits equal HF's forward
    with its DynamicCache (max abs difference measured at 4e-6 on logits of magnitude ~5: float32 rounding of
    another attention kernel), with the projections concatenated (a small model) and separate (a large one)."""
    if not concatenated:
        monkeypatch.setattr(fused_decode, "FUSE_PROJECTIONS_MAX_BYTES", 0)
    model = _model(family)
    batch, width, steps = len(PROMPTS), max(map(len, PROMPTS)), 6
    ids = torch.zeros((batch, width), dtype=torch.long)
    mask = torch.ones((batch, width + steps), dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, : width - len(p)] = 0
    positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    fused, cache = FusedDecoder(model).start(batch, width + steps, mask), DynamicCache()
    assert (fused.fused is not None) == concatenated
    with torch.no_grad():
        for t in range(steps):
            ref = model(input_ids=ids, attention_mask=mask[:, : width + t], position_ids=positions,
                        logits_to_keep=1, use_cache=True, cache=cache).logits[:, -1].float()
            got = fused(ids, positions)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
            ids, positions = ref.argmax(-1, keepdim=True), positions[:, -1:] + 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["batch1", "batch4"])
def test_engine_fused_equals_hf_path(family, prompts):
    """Same seed: identical tokens and candidate sets, log-probs (renormalised and raw) within 1e-5."""
    fused, hf = _engines(_model(family))
    params = dataclasses.replace(PARAMS, n=2)
    got, ref = fused.generate(prompts, params, seed=7), hf.generate(prompts, params, seed=7)
    assert (fused.decode_path, hf.decode_path) == ("fused", "hf")
    sizes = []
    for a, b in zip(got, ref, strict=True):
        assert a.response_ids == b.response_ids and a.status == b.status
        assert a.candidates == b.candidates
        torch.testing.assert_close(torch.tensor(a.rollout_log_probs), torch.tensor(b.rollout_log_probs),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(a.rollout_raw_log_probs), torch.tensor(b.rollout_raw_log_probs),
                                   atol=1e-5, rtol=0)
        sizes += a.candidates.row_lengths().tolist()
    assert max(sizes) > min(sizes) >= 1  # the sets vary: the comparison is not vacuous


def test_shared_module_weight_change_seen_at_once():
    """A shared engine reads the live parameters at every step: an in-place change (an optimizer step) shows
    in the next generate, equal to the HF path on the changed module."""
    model = _model("qwen2")
    fused, hf = _engines(model, share_weights=True)
    before = fused.generate(PROMPTS, PARAMS, seed=1)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        model.model.norm.weight.add_(0.5)
    after, ref = fused.generate(PROMPTS, PARAMS, seed=1), hf.generate(PROMPTS, PARAMS, seed=1)
    assert [s.rollout_log_probs for s in after] != [s.rollout_log_probs for s in before]
    for a, b in zip(after, ref, strict=True):
        assert a.response_ids == b.response_ids and a.candidates == b.candidates
        torch.testing.assert_close(torch.tensor(a.rollout_log_probs), torch.tensor(b.rollout_log_probs),
                                   atol=1e-5, rtol=0)


def _lora_model():
    model = _model("qwen2")
    apply_lora(model, LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj")))
    return model


@pytest.mark.parametrize(
    ("build", "routes", "reason"),
    [
        (lambda: _model("qwen3_moe"), True, "Qwen3MoeForCausalLM is not one of"),
        (lambda: _model("qwen3_moe"), False, "Qwen3MoeForCausalLM is not one of"),
        (_lora_model, True, "PEFT"),
        (lambda: _model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}), True, "rope type 'linear'"),
        (lambda: _model("mistral", sliding_window=4), True, "sliding-window"),
    ],
    ids=["qwen3_moe", "qwen3_moe_no_routes", "peft", "rope_scaling", "sliding_window"],
)
def test_auto_falls_back_and_fused_refuses(build, routes, reason):
    model = build()
    auto = EmbeddedEngine(model, progress=False, share_weights=True, record_routes=routes)
    assert auto.decode_path == "hf" and reason in auto.decode_reason
    samples = auto.generate(PROMPTS[:2], SamplingParams(top_p=0.9, max_new_tokens=3), seed=0)
    assert auto.decode_path == "hf" and len(samples) == 2
    with pytest.raises(ValueError, match=f"decode='fused' cannot run .*{reason}.*decode='auto'"):
        EmbeddedEngine(model, decode="fused", progress=False, share_weights=True, record_routes=routes)


def test_sharded_module_falls_back():
    """`sample_sharded` (FSDP): auto switches to the HF forward; an explicit fused engine refuses."""
    model = _model("qwen2")
    auto = EmbeddedEngine(model, share_weights=True, progress=False)
    assert auto.decode_path == "fused" and auto.decode_reason is None
    auto.sample_sharded(contextlib.nullcontext)
    assert auto.decode_path == "hf" and "FSDP" in auto.decode_reason
    fused = EmbeddedEngine(model, share_weights=True, progress=False, decode="fused")
    with pytest.raises(ValueError, match="sharded by FSDP"):
        fused.sample_sharded(contextlib.nullcontext)


def test_supported_families_and_bad_value():
    for family in FAMILIES:
        assert unsupported_reason(_model(family)) is None
    with pytest.raises(ValueError, match="decode \\('fast'\\) must be"):
        EmbeddedEngine(_model("qwen2"), decode="fast")
