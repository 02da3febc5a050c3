"""EmbeddedEngine against a fresh, cache-free forward of the same model: recorded sets and log-probs are exact."""

import pytest
import torch
from oracles import sglang_keep_mask

from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_tiny_model
from topp_rl.ops import Candidates, sampling_candidates
from topp_rl.ops.draw import draw_from_sets
from topp_rl.rollout import SampleStatus, SamplingParams

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 20], [1, 30, 31, 32]]


def _model(family: str = "qwen2", seed: int = 0):
    # initializer_range 0.2 gives peaked random logits, so candidate sets vary in size (not near-uniform).
    return build_tiny_model(family, vocab_size=96, seed=seed, initializer_range=0.2)


def _replay(model, sample, params: SamplingParams):
    """Candidate lists, renormalised and raw log-probs of the response, from one full forward without cache."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    rows = logits[len(sample.prompt_ids) - 1 : -1]
    tokens = torch.tensor(sample.response_ids)
    cands = sampling_candidates(
        rows, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p
    )
    z = rows / params.temperature
    keep = torch.zeros_like(z, dtype=torch.bool)
    keep[cands.row_of_ids(), cands.ids.long()] = True
    masked = z.masked_fill(~keep, float("-inf")).log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    raw = z.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    return cands.to_lists(), masked, raw


@pytest.mark.parametrize("prompts", [PROMPTS, [p[:2] for p in PROMPTS]], ids=["left_padded", "no_padding"])
@pytest.mark.parametrize(
    ("family", "params"),
    [
        ("qwen2", SamplingParams(top_p=0.8, temperature=0.9, max_new_tokens=12, n=2)),
        ("llama", SamplingParams(top_p=0.9, top_k=40, min_p=0.05, temperature=1.1, max_new_tokens=12, n=2)),
    ],
)
def test_recorded_sets_and_log_probs_equal_fresh_forward(family, params, prompts):
    """Equal-length prompts take the no-attention-mask path of the decode loop; padded ones the mask views."""
    model = _model(family)
    engine = EmbeddedEngine(model, eos_token_id=2, record_raw_log_probs=True, progress=False)
    samples = engine.generate(prompts, params, seed=3)
    assert [s.prompt_ids for s in samples] == [p for p in prompts for _ in range(2)]  # prompt-major, n each
    sizes = []
    for s in samples:
        rows, masked, raw = _replay(model, s, params)
        recorded = s.candidates.to_lists()
        Candidates(ids=s.candidates.ids, offsets=s.candidates.offsets)  # the construction checks pass
        assert s.candidates.num_rows == s.response_length
        assert [sorted(r) for r in recorded] == [sorted(r) for r in rows]
        assert all(t in r for t, r in zip(s.response_ids, recorded, strict=True))
        torch.testing.assert_close(torch.tensor(s.rollout_log_probs), masked, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(s.rollout_raw_log_probs), raw, atol=1e-5, rtol=0)
        assert s.loss_mask == [1] * s.response_length
        # decoded in inference mode, handed out as ordinary tensors (training may save them for its backward)
        assert not (s.candidates.ids.is_inference() or s.candidates.offsets.is_inference())
        sizes += [len(r) for r in recorded]
    assert min(sizes) >= 1 and max(sizes) > min(sizes)  # the sets really vary: the check is not vacuous


def test_stops_status_and_determinism():
    model = _model(seed=1)
    engine = EmbeddedEngine(model, eos_token_id=2, progress=False)
    params = SamplingParams(top_p=0.9, max_new_tokens=6, n=4, stop_token_ids=tuple(range(3, 12)))
    samples = engine.generate(PROMPTS, params, seed=11)
    stops = {2, *params.stop_token_ids}
    statuses = {s.status for s in samples}
    assert statuses == {SampleStatus.COMPLETED, SampleStatus.TRUNCATED}
    for s in samples:
        assert not stops & set(s.response_ids[:-1])  # generation ends at the first stop id
        if s.status is SampleStatus.COMPLETED:
            assert s.response_ids[-1] in stops
        else:
            assert s.response_length == 6 and s.response_ids[-1] not in stops
    again = engine.generate(PROMPTS, params, seed=11)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]
    assert [s.rollout_log_probs for s in again] == [s.rollout_log_probs for s in samples]
    other = engine.generate(PROMPTS, params, seed=12)
    assert [s.response_ids for s in other] != [s.response_ids for s in samples]


def test_recording_off_draws_the_same_tokens_and_no_truncation_records_nothing():
    model = _model()
    params = SamplingParams(top_p=0.7, top_k=30, max_new_tokens=10, n=2)
    with (
        EmbeddedEngine(model, progress=False) as on,
        EmbeddedEngine(model, record_candidates=False, progress=False) as off,
    ):
        a, b = on.generate(PROMPTS, params, seed=5), off.generate(PROMPTS, params, seed=5)
        assert [s.response_ids for s in a] == [s.response_ids for s in b]
        assert [s.rollout_log_probs for s in a] == [s.rollout_log_probs for s in b]
        assert all(s.candidates is None for s in b) and all(s.candidates is not None for s in a)
        full = on.generate(PROMPTS, SamplingParams(max_new_tokens=5), seed=5)
    assert all(s.candidates is None for s in full)
    _, _, raw = _replay(model, full[0], SamplingParams())
    torch.testing.assert_close(torch.tensor(full[0].rollout_log_probs), raw, atol=1e-5, rtol=0)


def test_dense_keep_mask_equals_sampling_candidates():
    logits = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :4] = 5.0  # ties at the top: lower ids rank first
    for kwargs in [{"top_p": 0.6, "top_k": 0, "min_p": 0.0}, {"top_p": 0.95, "top_k": 7, "min_p": 0.05}]:
        keep = sglang_keep_mask(logits / 0.8, **kwargs)
        cands = sampling_candidates(logits, temperature=0.8, **kwargs)
        assert [sorted(r) for r in cands.to_lists()] == [row.nonzero().flatten().tolist() for row in keep]


def test_engine_owns_its_weights_until_update():
    train_model = _model()
    engine = EmbeddedEngine(train_model, progress=False)
    params = SamplingParams(top_p=0.9, max_new_tokens=8)
    before = engine.generate(PROMPTS, params, seed=0)
    with torch.no_grad():
        for p in train_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    unchanged = engine.generate(PROMPTS, params, seed=0)
    assert [s.rollout_log_probs for s in unchanged] == [s.rollout_log_probs for s in before]
    engine.update_weights(train_model.named_parameters())
    after = engine.generate(PROMPTS, params, seed=0)
    for s in after:
        _, masked, _ = _replay(train_model, s, params)
        torch.testing.assert_close(torch.tensor(s.rollout_log_probs), masked, atol=1e-5, rtol=0)
    assert [s.rollout_log_probs for s in after] != [s.rollout_log_probs for s in before]
    with pytest.raises(ValueError, match="'nope' is not a parameter"):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"has shape \(3,\), the engine expects"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_bad_prompts():
    engine = EmbeddedEngine(_model(), progress=False)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside the model vocabulary \[0, 96\)"):
        engine.generate([[1, 96]], SamplingParams())
    with pytest.raises(ValueError, match=r"= 1030 exceeds the model's max_position_embeddings \(1024\)"):
        engine.generate([[1] * 30], SamplingParams(max_new_tokens=1000))


@pytest.mark.gpu
def test_exact_on_cuda():
    params = SamplingParams(top_p=0.8, temperature=0.9, max_new_tokens=12, n=2)
    engine = EmbeddedEngine(_model().cuda(), eos_token_id=2, progress=False)
    reference = _model()  # same seed: the same weights, on the CPU
    for s in engine.generate(PROMPTS, params, seed=3):
        rows, masked, _ = _replay(reference, s, params)
        assert [sorted(r) for r in s.candidates.to_lists()] == [sorted(r) for r in rows]
        torch.testing.assert_close(torch.tensor(s.rollout_log_probs), masked, atol=1e-4, rtol=0)


def test_draw_from_sets_follows_the_renormalised_kept_distribution():
    """The set-only draw: each kept id at its renormalised probability, never a dropped one, and the log-prob
    of the drawn id equal to the dense oracle's log_softmax over the kept set."""
    base = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 2
    base[2, 5] = -200.0  # kept by top_k below, but exp underflows to 0 in float32: never drawn
    reps = 20_000
    logits = base.repeat_interleave(reps, 0)
    top_k = torch.tensor([0, 0, 40]).repeat_interleave(reps)
    top_p = torch.tensor([0.7, 0.95, 1.0]).repeat_interleave(reps)
    cands = sampling_candidates(logits, temperature=0.9, top_p=top_p, top_k=top_k)
    u = torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    tokens, log_probs = draw_from_sets(logits / 0.9, cands, u)

    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[cands.row_of_ids(), cands.ids.long()] = True
    dense = (logits / 0.9).masked_fill(~keep, float("-inf")).log_softmax(-1)
    assert bool(keep.gather(1, tokens[:, None]).all()), "a dropped id was drawn"
    torch.testing.assert_close(log_probs, dense.gather(1, tokens[:, None]).squeeze(1), atol=1e-6, rtol=0)
    assert not bool((tokens[2 * reps :] == 5).any())
    for r in range(3):
        freq = torch.bincount(tokens[r * reps : (r + 1) * reps], minlength=40).double() / reps
        prob = dense[r * reps].exp().double()
        sd = (prob * (1 - prob) / reps).sqrt()
        assert bool(((freq - prob).abs() <= 5 * sd + 1e-12).all()), (r, (freq - prob).abs().max())


def test_draw_from_sets_at_the_edges_of_u():
    """u = 0 draws each row's first id of positive mass, u -> 1 its last one (no spill into a neighbour row)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    cands = Candidates.from_lists([[2, 1, 0], [0, 3]])
    first, _ = draw_from_sets(logits, cands, torch.zeros(2, dtype=torch.float64))
    last, _ = draw_from_sets(logits, cands, torch.full((2,), 1 - 1e-16, dtype=torch.float64))
    assert first.tolist() == [2, 0] and last.tolist() == [0, 3]


def test_shared_engine_samples_with_the_live_module_and_leaves_its_flags():
    """share_weights=True: no copy (an optimizer-style in-place update is seen at once, update_weights from
    the same module copies nothing), generation in eval mode whatever the module's flags (here train mode with
    attention dropout, which would perturb every draw), and those flags and requires_grad left as they were."""
    params = SamplingParams(top_p=0.9, max_new_tokens=8)
    policy = _model()
    copied = EmbeddedEngine(policy, progress=False)
    shared = EmbeddedEngine(policy, share_weights=True, progress=False)
    assert shared.model is policy and all(p.requires_grad for p in policy.parameters())
    policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for attention in (m for m in policy.modules() if hasattr(m, "attention_dropout")):
        attention.attention_dropout = 0.5
    policy.train()
    flags = {name: m.training for name, m in policy.named_modules()}
    ref = copied.generate(PROMPTS, params, seed=0)
    got = shared.generate(PROMPTS, params, seed=0)
    assert [s.response_ids for s in got] == [s.response_ids for s in ref]
    assert [s.rollout_log_probs for s in got] == [s.rollout_log_probs for s in ref]
    assert {name: m.training for name, m in policy.named_modules()} == flags
    assert all(p.requires_grad for p in policy.parameters())

    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    pointers = [p.data_ptr() for p in policy.parameters()]
    shared.update_weights((n, p.detach()) for n, p in policy.named_parameters())  # a no-op: same tensors
    assert [p.data_ptr() for p in policy.parameters()] == pointers
    policy.eval()
    for s in shared.generate(PROMPTS, params, seed=0):
        _, masked, _ = _replay(policy, s, params)
        torch.testing.assert_close(torch.tensor(s.rollout_log_probs), masked, atol=1e-5, rtol=0)
