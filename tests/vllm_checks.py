"""Checks shared by the real-vLLM tests (tests/test_vllm.py, the vLLM subject of tests/test_engine_contract.py): the
venv's python or a skip, the tiny models (head size 32: vLLM's CPU attention has no 16), and kept sets and
log-probs against HF transformers in float32 under vLLM's convention (`sampling_candidates(convention="vllm")`)."""

from pathlib import Path

import pytest
import torch

from topp_rl.engines.vllm.server import vllm_python
from topp_rl.models import build_tiny_model
from topp_rl.ops import sampling_candidates

VOCAB = 512
TOL = 1e-4  # float32 forward in two engines (vLLM's CPU kernels vs HF eager), as SGLang's
PROMPTS = [[1, 5, 9, 14, 20], [1, 33, 7], [1, 60, 61, 62, 63, 64, 65, 66]]


def require_vllm(*, module: bool = False) -> Path:
    """The vLLM venv's python, or a skip naming the fix (never on CI: scripts/test.sh exports it)."""
    python = vllm_python()
    if python is None:
        pytest.skip("TOPP_RL_VLLM_PYTHON is unset (scripts/test.sh exports what scripts/setup_vllm.sh prints)",
                    allow_module_level=module)
    return python


def tiny_model(*, tie_embeddings: bool = False, seed: int = 3):
    # initializer_range 0.4 makes the random logits peaked enough that top-p sets are small and varied.
    return build_tiny_model("qwen2", vocab_size=VOCAB, hidden=64, heads=2, kv_heads=1, layers=2,
                            tie_embeddings=tie_embeddings, max_positions=4096, initializer_range=0.4, seed=seed)  # fmt: skip


def hf_logits(model, sample) -> torch.Tensor:
    """Logits [R, V] that produced each response token (float32, HF eager)."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    p = len(sample.prompt_ids)
    return logits[p - 1 : p - 1 + sample.response_length]


def check_vllm_sets(samples, model, params, *, tol: float = TOL) -> list[int]:
    """Every sample against `model`'s float32 logits: its kept sets equal `sampling_candidates(convention="vllm")`
    exactly and hold the sampled token, and the recorded log-prob is log_softmax(logits / T) renormalised over the
    set. Returns the set sizes seen."""
    sizes = []
    for s in samples:
        assert s.response_length > 0 and s.candidates.num_rows == s.response_length
        logits = hf_logits(model, s)
        ref = sampling_candidates(logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                  min_p=params.min_p, convention="vllm")  # fmt: skip
        scaled = torch.log_softmax(logits / params.temperature, dim=-1)
        for i, tok in enumerate(s.response_ids):
            kept = s.candidates.ids[s.candidates.offsets[i] : s.candidates.offsets[i + 1]].long()
            assert sorted(kept.tolist()) == sorted(ref.ids[ref.offsets[i] : ref.offsets[i + 1]].tolist()), f"token {i}"
            assert tok in kept.tolist()
            renorm = scaled[i, tok] - torch.logsumexp(scaled[i, kept], 0)
            assert abs(float(renorm) - s.rollout_log_probs[i]) <= tol, (float(renorm), s.rollout_log_probs[i])
            sizes.append(kept.numel())
    return sizes
