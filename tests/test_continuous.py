"""The embedded engine's continuous batching (`batching="continuous"`, `topp_rl.engines.continuous`): every
recorded log-prob against an independent dense fp32 recomputation under the weights of the token's recorded
version, with a weight update landing at a chosen decode step; the KV cache kept or recomputed at the update;
the same tokens as static batching and as the same call alone; a full decode batch; the loop's thread, errors
and refusals.

Tolerance: the engine's logits come from the fused cached forward, the reference's from HF's dense forward of
the same float32 weights; they differ by float32 rounding, <= 5e-6 on logits of magnitude ~5
(tests/test_fused_decode.py). A log-prob over a kept set, z_t - logsumexp(z_kept) with z = logits / T, moves by
at most 2 max|dz| (logsumexp is 1-Lipschitz in the max norm): <= 1e-5 at T = 1 (T >= 0.9 here: 1.1e-5; the
recorded figures stay near 2e-6). Kept sets must be equal: no near-tie at a top-p boundary occurs at these seeds.
"""

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import DynamicCache

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.engines import continuous, fused_decode
from topp_rl.engines.base import InFlightUpdates
from topp_rl.engines.continuous import request_seed
from topp_rl.engines.embedded import ContinuousEmbeddedEngine, EmbeddedEngine
from topp_rl.models import build_tiny_model
from topp_rl.ops import sampling_candidates, token_logprobs

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 20], [1, 30, 31, 32], [1, 40, 41, 42, 43, 44, 45, 46, 47]]
PARAMS = SamplingParams(top_p=0.9, top_k=40, temperature=1.1, max_new_tokens=16, n=2)
TOL = 1e-5 * 1.1  # see the module docstring
WAIT = 300  # seconds: a bound on events that come within seconds (a hung loop fails instead of blocking CI)


def _model(seed: int = 0, family: str = "qwen2"):
    return build_tiny_model(family, vocab_size=96, seed=seed, initializer_range=0.2)


def _perturbed(model, scale: float = 0.02, seed: int = 1):
    """A copy of `model` after an update of about `scale` relative size per tensor (an optimizer step's kind)."""
    out = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.abs().mean())
    return out


def _continuous(model, **kwargs) -> ContinuousEmbeddedEngine:
    kwargs = {"eos_token_id": 2, "record_raw_log_probs": True, "progress": False, "max_batch_size": 4, **kwargs}
    return EmbeddedEngine(model, batching="continuous", **kwargs)


def _hold(engine, until: dict) -> dict[int, threading.Event]:
    """Hold the loop at the boundary after `step` decode steps until `until[step](loop)` (read under the loop's
    lock, waited for on its condition: the loop's own events, never a timing race); per step, an Event set when
    the loop arrives there."""
    loop = engine.loop
    reached = {step: threading.Event() for step in until}

    def hold(steps: int) -> None:
        if steps in until:
            reached[steps].set()
            with loop.cond:
                assert loop.cond.wait_for(lambda: until[steps](loop), timeout=WAIT)

    loop.boundary_hook = hold
    return reached


def _update_requested(loop) -> bool:
    return loop.pause_requests > 0


def _generate_with_update(engine, prompts, params, *, seed, at_step: int, named, version: int) -> list[Sample]:
    """`generate` on a thread; the loop is held at the boundary after `at_step` decode steps until the update is
    requested, so the update lands there."""
    reached = _hold(engine, {at_step: _update_requested})
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(engine.generate, prompts, params, seed=seed)
        assert reached[at_step].wait(WAIT), f"the loop never reached step {at_step}"
        engine.update_weights_in_flight(named, version=version)
        return future.result(WAIT)


def _dense(model, sample: Sample, params: SamplingParams):
    """Kept sets, renormalised and raw log-probs of every response token from one dense forward of prompt +
    response under `model` (no cache), through topp_rl.ops."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        rows = model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
    tokens = torch.tensor(sample.response_ids)
    kw = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p)
    cands = sampling_candidates(rows, **kw)
    masked = token_logprobs(rows, tokens, cands=cands, temperature=params.temperature)
    raw = token_logprobs(rows, tokens, temperature=params.temperature)
    return cands.to_lists(), masked, raw


def _check_exact(sample: Sample, models: dict[int, torch.nn.Module], params: SamplingParams) -> float:
    """Every token against the dense recomputation under its own version's weights; the max |diff|."""
    versions = torch.tensor(sample.token_versions())
    recorded = sample.candidates.to_lists()
    worst = 0.0
    for version, model in models.items():
        mine = versions == version
        if not mine.any():
            continue
        sets, masked, raw = _dense(model, sample, params)
        idx = mine.nonzero().flatten().tolist()
        assert [sorted(recorded[t]) for t in idx] == [sorted(sets[t]) for t in idx]
        for got, want in ((sample.rollout_log_probs, masked), (sample.rollout_raw_log_probs, raw)):
            diff = (torch.tensor(got)[mine] - want[mine]).abs().max().item()
            assert diff <= TOL, (version, diff)
            worst = max(worst, diff)
    return worst


@pytest.mark.parametrize(
    ("family", "patch"),
    [("qwen2", {}), ("qwen3", {}), ("qwen2", {(continuous, "PREFILL_TOKENS"): 12}),
     ("qwen2", {(fused_decode, "FUSE_PROJECTIONS_MAX_BYTES"): 0})],
    ids=["qwen2", "qwen3", "qwen2-prefill-chunks", "qwen2-separate-projections"],
)
def test_tokens_after_an_update_are_sampled_from_the_new_weights_exactly(family, patch, monkeypatch):
    """kv_at_update=recompute: an update after decode step 5 of 8 requests on 4 rows. Tokens before it carry
    version 0 and equal the old weights' dense recomputation, tokens after it version 1 and the new weights'
    (kept sets equal, log-probs within TOL); the requests admitted after it are version 1 throughout. Also with a
    prefill budget of 12 tokens (the re-prefill in several forwards), and with the projections read from the
    module's parameters instead of concatenated copies (a large model's way)."""
    for (module, name), value in patch.items():
        monkeypatch.setattr(module, name, value)
    old = _model(family=family)
    new = _perturbed(old)
    with _continuous(old) as engine:
        samples = _generate_with_update(engine, PROMPTS, PARAMS, seed=3, at_step=5,
                                        named=new.state_dict().items(), version=1)
        assert engine.version == 1
    assert [s.prompt_ids for s in samples] == [p for p in PROMPTS for _ in range(2)]  # prompt-major, n each
    for s in samples[:4]:  # the first 4 requests ran from step 0: 5 old tokens (fewer if they stopped), then new
        k = min(5, s.response_length)
        assert s.token_versions() == [0] * k + [1] * (s.response_length - k)
    assert any(s.spans_versions for s in samples[:4])
    assert all(set(s.token_versions()) == {1} for s in samples[4:])
    for s in samples:
        assert s.weight_version == min(s.token_versions())
        assert all(t in r for t, r in zip(s.response_ids, s.candidates.to_lists(), strict=True))
        assert not s.candidates.ids.is_inference()  # ordinary tensors: training may save them
        _check_exact(s, {0: old, 1: new}, PARAMS)


def _old_kv_recomputation(old, new, sample: Sample, params: SamplingParams) -> torch.Tensor:
    """Renormalised log-probs of the tokens sampled after the update by a request that kept its cache: HF's
    forward of the old weights over the tokens fed before the update (a DynamicCache), then the new weights' over
    the rest with that cache (an independent implementation of what "keep" computes)."""
    versions = sample.token_versions()
    before = versions.count(0)
    fed = sample.prompt_ids + sample.response_ids[:-1]
    split = len(sample.prompt_ids) + before - 1  # cache positions filled at the update
    cache = DynamicCache()
    with torch.no_grad():
        old(input_ids=torch.tensor([fed[:split]]), use_cache=True, cache=cache)
        rows = new(input_ids=torch.tensor([fed[split:]]), use_cache=True, cache=cache).logits[0].float()
    tokens = torch.tensor(sample.response_ids[before:])
    cands = sampling_candidates(rows, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                min_p=params.min_p)
    return token_logprobs(rows, tokens, cands=cands, temperature=params.temperature)


def test_kept_cache_records_what_sampled_and_departs_from_the_new_weights():
    """kv_at_update=keep: the tokens after the update equal a recomputation with the old weights' keys /
    values before it and the new weights' after (within TOL), and depart from the new weights' dense forward
    (by more than 10 x TOL on average), which recompute mode's tokens match (previous test)."""
    old = _model()
    new = _perturbed(old, scale=0.05)
    with _continuous(old, kv_at_update="keep") as engine:
        samples = _generate_with_update(engine, PROMPTS, PARAMS, seed=3, at_step=5,
                                        named=new.state_dict().items(), version=1)
    spanning = [s for s in samples if s.spans_versions]
    assert spanning
    departures = []
    for s in spanning:
        after = torch.tensor(s.token_versions()) == 1
        recorded = torch.tensor(s.rollout_log_probs)[after]
        torch.testing.assert_close(recorded, _old_kv_recomputation(old, new, s, PARAMS), atol=TOL, rtol=0)
        _, dense_new, _ = _dense(new, s, PARAMS)
        departures.append((recorded - dense_new[after]).abs())
    assert torch.cat(departures).mean() > 10 * TOL
    for s in samples:  # requests admitted after the update prefilled under the new weights: exact
        if not s.spans_versions:
            _check_exact(s, {0: old, 1: new}, PARAMS)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_greedy_tokens_equal_static_batching(family):
    """top_k=1: one kept token per step, so both modes must emit the same tokens; raw log-probs within TOL."""
    model = _model(family=family)
    params = SamplingParams(top_k=1, max_new_tokens=12, n=2)
    static = EmbeddedEngine(model, eos_token_id=2, record_raw_log_probs=True, progress=False, max_batch_size=3)
    with _continuous(model, max_batch_size=3) as engine:
        got = engine.generate(PROMPTS, params, seed=0)
    want = static.generate(PROMPTS, params, seed=0)
    for a, b in zip(got, want, strict=True):
        assert a.response_ids == b.response_ids and a.status == b.status
        torch.testing.assert_close(torch.tensor(a.rollout_raw_log_probs), torch.tensor(b.rollout_raw_log_probs),
                                   atol=TOL, rtol=0)


def _hold_until_queued(engine, requests: int) -> None:
    """Hold the loop at its first boundary until `requests` requests wait (all calls submitted)."""
    _hold(engine, {0: lambda loop: len(loop.waiting) >= requests})


def test_same_tokens_alone_and_beside_another_call():
    """A call's requests draw from their own seeded streams: alone, or sharing the decode batch with another
    call's requests (other rows, other batch sizes), it samples the same tokens and sets; log-probs differ by
    float rounding of batched matmuls only (measured 0 here)."""
    model = _model()
    other = [[1, 60, 61], [1, 70, 71, 72, 73]]
    with _continuous(model) as engine:
        alone = engine.generate(PROMPTS, PARAMS, seed=9)
    with _continuous(model) as engine:
        _hold_until_queued(engine, 2 * (len(PROMPTS) + len(other)))
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(engine.generate, other, PARAMS, seed=1)
            beside = pool.submit(engine.generate, PROMPTS, PARAMS, seed=9)
            beside, first = beside.result(WAIT), first.result(WAIT)
    assert len(first) == 2 * len(other)
    for a, b in zip(alone, beside, strict=True):
        assert a.response_ids == b.response_ids and a.candidates == b.candidates
        torch.testing.assert_close(torch.tensor(a.rollout_log_probs), torch.tensor(b.rollout_log_probs),
                                   atol=TOL, rtol=0)
    with _continuous(model) as engine:  # the seed decides: another one samples otherwise
        assert [s.response_ids for s in engine.generate(PROMPTS, PARAMS, seed=10)] != [s.response_ids for s in alone]


def test_request_seed_rule():
    """SplitMix64 outputs (reference values of the published algorithm, seed 0: 0xE220A8397B1DCDAF, ...),
    shifted to 63 bits; distinct per request."""
    assert request_seed(0, 0) == 0xE220A8397B1DCDAF >> 1
    assert request_seed(0, 1) == 0x6E789E6AA1B965F4 >> 1
    assert len({request_seed(7, k) for k in range(1000)}) == 1000


def test_decode_batch_stays_full_on_a_long_tail():
    """Responses of very different lengths (stop ids end many early): every decode step runs on all 4 rows while
    requests wait, the counters count every sampled token once, and the mean decode batch size beats static
    batching's on the same work."""
    model = _model()
    params = SamplingParams(top_p=0.95, max_new_tokens=24, n=6, stop_token_ids=tuple(range(3, 12)))
    seen = []  # per step: (rows decoded, requests still waiting)
    step = fused_decode.SlotCacheForward.step
    with pytest.MonkeyPatch.context() as mp, _continuous(model) as engine:
        mp.setattr(fused_decode.SlotCacheForward, "step",
                   lambda cache, ids: seen.append((ids.shape[0], len(engine.loop.waiting))) or step(cache, ids))
        samples = engine.generate(PROMPTS, params, seed=2)
        counts = engine.decode_counts
    lengths = [s.response_length for s in samples]
    assert max(lengths) >= 4 * min(lengths)  # a long tail
    assert counts.rows == sum(n for n, _ in seen) == sum(lengths) and counts.steps == len(seen)
    waited = [n for n, waiting in seen if waiting]
    assert len(waited) >= 10 and set(waited) == {4}
    static = EmbeddedEngine(model, eos_token_id=2, progress=False, max_batch_size=4)
    static_lengths = [s.response_length for s in static.generate(PROMPTS, params, seed=2)]
    assert static.decode_counts.rows == sum(static_lengths)
    assert counts.mean_batch_size > static.decode_counts.mean_batch_size


def test_cache_grows_for_a_longer_request_while_others_run():
    """A long request admitted while a short one runs: the cache grows (its filled rows copied) and both
    continue exactly (greedy: the static engine's tokens)."""
    model = _model()
    short, long = [[1, 5, 6]], [[1] + list(range(10, 50))]
    a, b = SamplingParams(top_k=1, max_new_tokens=16), SamplingParams(top_k=1, max_new_tokens=8)
    capacities = []  # read on the loop's thread at two boundaries
    with _continuous(model, eos_token_id=[], max_batch_size=2) as engine:
        reached = _hold(engine, {3: lambda loop: capacities.append(loop.cache.capacity) or bool(loop.waiting),
                                 5: lambda loop: capacities.append(loop.cache.capacity) or True})
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(engine.generate, short, a, seed=0)
            assert reached[3].wait(WAIT)
            second = pool.submit(engine.generate, long, b, seed=0)
            got = first.result(WAIT) + second.result(WAIT)
        with engine.loop.cond:  # idle (parked with nothing to run): its cache freed
            assert engine.loop.cond.wait_for(lambda: engine.loop.parked, timeout=WAIT)
            assert engine.loop.cache is None
    assert capacities[0] == 3 + 16 - 1 and capacities[-1] == 41 + 8 - 1  # max(need 48, 2 x 18 = 36)
    static = EmbeddedEngine(model, eos_token_id=[], progress=False)
    want = static.generate(short, a, seed=0) + static.generate(long, b, seed=0)
    assert [s.response_ids for s in got] == [s.response_ids for s in want]


def test_versions_start_and_plain_update():
    """start_version stamps the tokens sampled before the next update; a plain update_weights is version + 1
    (at once while the loop idles); a call with one version records no per-token list."""
    old = _model()
    new = _perturbed(old)
    params = SamplingParams(top_p=0.9, max_new_tokens=6)
    with _continuous(old) as engine:
        engine.start_version(5)
        first = engine.generate(PROMPTS, params, seed=0)
        engine.update_weights(new.state_dict().items())
        second = engine.generate(PROMPTS, params, seed=0)
    assert {s.weight_version for s in first} == {5} and all(s.weight_versions is None for s in first)
    assert {s.weight_version for s in second} == {6}
    for s in second:
        _check_exact(s, {6: new}, params)


def test_static_engine_takes_no_in_flight_updates():
    static = EmbeddedEngine(_model(), progress=False)
    assert not isinstance(static, InFlightUpdates) and static.batching == "static"
    with _continuous(_model()) as engine:
        assert isinstance(engine, InFlightUpdates)


def test_close_joins_the_thread_and_fails_a_waiting_call():
    model = _model()
    engine = _continuous(model)
    engine.generate(PROMPTS[:1], PARAMS, seed=0)
    thread = engine.loop.thread
    assert thread.is_alive() and thread.daemon
    engine.close()
    assert not thread.is_alive()
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="the engine is closed"):
        engine.generate(PROMPTS[:1], PARAMS, seed=0)

    engine = _continuous(model)
    loop, reached = engine.loop, _hold(engine, {2: lambda loop: loop.closed})
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(engine.generate, PROMPTS, PARAMS, seed=0)
        assert reached[2].wait(WAIT)
        engine.close()
        with pytest.raises(RuntimeError, match="closed while this generate call ran"):
            call.result(WAIT)
    assert not loop.thread.is_alive()


def test_an_error_in_the_loop_reaches_every_caller_and_the_next_call_runs():
    """NaN weights: sampling raises in the loop; both concurrent callers get the error; after good weights the
    next call starts a new loop thread."""
    model = _model()
    broken = {name: torch.full_like(t, float("nan")) for name, t in model.state_dict().items()}
    with _continuous(model) as engine:
        engine.update_weights(broken.items())
        _hold_until_queued(engine, 2 * len(PROMPTS))
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(engine.generate, PROMPTS[:2], PARAMS, seed=s) for s in (0, 1)]
            for call in calls:
                with pytest.raises(ValueError, match="is not finite"):
                    call.result(WAIT)
        engine.loop.boundary_hook = None
        engine.update_weights(model.state_dict().items())
        samples = engine.generate(PROMPTS[:2], PARAMS, seed=0)
    assert len(samples) == 4 and all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) for s in samples)


def test_bad_options_are_refused():
    model = _model()
    with pytest.raises(ValueError, match=r"batching \('dynamic'\) must be one of 'static', 'continuous'"):
        EmbeddedEngine(model, batching="dynamic")
    with pytest.raises(ValueError, match=r"kv_at_update \('drop'\) must be one of 'recompute', 'keep'"):
        EmbeddedEngine(model, batching="continuous", kv_at_update="drop")
    with pytest.raises(ValueError, match="kv_at_update='keep' applies to .* need batching='continuous'"):
        EmbeddedEngine(model, kv_at_update="keep")
    with pytest.raises(ValueError, match="needs the engine's own copy of the weights \\(share_weights=false\\)"):
        EmbeddedEngine(model, batching="continuous", share_weights=True)
    with pytest.raises(ValueError, match="fused decode path, which cannot run .*decode='hf' asked.*batching='static'"):
        EmbeddedEngine(model, batching="continuous", decode="hf")
    with pytest.raises(ValueError, match="cannot run Qwen3MoeForCausalLM .*not one of.*batching='static'"):
        EmbeddedEngine(_model(family="qwen3_moe"), batching="continuous")
    with _continuous(model) as engine:
        with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
            engine.generate([[1] * 30], SamplingParams(max_new_tokens=1000))
        with pytest.raises(ValueError, match="'nope' is not a parameter"):
            engine.update_weights_in_flight([("nope", torch.zeros(1))], version=1)
        assert engine.version == 0


@pytest.mark.gpu
def test_update_in_flight_exact_on_cuda():
    """The loop on a CUDA model: an update after step 5, every token against the dense recomputation on the CPU
    under its version's weights (tolerance 1e-4 as the static engine's CUDA test: other kernels)."""
    old = _model()
    new = _perturbed(old)
    with _continuous(old.cuda()) as engine:
        samples = _generate_with_update(engine, PROMPTS, PARAMS, seed=3, at_step=5,
                                        named=new.state_dict().items(), version=1)
    old, new = old.cpu(), new.cpu()
    assert any(s.spans_versions for s in samples)
    for s in samples:
        for version, model in ((0, old), (1, new)):
            mine = torch.tensor(s.token_versions()) == version
            if mine.any():
                _, masked, _ = _dense(model, s, PARAMS)
                torch.testing.assert_close(torch.tensor(s.rollout_log_probs)[mine], masked[mine], atol=1e-4, rtol=0)


def test_concurrent_calls_across_two_updates_are_exact():
    """Three calls sharing 4 rows, updates landing after decode steps 4 and 9: every token of every call records
    the version that sampled it (non-decreasing along each response, all three versions seen, some responses
    spanning two updates) and equals the dense recomputation under that version's weights."""
    models = {0: _model()}
    models[1] = _perturbed(models[0], seed=1)
    models[2] = _perturbed(models[1], seed=2)
    calls = [(PROMPTS[:2], 5), (PROMPTS[2:], 6), ([[1, 60, 61]], 7)]
    with _continuous(models[0]) as engine:
        queued = 2 * sum(len(p) for p, _ in calls)
        reached = _hold(engine, {0: lambda loop: len(loop.waiting) >= queued, 4: _update_requested,
                                 9: _update_requested})
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = [pool.submit(engine.generate, prompts, PARAMS, seed=seed) for prompts, seed in calls]
            for step, version in ((4, 1), (9, 2)):
                assert reached[step].wait(WAIT)
                engine.update_weights_in_flight(models[version].state_dict().items(), version=version)
            samples = [s for f in futures for s in f.result(WAIT)]
    versions = [s.token_versions() for s in samples]
    assert all(v == sorted(v) for v in versions)
    assert set().union(*map(set, versions)) == {0, 1, 2} and any(v[0] == 0 and v[-1] == 2 for v in versions)
    for s in samples:
        _check_exact(s, models, PARAMS)
