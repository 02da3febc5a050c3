"""The vLLM codec without a server (`topp_rl.engines.vllm.protocol`): the request body, kept sets read from
hand-written answers in vLLM 0.32's shape (the sampled token first, -inf as -9999), the overflow rule, the refused
parameters; and the engine's start-time refusals that need no server."""

import pytest

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import SampleStatus
from topp_rl.engines.vllm import protocol
from topp_rl.engines.vllm.engine import VLLMEngine, check_cpu_head_size, check_kept_sets, choose_kept_sets
from topp_rl.models import build_tiny_model

PARAMS = SamplingParams(top_p=0.9, top_k=3, max_new_tokens=2)


def entry(token_id: int, logprob: float, rank: int) -> dict:
    return {"token_id": token_id, "logprob": logprob, "rank": rank}


def answer(tokens, tops, *, reason="length", spans=None) -> dict:
    """An /inference/v1/generate answer: per token the sampled entry first, then the top entries."""
    content = [{**top[0], "top_logprobs": top} for top in tops]
    assert [c["token_id"] for c in content] == tokens
    return {"request_id": "r1", "choices": [{"finish_reason": reason, "token_ids": tokens, "logprobs":
            {"content": content}, "weight_versions": spans}]}  # fmt: skip


def test_payload_asks_top_k_plus_one_processed_log_probs_and_a_per_sample_seed():
    body = protocol.payload([1, 2], PARAMS, seed=5, index=2)
    assert body["token_ids"] == [1, 2] and body["output_mode"] == "tokens"
    sp = body["sampling_params"]
    assert (sp["top_k"], sp["top_p"], sp["logprobs"], sp["max_tokens"], sp["n"]) == (3, 0.9, 4, 2, 1)
    assert sp["seed"] == 5 * protocol.SEED_STRIDE + 2
    untruncated = protocol.payload([1], SamplingParams(), seed=None, index=0)["sampling_params"]
    assert untruncated["logprobs"] == 0 and untruncated["top_k"] == -1 and "seed" not in untruncated


def test_extra_sampling_params_reach_the_request_but_never_override_what_the_sets_rely_on():
    extra = protocol.check_extra({"ignore_eos": True})
    assert protocol.payload([1], PARAMS, seed=None, index=0, extra=extra)["sampling_params"]["ignore_eos"] is True
    with pytest.raises(ValueError, match=r"extra_sampling_params sets \['logprobs', 'top_k'\], which the engine "
                       r"derives from SamplingParams"):
        protocol.check_extra({"top_k": 5, "logprobs": 1, "ignore_eos": True})


def test_kept_sets_are_the_finite_entries_in_rank_order():
    # token 7 sampled at rank 2 (listed first, then the top 4 without it); token 9 sampled at rank 1 (deduplicated)
    out = answer([7, 9], [
        [entry(7, -1.2, 2), entry(4, -0.4, 1), entry(3, -2.5, 3), entry(8, -9999.0, 4)],
        [entry(9, -0.1, 1), entry(2, -9999.0, 2), entry(5, -9999.0, 3), entry(6, -9999.0, 4)],
    ], spans=[{"version": "default", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}])
    sample = protocol.Codec(vocab_size=16, start_version=3).sample([1], out, PARAMS)
    assert sample.status is SampleStatus.TRUNCATED and sample.response_ids == [7, 9]
    assert sample.rollout_log_probs == [-1.2, -0.1]
    assert sample.candidates.ids.tolist() == [4, 7, 3, 9] and sample.candidates.offsets.tolist() == [0, 3, 4]
    assert sample.token_versions() == [3, 4]  # "default" is the version the engine started from


def test_a_set_that_fills_the_top_k_plus_one_list_aborts_the_sample_naming_why():
    out = answer([7], [[entry(7, -1.3, 1), entry(4, -1.3, 2), entry(3, -1.4, 3), entry(8, -1.4, 4)]])
    sample = protocol.Codec(vocab_size=16).sample([1], out, PARAMS)
    assert sample.status is SampleStatus.ABORTED and sample.metadata["candidate_overflow"] is True
    assert sample.response_ids == [] and "response token 0 holds more than top_k=3 ids" in \
        sample.metadata["finish_reason"]["message"]


def test_a_sampled_token_outside_its_finite_entries_is_an_error():
    out = answer([7], [[entry(7, -9999.0, 4), entry(4, -0.1, 1), entry(3, -2.5, 2), entry(8, -9999.0, 3),
                        entry(5, -9999.0, 4)]])
    with pytest.raises(RuntimeError, match="sampled token 7 at response position 0 is not among its kept ids"):
        protocol.Codec(vocab_size=16).sample([1], out, PARAMS)


def test_an_aborted_answer_is_an_empty_aborted_sample():
    out = {"request_id": "r", "choices": [{"finish_reason": "abort", "token_ids": [3], "logprobs": None}]}
    sample = protocol.Codec(vocab_size=16).sample([1], out, PARAMS)
    assert sample.status is SampleStatus.ABORTED and sample.response_ids == []
    assert sample.metadata["candidate_overflow"] is False


def test_untruncated_answers_record_no_sets():
    out = answer([7], [[entry(7, -2.0, 3)]], reason="stop")
    sample = protocol.Codec(vocab_size=16).sample([1], out, SamplingParams())
    assert sample.status is SampleStatus.COMPLETED and sample.candidates is None and sample.rollout_log_probs == [-2.0]


@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(top_p=0.9), r"needs 0 < top_k <= max_candidates \(64\), got top_k=0.*rollout=sglang"),
    (SamplingParams(min_p=0.1), r"needs 0 < top_k <= max_candidates \(64\), got top_k=0"),
    (SamplingParams(top_p=0.9, top_k=65), r"got top_k=65"),
    (SamplingParams(top_k=16), r"top_k=16 must be below the vocabulary size \(16\)"),
])
def test_sampling_the_log_probs_cannot_show_is_refused(params, message):
    with pytest.raises(ValueError, match=message):
        protocol.check_params(params, max_candidates=64, vocab_size=16 if params.top_k == 16 else 512)


def test_greedy_top_k_and_untruncated_sampling_are_accepted():
    for params in (SamplingParams(top_k=1), SamplingParams(top_k=20, min_p=0.1), SamplingParams(temperature=0.7)):
        protocol.check_params(params, max_candidates=64, vocab_size=512)


def test_start_refusals_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="needs model_path= .* or urls="):
        VLLMEngine()
    with pytest.raises(ValueError, match="needs vocab_size= or model_path="):
        VLLMEngine(urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="server_kwargs.device='cuda': the engine launches CPU servers only"):
        VLLMEngine(model_path=tmp_path, vocab_size=8, server_kwargs={"device": "cuda"})
    with pytest.raises(ValueError, match="server_kwargs.port=8000 with num_servers=2: servers need ports of their own"):
        VLLMEngine(model_path=tmp_path, vocab_size=8, num_servers=2, server_kwargs={"port": 8000})
    with pytest.raises(ValueError, match=r"num_servers=2: .*with urls= the servers are the 1 given"):
        VLLMEngine(urls=["http://127.0.0.1:1"], vocab_size=8, num_servers=2)
    with pytest.raises(ValueError, match="head sizes .*this model's is 16.*model.heads=2 model.kv_heads=1"):
        check_cpu_head_size(build_tiny_model("qwen2").config)  # hidden 64 / 4 heads
    check_cpu_head_size(build_tiny_model("qwen2", heads=2, kv_heads=1).config)
    model = build_tiny_model("qwen3_moe", seed=0)
    with pytest.raises(ValueError, match="record_routes=true with an MoE model and rollout=vllm"):
        VLLMEngine.for_policy(model=model, tokenizer=None, workdir=tmp_path, record_routes=True)
    with pytest.raises(ValueError, match="share_weights=true"):
        VLLMEngine.for_policy(model=model, tokenizer=None, workdir=tmp_path, share_weights=True)


def native_answer(tokens, sampled_logprobs, mask) -> dict:
    """An answer of a --return-sampling-mask server: the sampled log-prob only, the kept ids in `sampling_mask`."""
    content = [{**entry(t, lp, 1), "top_logprobs": [entry(t, lp, 1)]} for t, lp in zip(tokens, sampled_logprobs, strict=True)]
    return {"request_id": "r2", "choices": [{"finish_reason": "stop", "token_ids": tokens, "logprobs": {"content": content},
            "sampling_mask": mask, "weight_versions": None}]}  # fmt: skip


def test_native_masks_are_the_sets_and_the_request_asks_only_the_sampled_log_prob():
    body = protocol.payload([1], PARAMS, seed=None, index=0, native_masks=True)["sampling_params"]
    assert (body["logprobs"], body["top_k"]) == (0, 3)
    codec = protocol.Codec(vocab_size=16, native_masks=True, max_candidates=4)
    sample = codec.sample([1], native_answer([7, 9], [-0.7, -0.05], [[4, 7, 3, 2], [9]]), PARAMS)
    assert sample.status is SampleStatus.COMPLETED and sample.rollout_log_probs == [-0.7, -0.05]
    assert sample.candidates.ids.tolist() == [4, 7, 3, 2, 9] and sample.candidates.offsets.tolist() == [0, 4, 5]
    # ties may make a native set larger than top_k; above max_candidates it is aborted as an overflow, never cut
    big = protocol.Codec(vocab_size=16, native_masks=True, max_candidates=3).sample(
        [1], native_answer([7], [-0.7], [[4, 7, 3, 2]]), PARAMS)
    assert big.status is SampleStatus.ABORTED and big.metadata["candidate_overflow"]
    assert "holds 4 ids, above rollout.max_candidates=3" in big.metadata["finish_reason"]["message"]
    with pytest.raises(RuntimeError, match="sampling_mask=None for 1 output tokens; .*--return-sampling-mask"):
        codec.sample([1], native_answer([7], [-0.7], None), PARAMS)
    with pytest.raises(RuntimeError, match="sampled token 7 at response position 0 is not among its kept ids"):
        codec.sample([1], native_answer([7], [-0.7], [[4, 3]]), PARAMS)


def test_native_mask_servers_refuse_unbounded_sampling_before_any_request():
    for params in (SamplingParams(top_p=1.0), SamplingParams(top_p=0.9, top_k=100)):
        with pytest.raises(ValueError, match=f"top_k={params.top_k}: .* serves only 0 < top_k <= max_candidates"):
            protocol.check_params(params, max_candidates=64, vocab_size=512, native_masks=True)
    protocol.check_params(SamplingParams(top_k=5), max_candidates=64, vocab_size=512, native_masks=True)


def test_the_kept_set_route_is_chosen_from_what_every_server_answers():
    both, neither = {"a": True, "b": True}, {"a": False, "b": False}
    assert choose_kept_sets("auto", both) and not choose_kept_sets("auto", neither)
    assert choose_kept_sets("native", both) and not choose_kept_sets("logprobs", both)
    with pytest.raises(ValueError, match=r"kept_sets=native, but the vLLM servers \['a', 'b'\] return no sampling"):
        choose_kept_sets("native", neither)
    with pytest.raises(ValueError, match=r"servers \['a'\] return native sampling masks and \['b'\] do not"):
        choose_kept_sets("auto", {"a": True, "b": False})
    with pytest.raises(ValueError, match="kept_sets=native with a launched server: .*CPU build"):
        check_kept_sets("native", launched=True)
    with pytest.raises(ValueError, match="kept_sets='mask': choose one of auto, native, logprobs"):
        check_kept_sets("mask", launched=False)
