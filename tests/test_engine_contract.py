"""The `RolloutEngine` contract, one suite run against every engine: the embedded engine always (static and
continuous batching), the real
SGLang server (one for the module, float32) under the `sglang` marker, the real vLLM server (one, float32, CPU)
under the `vllm` marker.

Each engine samples from the tiny float32 Qwen2 its own tests use (tests/test_embedded_engine.py,
tests/sglang_checks.py), and every sample is checked against a dense HF recomputation of that model's logits:
n samples per prompt, prompt-major; each sampled token in its recorded kept set, the set being SGLang's rule
(`sampling_candidates`) on those logits; the recorded log-prob renormalised over exactly the kept set.
Tolerances are each engine's own (the embedded engine replays the same float32 forward: 1e-5, as
tests/test_embedded_engine.py; SGLang runs another float32 kernel: `TOL`, and a set may differ only at the
top-p boundary, as tests/test_sglang.py; vLLM follows its own order, `convention="vllm"`, and its sets match
exactly: tests/vllm_checks.py). Then: a weight update is reflected by the next rollout, capabilities
answer, bad parameters are refused naming the value, and `close` is idempotent.
"""

from dataclasses import dataclass

import pytest
import torch
from sglang_checks import (
    PROMPTS,
    TOL,
    boundary_explained,
    changed_model,
    hf_logits,
    require_sglang,
    tiny_model,
)  # fmt: skip

from topp_rl.data.routes import MoeRouting
from topp_rl.engines.base import RolloutEngine
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_tiny_model, save_model
from topp_rl.models.moe import moe_routing
from topp_rl.ops import sampling_candidates
from topp_rl.rollout import SampleStatus, SamplingParams

PARAMS = SamplingParams(top_p=0.8, top_k=40, temperature=0.9, max_new_tokens=6, n=3)


@dataclass
class Subject:
    """An engine under test, the HF model it samples from, and how exactly it must match that model."""

    name: str
    engine: RolloutEngine
    model: torch.nn.Module
    tol: float  # on the recorded log-probs against the HF recomputation
    exact_sets: bool  # False: a set may differ where float32 rounding decides the top-p boundary
    convention: str = "sglang"  # the engine's truncation order (`sampling_candidates(convention=...)`)


def _embedded() -> Subject:
    from test_embedded_engine import _model

    model = _model()
    engine = EmbeddedEngine(model, record_raw_log_probs=True, progress=False)  # its own copy of the weights
    return Subject("embedded", engine, model, tol=1e-5, exact_sets=True)


def _embedded_continuous() -> Subject:
    """The embedded engine with continuous batching (its own decode loop, per-row caches): the same float32
    forward per row, the same tolerance."""
    from test_embedded_engine import _model

    model = _model()
    engine = EmbeddedEngine(model, batching="continuous", record_raw_log_probs=True, progress=False)
    return Subject("embedded_continuous", engine, model, tol=1e-5, exact_sets=True)


def _sglang(tmp_path_factory) -> Subject:
    require_sglang()
    from topp_rl.engines.sglang import SGLangEngine

    model = tiny_model()
    model_dir = save_model(model, None, tmp_path_factory.mktemp("contract-qwen2"))
    engine = SGLangEngine(model_path=model_dir, progress=False, server_kwargs={"max_total_tokens": 16384})
    return Subject("sglang", engine, model, tol=TOL, exact_sets=False)


def _vllm(tmp_path_factory) -> Subject:
    """vLLM's CPU attention has no head size 16: its own tiny Qwen2 (head size 32, otherwise the SGLang one's)."""
    import vllm_checks

    vllm_checks.require_vllm()
    from topp_rl.engines.vllm import VLLMEngine

    model = vllm_checks.tiny_model()
    model_dir = save_model(model, None, tmp_path_factory.mktemp("contract-qwen2-vllm"))
    engine = VLLMEngine(model_path=model_dir, progress=False)
    return Subject("vllm", engine, model, tol=vllm_checks.TOL, exact_sets=True, convention="vllm")


@pytest.fixture(scope="module", params=["embedded", "embedded_continuous",
                                        pytest.param("sglang", marks=pytest.mark.sglang),
                                        pytest.param("vllm", marks=pytest.mark.vllm)])
def subject(request, tmp_path_factory):
    """One engine per kind for the module (pytest runs the module's tests per kind, so one server at a time)."""
    makers = {"embedded": _embedded, "embedded_continuous": _embedded_continuous}
    servers = {"sglang": _sglang, "vllm": _vllm}
    built = makers[request.param]() if request.param in makers else servers[request.param](tmp_path_factory)
    yield built
    built.engine.close()


def check_against(subject: Subject, samples, model, params: SamplingParams) -> list[int]:
    """Every sample against `model`'s float32 logits: the sampled token is in its kept set, the set is
    `sampling_candidates` (up to top-p boundary rounding where allowed), and the recorded log-prob equals
    log_softmax(logits / T) restricted to the kept set. Returns the set sizes seen."""
    sizes = []
    for s in samples:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and 0 < s.response_length
        assert s.response_length <= params.max_new_tokens and s.candidates.num_rows == s.response_length
        logits = hf_logits(model, s)
        ref = sampling_candidates(logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                  min_p=params.min_p, convention=subject.convention)  # fmt: skip
        scaled = torch.log_softmax(logits / params.temperature, dim=-1)
        for i, tok in enumerate(s.response_ids):
            kept = s.candidates.ids[s.candidates.offsets[i] : s.candidates.offsets[i + 1]].long()
            want = set(ref.ids[ref.offsets[i] : ref.offsets[i + 1]].tolist())
            assert tok in kept.tolist(), f"{subject.name}: sampled token {tok} missing from its kept set"
            if set(kept.tolist()) != want:
                differs = f"{subject.name} token {i}: kept {sorted(kept.tolist())}, want {sorted(want)}"
                assert not subject.exact_sets, differs
                assert boundary_explained(scaled[i].exp(), set(kept.tolist()), want, params.top_p)
            renorm = scaled[i, tok] - torch.logsumexp(scaled[i, kept], 0)  # the dense log-prob over the kept set
            assert abs(float(renorm) - s.rollout_log_probs[i]) <= subject.tol
            sizes.append(kept.numel())
    return sizes


def test_n_samples_per_prompt_prompt_major_each_token_in_its_renormalised_kept_set(subject):
    samples = subject.engine.generate(PROMPTS, PARAMS, seed=3)
    assert len(samples) == len(PROMPTS) * PARAMS.n
    assert [s.prompt_ids for s in samples] == [p for p in PROMPTS for _ in range(PARAMS.n)]
    sizes = check_against(subject, samples, subject.model, PARAMS)
    assert min(sizes) >= 1 and max(sizes) > min(sizes)  # the sets vary: the check is not vacuous


def test_generate_after_a_weight_update_follows_the_new_weights(subject):
    """The next rollout after `update_weights` matches the changed model and not the old one; and back."""
    changed = changed_model(subject.model)
    try:
        subject.engine.update_weights(changed.named_parameters())
        samples = subject.engine.generate(PROMPTS, PARAMS, seed=4)
        check_against(subject, samples, changed, PARAMS)
        with pytest.raises(AssertionError):  # the old weights do not explain these log-probs
            check_against(subject, samples, subject.model, PARAMS)
    finally:
        subject.engine.update_weights(subject.model.named_parameters())
    check_against(subject, subject.engine.generate(PROMPTS, PARAMS, seed=5), subject.model, PARAMS)


def test_capabilities(subject):
    engine = subject.engine
    assert engine.shares_trainer_weights is False  # both hold their own copy here
    assert engine.shared_by_ranks is False  # launched here / in-process: every rank has its own
    assert engine.records_routes is False  # a dense model has no routes to record
    assert engine.max_candidates == (None if subject.name.startswith("embedded") else 4096)
    assert engine.vocab_size == subject.model.config.vocab_size


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SamplingParams(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (lambda: SamplingParams(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
        (lambda: SamplingParams(n=0), r"n=0 must be an integer >= 1"),
    ],
)
def test_bad_sampling_parameters_are_refused_naming_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_prompts_are_refused_naming_the_prompt(subject):
    vocab = subject.engine.vocab_size
    with pytest.raises(ValueError, match="prompt 1 is empty; every prompt needs at least one token"):
        subject.engine.generate([[1], []], PARAMS)
    with pytest.raises(ValueError, match=rf"prompt 0 has token ids outside the model vocabulary \[0, {vocab}\)"):
        subject.engine.generate([[1, vocab]], PARAMS)


def test_routes_of_a_tiny_moe_have_one_row_per_fed_token():
    """Embedded only: SGLang 0.5.23 captures routes only on CUDA servers (docs/sglang.md; the GPU check covers it)."""
    from test_routing import own_routes

    model = build_tiny_model("qwen3_moe", seed=0)
    routing = moe_routing(model)
    assert routing == MoeRouting(layer_ids=(0, 1), top_k=2, num_experts=4, num_hidden_layers=2)
    with EmbeddedEngine(model, progress=False) as engine:
        assert engine.records_routes is True
        samples = engine.generate(PROMPTS, PARAMS, seed=1)
    for s in samples:
        assert s.routes.shape == (len(s.tokens) - 1, len(routing.layer_ids), routing.top_k)
        assert torch.equal(s.routes, own_routes(model, s.tokens)[:-1])  # the routers' own picks


def test_close_is_idempotent(subject):
    """Last in the module: closes the module's engine (the fixture's teardown closes it once more)."""
    from topp_rl.engines.serving.process import group_alive

    served = subject.name in ("sglang", "vllm")
    groups = [srv.pid for srv in subject.engine.servers] if served else []  # its process group
    subject.engine.close()
    subject.engine.close()
    assert all(not group_alive(pgid) for pgid in groups)
    if served:
        assert len(groups) == 1 and subject.engine.servers == [] and not subject.engine.workdir.exists()
