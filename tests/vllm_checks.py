"""Checks shared by the real-vLLM tests (tests/test_vllm.py, the vLLM subject of tests/test_engine_contract.py): the
venv's python or a skip, the tiny models (head size 32: vLLM's CPU attention has no 16), and kept sets and
log-probs against HF transformers in float32 under vLLM's convention (`sampling_candidates(convention="vllm")`)."""

from pathlib import Path

import pytest
import requests
import torch
from helpers import by_version, fp32_bars, hf_logits, perturbed  # noqa: F401 - the server tests import them from here
from sglang_checks import boundary_explained

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


def first_tokens_served(url: str) -> int:
    """Requests that have received their first token on the server at `url`, from its Prometheus metrics (the
    count of vLLM's time-to-first-token histogram)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    return int(sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:time_to_first_token_seconds_count")))  # fmt: skip


def check_vllm_sets(
    samples, model, params, *, tol: float | torch.Tensor = TOL, logits_of=None, first: int | None = None
) -> list[int]:
    """Every sample against `model`'s float32 logits (or `logits_of(sample)`, [R, V]): its kept sets equal
    `sampling_candidates(convention="vllm")` exactly and hold the sampled token, and the recorded log-prob is
    log_softmax(logits / T) renormalised over the set, within `tol` (one bar, or one per token: [R], which also lets
    a set differ where that rounding can move the cut: `boundary_explained`); `first`: only its first tokens.
    Returns the set sizes seen."""
    sizes = []
    for s in samples:
        assert s.response_length > 0 and s.candidates.num_rows == s.response_length
        logits = hf_logits(model, s) if logits_of is None else logits_of(s)
        ref = sampling_candidates(logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                  min_p=params.min_p, convention="vllm")  # fmt: skip
        scaled = torch.log_softmax(logits / params.temperature, dim=-1)
        for i, tok in enumerate(s.response_ids[:first]):
            kept = s.candidates.ids[s.candidates.offsets[i] : s.candidates.offsets[i + 1]].long()
            want = ref.ids[ref.offsets[i] : ref.offsets[i + 1]].tolist()
            if sorted(kept.tolist()) != sorted(want):  # exact, but where a per-token bar lets rounding move the cut
                assert isinstance(tol, torch.Tensor) and boundary_explained(
                    top_k_probs(scaled[i], params.top_k), set(kept.tolist()), set(want), params.top_p,
                    tol=float(tol[i]), logp_row=scaled[i]), f"token {i}"  # fmt: skip
            assert tok in kept.tolist()
            renorm = scaled[i, tok] - torch.logsumexp(scaled[i, kept], 0)
            bar = float(tol[i]) if isinstance(tol, torch.Tensor) else tol
            assert abs(float(renorm) - s.rollout_log_probs[i]) <= bar, (i, float(renorm), s.rollout_log_probs[i], bar)
            sizes.append(kept.numel())
    return sizes


def top_k_probs(logp_row: torch.Tensor, top_k: int) -> torch.Tensor:
    """The distribution vLLM's top-p cut sees: renormalised over the ids at or above the k-th largest log-prob."""
    if not 0 < top_k < logp_row.numel():
        return logp_row.exp()
    kth = torch.topk(logp_row, top_k).values[-1]
    return torch.softmax(logp_row.masked_fill(logp_row < kth, float("-inf")), dim=-1)


