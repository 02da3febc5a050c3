"""`Sample` and `SamplingParams`: multi-turn appends, strict length checks, parameter validation."""

import pytest
import torch

from topp_rl.ops import Candidates
from topp_rl.rollout import Sample, SampleStatus, SamplingParams


def test_starts_empty():
    s = Sample(prompt_ids=[1, 2])
    assert s.response_length == 0 and s.candidates is None and s.status is SampleStatus.COMPLETED
    assert s.tokens == [1, 2]


def test_multi_turn_with_tool_output():
    s = Sample(prompt_ids=[1], index=4)
    s.append_response_tokens([5, 6], [-0.5, -0.25], Candidates.from_lists([[5, 2], [6]]))
    s.append_response_tokens([9, 9, 9], trainable=False)
    s.append_response_tokens([7], [-1.0], Candidates.from_lists([[7, 8, 3]]))
    assert s.response_ids == [5, 6, 9, 9, 9, 7]
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert s.candidates.to_lists() == [[5, 2], [6], [], [], [], [7, 8, 3]]
    assert s.candidates.offsets.tolist() == [0, 2, 3, 3, 3, 3, 6]


def test_tool_output_first_then_candidates_backfills_empty_rows():
    s = Sample(prompt_ids=[1])
    s.append_response_tokens([3], trainable=False)
    s.append_response_tokens([4], [-0.1], Candidates.from_lists([[4]]), raw_log_probs=[-2.0])
    assert s.candidates.to_lists() == [[], [4]]
    assert s.rollout_raw_log_probs == [0.0, -2.0]


def test_run_without_candidates():
    s = Sample(prompt_ids=[1])
    s.append_response_tokens([3, 4], [-0.1, -0.2])
    s.append_response_tokens([5], trainable=False)
    assert s.candidates is None and s.loss_mask == [1, 1, 0]


@pytest.mark.parametrize(
    ("setup", "call", "message"),
    [
        (
            None,
            lambda s: s.append_response_tokens([3, 4], [-0.1]),
            "2 trainable tokens need 2 log_probs, got 1",
        ),
        (None, lambda s: s.append_response_tokens([3]), "need 1 log_probs, got None"),
        (
            None,
            lambda s: s.append_response_tokens([3], [-0.1], trainable=False),
            "non-trainable tokens must not",
        ),
        (
            None,
            lambda s: s.append_response_tokens([3, 4], [-0.1, -0.2], Candidates.from_lists([[3]])),
            "2 tokens but candidates have 1 rows",
        ),
        (
            None,
            lambda s: s.append_response_tokens([3], [-0.1], Candidates.from_lists([[2, 5]])),
            "sampled token 3 at chunk position 0 is missing",
        ),
        (
            lambda s: s.append_response_tokens([3], [-0.1], Candidates.from_lists([[3]])),
            lambda s: s.append_response_tokens([4], [-0.1]),
            "records candidate sets",
        ),
        (
            lambda s: s.append_response_tokens([3], [-0.1]),
            lambda s: s.append_response_tokens([4], [-0.1], Candidates.from_lists([[4]])),
            "earlier trainable tokens have no candidate sets",
        ),
    ],
)
def test_append_errors_name_the_sample(setup, call, message):
    s = Sample(prompt_ids=[1], index=7, group_index=2)
    if setup:
        setup(s)
    before = s.response_length
    with pytest.raises(ValueError, match=message) as err:
        call(s)
    assert "Sample(index=7, group=2)" in str(err.value)
    assert s.response_length == before  # a rejected append changes nothing


def test_constructor_length_mismatch():
    with pytest.raises(
        ValueError, match=r"Sample\(index=3, group=0\): response_length=2 but rollout_log_probs=1"
    ):
        Sample(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1], rollout_log_probs=[0.0], index=3)
    with pytest.raises(ValueError, match="candidates rows=1"):
        Sample(
            prompt_ids=[1],
            response_ids=[2, 3],
            loss_mask=[1, 1],
            rollout_log_probs=[0.0, 0.0],
            candidates=Candidates.from_lists([[2]]),
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # The same rule texts as the ops (`topp_rl.ops.SAMPLING_RULES`: one definition).
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]; use top_p=1.0"),
        ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
        ({"temperature": 0.0}, r"temperature=0.0 must be finite and >= 1e-06"),
        ({"temperature": 1e-45}, r"temperature=1e-45 must be finite and >= 1e-06 \(smaller values overflow"),
        ({"top_k": -1}, r"top_k=-1 must be an integer >= 0"),
        ({"top_k": True}, r"top_k=True must be an integer >= 0"),
        ({"top_p": "abc"}, r"top_p='abc' must be a number in \(0, 1\]"),
        ({"min_p": 1.0}, r"min_p=1.0 must be in \[0, 1\)"),
        ({"n": 0}, r"n=0 must be an integer >= 1"),
        ({"max_new_tokens": 0}, r"max_new_tokens=0 must be an integer >= 1"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_truncates():
    p = SamplingParams(stop_token_ids=[3, 4])
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.n) == (1.0, 1.0, 0, 0.0, 1)
    assert p.stop_token_ids == (3, 4) and not p.truncates
    assert SamplingParams(top_p=0.9).truncates and SamplingParams(top_k=5).truncates
    assert SamplingParams(min_p=0.1).truncates


def test_samples_survive_a_checkpoint_read_with_the_safe_loader(tmp_path):
    """The rollout in flight under overlap travels in the checkpoint as lists and tensors: torch's
    `weights_only=True` loader reads it back, every field equal (log-probs bit for bit)."""
    import io

    from topp_rl.engines.embedded import EmbeddedEngine
    from topp_rl.models import build_tiny_model
    from topp_rl.rollout import SamplingParams
    from topp_rl.rollout.broadcast import samples_from_state, samples_to_state

    engine = EmbeddedEngine(build_tiny_model(vocab_size=96, seed=0), progress=False)
    samples = engine.generate([[1, 5, 6], [1, 7]], SamplingParams(top_p=0.9, max_new_tokens=5, n=2), seed=3)
    samples[1].status, samples[1].metadata = SampleStatus.ABORTED, {"finish_reason": {"type": "abort"}}
    samples[2].weight_version = 4
    samples[3].set_token_versions([2] * 2 + [3] * (samples[3].response_length - 2))  # spans an update
    assert samples[3].spans_versions
    buffer = io.BytesIO()
    torch.save({"in_flight": samples_to_state(samples)}, buffer)
    buffer.seek(0)
    back = samples_from_state(torch.load(buffer, weights_only=True)["in_flight"])
    fields = ("prompt_ids", "response_ids", "loss_mask", "rollout_log_probs", "rollout_raw_log_probs", "reward",
              "group_index", "index", "status", "metadata", "weight_version", "weight_versions")
    for a, b in zip(samples, back, strict=True):
        assert all(getattr(a, f) == getattr(b, f) for f in fields)
        assert torch.equal(a.candidates.ids, b.candidates.ids) and torch.equal(a.candidates.offsets, b.candidates.offsets)


def test_per_token_weight_versions_grow_with_the_tokens():
    """A response that spans weight updates records the version of every token; `weight_version` is the oldest,
    and a list of one version collapses to None (every token by `weight_version`)."""
    s = Sample(prompt_ids=[1], weight_version=5)
    s.append_response_tokens([2, 3], [-0.1, -0.2])
    assert s.weight_versions is None and s.token_versions() == [5, 5] and not s.spans_versions
    s.append_response_tokens([4], [-0.3], versions=[6])  # the next turn, after an update
    assert s.token_versions() == [5, 5, 6] and s.weight_version == 5 and s.spans_versions
    s.append_response_tokens([7, 8], trainable=False)  # tool output: the newest version so far
    assert s.token_versions() == [5, 5, 6, 6, 6]
    fresh = Sample(prompt_ids=[1])
    fresh.append_response_tokens([2, 3], [-0.1, -0.2], versions=[3, 3])
    assert fresh.weight_version == 3 and fresh.weight_versions is None
    with pytest.raises(ValueError, match=r"2 tokens but 1 weight versions"):
        fresh.append_response_tokens([4, 5], [-0.1, -0.2], versions=[4])
    with pytest.raises(ValueError, match=r"1 weight versions for 2 response tokens; record one per token"):
        fresh.set_token_versions([1])
    with pytest.raises(ValueError, match=r"weight_versions=1"):
        Sample(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0],
               weight_versions=[1])


def test_samples_are_numbered_in_one_place_step_global_and_prompt_major():
    """Engines return n samples per prompt, prompt-major, unnumbered; the pipeline numbers them once."""
    from topp_rl.data import number_samples

    samples = [Sample(prompt_ids=[p]) for p in (5, 5, 5, 6, 6, 6)]
    assert number_samples(samples, prompts=2, n=3, first_group=4) is samples
    assert [(s.group_index, s.index) for s in samples] == [(4, 12), (4, 13), (4, 14), (5, 15), (5, 16), (5, 17)]
    with pytest.raises(ValueError, match=r"^engine returned 5 samples for 2 prompts x n=3; a RolloutEngine "):
        number_samples(samples[:5], prompts=2, n=3)
