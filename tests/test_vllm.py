"""The real vLLM server (one for the module: CPU, float32, a tiny Qwen2 with TIED embeddings) behind `VLLMEngine`:
kept sets equal vLLM's rule (`sampling_candidates(convention="vllm")`) on dense HF float32 logits for several
settings; untruncated sampling records no sets; seeds reproduce; a weight update reaches every layer and the tied
head even for a prompt longer than one prefix-cache block that the old weights had cached; a request sent while an
update is open waits and samples the new weights only; ties that overflow top_k abort the sample with the reason.
The engine contract over vLLM: tests/test_engine_contract.py."""

import copy
import threading

import pytest
import torch
from vllm_checks import PROMPTS, check_vllm_sets, hf_logits, perturbed, require_vllm, tiny_model

from topp_rl.engines.vllm import VLLMEngine
from topp_rl.models import save_model
from topp_rl.rollout import SampleStatus, SamplingParams

pytestmark = pytest.mark.vllm
LONG = [1] + [(7 * i) % 500 + 2 for i in range(299)]  # 300 tokens: more than one prefix-cache block


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_vllm()
    model = tiny_model(tie_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model_dir = save_model(model, None, tmp_path_factory.mktemp("vllm-qwen2-tied"))
    engine = VLLMEngine(model_path=model_dir, progress=False)
    yield engine, model
    engine.close()


@pytest.mark.parametrize("params", [
    SamplingParams(top_p=0.9, top_k=20, max_new_tokens=8, n=2),
    SamplingParams(top_p=0.8, top_k=40, min_p=0.05, temperature=0.7, max_new_tokens=8, n=2),
    SamplingParams(top_k=5, temperature=1.3, max_new_tokens=8, n=2),
], ids=["top_p_top_k", "all_four", "top_k_only"])
def test_kept_sets_equal_vllm_rule_on_dense_fp32_logits(served, params):
    engine, model = served
    samples = engine.generate(PROMPTS, params, seed=1)
    assert [s.prompt_ids for s in samples] == [p for p in PROMPTS for _ in range(params.n)]
    sizes = check_vllm_sets(samples, model, params)
    assert min(sizes) >= 1 and max(sizes) <= params.top_k
    assert max(sizes) > min(sizes) if params.top_p < 1 else set(sizes) == {params.top_k}  # the check is not vacuous


def test_untruncated_sampling_records_the_full_distribution_log_prob(served):
    engine, model = served
    params = SamplingParams(temperature=0.8, max_new_tokens=6)
    for s in engine.generate(PROMPTS, params, seed=2):
        assert s.candidates is None
        scaled = torch.log_softmax(hf_logits(model, s) / params.temperature, dim=-1)
        want = scaled[torch.arange(s.response_length), torch.tensor(s.response_ids)]
        assert torch.allclose(torch.tensor(s.rollout_log_probs), want, atol=1e-4)


def test_a_seed_reproduces_its_samples(served):
    engine, _ = served
    params = SamplingParams(top_p=0.95, top_k=50, max_new_tokens=8, n=3)
    first, again = engine.generate(PROMPTS, params, seed=9), engine.generate(PROMPTS, params, seed=9)
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    assert len({tuple(s.response_ids) for s in first}) > 1  # distinct samples per prompt, not one repeated


def test_weight_update_reaches_every_layer_and_the_tied_head_past_the_prefix_cache(served):
    engine, model = served
    params = SamplingParams(top_p=0.9, top_k=20, max_new_tokens=6, n=2)
    check_vllm_sets(engine.generate([LONG], params, seed=3), model, params)  # the old weights' KV is cached now
    changed = perturbed(model, seed=11, scale=0.3)
    try:
        stats = engine.update_weights(changed.named_parameters())
        assert stats.method == "disk" and stats.bytes == sum(p.numel() * 4 for p in changed.parameters())
        samples = engine.generate([LONG, *PROMPTS], params, seed=4)
        assert {s.weight_version for s in samples} == {int(stats.version)}
        check_vllm_sets(samples, changed, params)
        with pytest.raises(AssertionError):  # the old weights do not explain them
            check_vllm_sets(samples[:2], model, params)
    finally:
        engine.update_weights(model.named_parameters())
    check_vllm_sets(engine.generate([LONG], params, seed=5), model, params)


def test_a_broadcast_weight_update_reaches_every_layer_and_the_tied_head(served):
    """rollout.engine.weight_sync=distributed: the tensors travel over a gloo group with the server's worker (no
    file), in several buckets, and load through the same in-place reload and head refresh as a disk update."""
    engine, model = served
    params = SamplingParams(top_p=0.9, top_k=20, max_new_tokens=6, n=2)
    check_vllm_sets(engine.generate([LONG], params, seed=3), model, params)
    changed = perturbed(model, seed=13, scale=0.3)
    sync = engine.weights
    sync.method, sync.bucket_bytes = "distributed", 64 << 10  # the tiny model's 0.4 MB in several buckets
    try:
        stats = engine.update_weights(changed.named_parameters())
        assert stats.method == "distributed" and stats.buckets > 2
        assert stats.bytes == sum(p.numel() * 4 for p in changed.parameters())
        samples = engine.generate([LONG, *PROMPTS], params, seed=4)
        assert {s.weight_version for s in samples} == {int(stats.version)}
        check_vllm_sets(samples, changed, params)
        group = sync.broadcast
        engine.update_weights(model.named_parameters())  # the group is kept between updates
        assert sync.broadcast is group
        check_vllm_sets(engine.generate([LONG], params, seed=5), model, params)
    finally:
        sync.close()
        sync.method = "disk"
        engine.update_weights(model.named_parameters())


def test_a_request_sent_during_an_update_waits_and_samples_only_the_new_weights(served):
    """The update's order (pause, push, resume) holds a request that arrives meanwhile in vLLM's queue: it is first
    scheduled after the resume, so no forward pass runs while weights load (vLLM's worker crashed when one did)."""
    engine, model = served
    url, sync = engine.urls[0], engine.weights
    params = SamplingParams(top_p=0.9, top_k=20, max_new_tokens=6)
    changed = perturbed(model, seed=12, scale=0.3)
    with sync_checkpoint(engine, changed) as checkpoint:
        sync.pause(url)
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(samples=engine.generate([LONG], params, seed=6)))
        thread.start()
        try:
            # The call in flight (vLLM's queue gauge is not refreshed while it is paused): the request is sent now,
            # or soon; either way the pause holds it until the resume below.
            wait_until(lambda: engine.client.waits.pending() >= 1,
                       what="the generate call in flight")
            sync.push(url, checkpoint, nbytes=0, version="77")
            assert thread.is_alive()  # still held: nothing was sampled during the push
        finally:
            sync.post(url, "/resume")
            thread.join(timeout=120)
    try:
        (sample,) = result["samples"]
        assert sample.weight_version == 77 and sample.status is not SampleStatus.ABORTED
        check_vllm_sets([sample], changed, params)
        assert engine.server.returncode is None  # the worker is alive
    finally:
        engine.update_weights(model.named_parameters())


def test_ties_past_top_k_abort_the_sample_with_the_reason(served):
    """A zero embedding (tied head) gives every id the same logit: vLLM keeps all of them, more than top_k, and its
    top-(k+1) list cannot show the set: every sample is aborted and flagged, never cut to k."""
    engine, model = served
    flat = copy.deepcopy(model)
    with torch.no_grad():
        flat.model.embed_tokens.weight.zero_()
    try:
        engine.update_weights(flat.named_parameters())
        samples = engine.generate(PROMPTS, SamplingParams(top_p=0.9, top_k=5, max_new_tokens=4), seed=7)
        assert all(s.status is SampleStatus.ABORTED and s.metadata["candidate_overflow"] for s in samples)
        assert "holds more than top_k=5 ids" in samples[0].metadata["finish_reason"]["message"]
    finally:
        engine.update_weights(model.named_parameters())


def wait_until(condition, *, what: str, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.2)


class sync_checkpoint:
    """The engine's checkpoint of `model` for a hand-driven update (`WeightSync.push`), removed on exit."""

    def __init__(self, engine, model) -> None:
        from topp_rl.engines.serving.weights import write_checkpoint

        self._cm = write_checkpoint(list(model.named_parameters()), config_dir=engine.model_path,
                                    parent=engine.workdir)  # fmt: skip

    def __enter__(self):
        return self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def test_an_engine_by_url_shares_the_running_server_and_leaves_it_running(served):
    engine, model = served
    params = SamplingParams(top_p=0.9, top_k=20, max_new_tokens=4)
    with VLLMEngine(urls=[engine.urls[0]], model_path=engine.model_path, progress=False) as by_url:
        assert by_url.shared_by_ranks is True and by_url.servers == [] and by_url.vocab_size == model.config.vocab_size
        check_vllm_sets(by_url.generate(PROMPTS, params, seed=8), model, params)
    assert engine.server.returncode is None  # closing a connected engine stops nothing
    check_vllm_sets(engine.generate(PROMPTS[:1], params, seed=8), model, params)
