"""The SGLang /generate codec (`topp_rl.engines.sglang.protocol`) without a server: request bodies from
SamplingParams, and answers in the shape SGLang 0.5.23 returns them (recorded field by field from
tests/test_sglang.py's server) turned into Samples, with their candidate sets, status and overflow rules."""

import json

import pytest
import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import SampleStatus
from topp_rl.engines.serving.client import error_message, parse_answer
from topp_rl.engines.serving.wire import encode_candidates
from topp_rl.engines.sglang import SGLangEngine
from topp_rl.engines.sglang.protocol import (
    SEED_STRIDE,
    SGLANG_OVERFLOW,
    Codec,
    ServerOverflow,
    generate_answer,
    mask_cap,
    served_vocab,
    token_versions,
    vocab_probe_body,
)
from topp_rl.engines.sglang.weights import LOADED_NOT_FLUSHED, update_answer
from topp_rl.ops import Candidates

CODEC = Codec(vocab_size=100, max_candidates=4, b64=True)
URL = "http://127.0.0.1:30000"


def _cands(rows: list[list[int]]) -> Candidates:
    offsets = [0]
    for row in rows:
        offsets.append(offsets[-1] + len(row))
    return Candidates(
        ids=torch.tensor([i for row in rows for i in row], dtype=torch.int32),
        offsets=torch.tensor(offsets, dtype=torch.int32),
    )


def _answer(tokens, rows, *, reason="stop", b64=True, version="3"):
    """An SGLang /generate answer: output_token_logprobs are [logprob, token id, text] triples (text None with
    --skip-tokenizer-init), the renormalised log-probs one float per token, the mask compact or nested."""
    raw = [-0.5 * (k + 1) for k in range(len(tokens))]
    meta = {
        "finish_reason": {"type": reason} if reason else None,
        "weight_version": version,
        "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(raw, tokens, strict=True)],
        "output_token_sampling_logprobs": [lp / 2 for lp in raw],
    }
    if rows is not None:
        meta.update(encode_candidates(_cands(rows)) if b64 else {"output_token_sampling_mask": rows})
    return {"output_ids": tokens, "meta_info": meta}


def test_payload_carries_every_sampling_field():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=3, min_p=0.05, max_new_tokens=5,
                            stop_token_ids=[2, 7])  # fmt: skip
    body = CODEC.payload([1, 2, 3], params, seed=11, index=4)
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": 3, "min_p": 0.05, "max_new_tokens": 5,
                            "stop_token_ids": [2, 7]},  # no sampling_seed: SGLang's seeded sampler rejects min-p
        "return_logprob": True,
        "return_sampling_mask": True,
        "return_sampling_mask_b64": True,
    }  # fmt: skip
    nested = Codec(vocab_size=100, max_candidates=4, b64=False).payload([1], params, seed=None, index=0)
    assert nested["return_sampling_mask"] is True and "return_sampling_mask_b64" not in nested


def test_untruncated_request_asks_for_no_mask():
    body = CODEC.payload([5], SamplingParams(temperature=0.8, max_new_tokens=2), seed=None, index=0)
    assert body["sampling_params"]["top_k"] == -1  # SGLang's "no top-k"
    assert not {"return_sampling_mask", "return_sampling_mask_b64"} & body.keys()
    assert "sampling_seed" not in body["sampling_params"]


@pytest.mark.parametrize(
    ("top_k", "max_candidates", "vocab", "sent"),
    [(3, 4, 100, 3), (4, 4, 100, 4), (0, 4, 100, 5), (9, 4, 100, 5), (0, 4096, 50, 50)],
    ids=["user-top-k", "top-k-at-cap", "no-top-k", "top-k-over-cap", "cap-over-vocab"],
)
def test_top_k_sent_bounds_the_set_one_past_max_candidates(top_k, max_candidates, vocab, sent):
    codec = Codec(vocab_size=vocab, max_candidates=max_candidates, b64=True)
    params = SamplingParams(top_p=0.9, top_k=top_k)
    assert (
        codec.top_k(params)
        == sent
        == codec.payload([1], params, seed=None, index=0)["sampling_params"]["top_k"]
    )
    assert mask_cap(max_candidates, vocab) == min(max_candidates + 1, vocab)


def test_seed_is_per_sample_and_reproducible():
    params = SamplingParams(top_p=0.9)
    seeds = [
        CODEC.payload([1], params, seed=7, index=i)["sampling_params"]["sampling_seed"] for i in (0, 1, 0)
    ]
    assert seeds == [7 * SEED_STRIDE, 7 * SEED_STRIDE + 1, 7 * SEED_STRIDE]
    huge = CODEC.payload([1], params, seed=2**62, index=0)["sampling_params"]["sampling_seed"]
    assert huge == (2**62 * SEED_STRIDE) % 2**63  # within SGLang's int64


def test_extra_sampling_params_are_added_but_never_override():
    codec = Codec(vocab_size=100, max_candidates=4, b64=True, extra={"ignore_eos": True})
    assert codec.payload([1], SamplingParams(), seed=None, index=0)["sampling_params"]["ignore_eos"] is True
    clash = Codec(vocab_size=100, max_candidates=4, b64=True, extra={"top_p": 0.5, "min_p": 0.1})
    with pytest.raises(
        ValueError, match=r"extra_sampling_params sets \['min_p', 'top_p'\], which SamplingParams"
    ):
        clash.payload([1], SamplingParams(), seed=None, index=0)


@pytest.mark.parametrize("b64", [True, False], ids=["b64", "nested"])
def test_answer_becomes_a_sample_with_its_candidates(b64):
    rows = [[4, 9], [9], [1, 2, 3, 4]]  # at most max_candidates=4 ids per token, each holding its token
    sample = CODEC.sample([1, 2], _answer([9, 9, 3], rows, reason="length", b64=b64), wants_mask=True)
    assert sample.status == SampleStatus.TRUNCATED
    assert sample.prompt_ids == [1, 2] and sample.response_ids == [9, 9, 3] and sample.loss_mask == [1, 1, 1]
    assert sample.rollout_log_probs == [-0.25, -0.5, -0.75]  # the renormalised ones
    assert sample.rollout_raw_log_probs == [-0.5, -1.0, -1.5]
    assert sample.candidates.ids.tolist() == [4, 9, 9, 1, 2, 3, 4]
    assert sample.candidates.offsets.tolist() == [0, 2, 3, 7]
    assert sample.metadata == {"weight_version": "3", "candidate_overflow": False}


def test_untruncated_answer_has_raw_log_probs_and_no_candidates():
    sample = CODEC.sample([1], _answer([5, 6], None), wants_mask=False)
    assert sample.status == SampleStatus.COMPLETED and sample.candidates is None
    assert sample.rollout_log_probs == sample.rollout_raw_log_probs == [-0.5, -1.0]


def test_recording_can_be_turned_off():
    codec = Codec(
        vocab_size=100, max_candidates=4, b64=True, record_candidates=False, record_raw_log_probs=False
    )
    sample = codec.sample([1], _answer([9], [[9, 4]]), wants_mask=True)
    assert sample.candidates is None and sample.rollout_raw_log_probs is None
    assert sample.rollout_log_probs == [-0.25]


@pytest.mark.parametrize("reason", ["abort", None])
def test_aborted_answer_keeps_nothing_of_the_partial_response(reason):
    out = _answer([9, 9], [[9], [9]], reason=reason)
    out["meta_info"]["finish_reason"] = {"type": "abort", "message": "aborted by request"} if reason else None
    sample = CODEC.sample([1, 2], out, wants_mask=True)
    assert sample.status == SampleStatus.ABORTED and sample.prompt_ids == [1, 2]
    assert sample.response_ids == [] and sample.rollout_log_probs == [] and sample.candidates is None
    assert sample.metadata == {
        "finish_reason": out["meta_info"]["finish_reason"],
        "candidate_overflow": False,
    }


def test_a_set_over_max_candidates_aborts_the_sample_never_cut():
    rows = [[9], [1, 2, 3, 4, 9]]  # token 1 kept max_candidates + 1 = 5 ids: the top_k cut bound, an overflow
    sample = CODEC.sample([1], _answer([9, 9], rows), wants_mask=True)
    assert sample.status == SampleStatus.ABORTED and sample.response_ids == []
    assert sample.metadata["candidate_overflow"] is True and sample.metadata["weight_version"] == "3"
    assert sample.metadata["finish_reason"] == {
        "type": "abort",
        "message": "candidate set larger than max_candidates=4 (response token 1 kept more than 4 ids); raise "
        "rollout.max_candidates, or bound the set with top_k <= max_candidates",
    }


def test_sglangs_own_overflow_abort_becomes_an_overflow_sample():
    message = (
        f"{SGLANG_OVERFLOW}=5, commonly because of cutoff ties. Lower top_k to leave more headroom or ..."
    )
    out = generate_answer(URL, 400, json.dumps({"error": {"message": message}}))
    assert out == ServerOverflow(message)
    sample = CODEC.sample([1], out, wants_mask=True)
    assert sample.status == SampleStatus.ABORTED and sample.metadata == {
        "candidate_overflow": True,
        "finish_reason": {"type": "abort", "message": out.message},
        "weight_version": None,
    }


def test_answers_that_break_the_contract_raise_naming_it():
    out = _answer([9, 8], [[9], [8]])
    out["meta_info"]["output_token_logprobs"][1][1] = 7
    with pytest.raises(
        RuntimeError, match=r"output_token_logprobs for \[9, 7\], not the output ids \[9, 8\]"
    ):
        CODEC.sample([1], out, wants_mask=True)
    with pytest.raises(RuntimeError, match="no sampling mask although the request asked for one"):
        CODEC.sample([1], _answer([9], None), wants_mask=True)
    with pytest.raises(ValueError, match=r"sampled token 9 at response position 0 is missing from .* \[4\]"):
        CODEC.sample([1], _answer([9], [[4]]), wants_mask=True)


def _spans(*spans):
    return [{"version": v, "start": a, "end": b} for v, a, b in spans]


def test_weight_version_spans_become_per_token_versions():
    """SGLang 0.5.23 splits a response where an update landed mid-request; "default" is the launch weights."""
    codec = Codec(vocab_size=100, max_candidates=4, b64=True, start_version=5)
    out = _answer([9, 9, 3, 4], [[9], [9], [3], [4]], version="7")
    out["meta_info"]["weight_versions"] = _spans(("default", 0, 1), ("6", 1, 3), ("7", 3, 4))
    sample = codec.sample([1], out, wants_mask=True)
    assert sample.weight_versions == sample.token_versions() == [5, 6, 6, 7]
    assert sample.weight_version == 5 and sample.spans_versions
    out["meta_info"]["weight_versions"] = _spans(("7", 0, 4))  # one version: nothing per token
    one = codec.sample([1], out, wants_mask=True)
    assert one.weight_version == 7 and one.weight_versions is None and one.token_versions() == [7] * 4
    del out["meta_info"]["weight_versions"]  # no spans: the answer's weight_version for every token
    assert codec.sample([1], out, wants_mask=True).token_versions() == [7] * 4
    out["meta_info"]["weight_version"] = "default"
    assert codec.sample([1], out, wants_mask=True).token_versions() == [5] * 4
    assert CODEC.sample([1], out, wants_mask=True).token_versions() == [0] * 4  # start_version 0 by default


@pytest.mark.parametrize(
    ("spans", "problem"),
    [
        ((("1", 0, 2), ("2", 3, 5)), r"span \[3, 5\) after 2 tokens: a gap"),
        ((("1", 0, 3), ("2", 2, 5)), r"span \[2, 5\) after 3 tokens: a gap or an overlap"),
        ((("1", 0, 2), ("2", 2, 4)), r"cover 4 tokens, not its 5 output tokens"),
        ((("1", 0, 2), ("2", 2, 6)), r"cover 6 tokens, not its 5 output tokens"),
        ((("1", 1, 5),), r"span \[1, 5\) after 0 tokens"),
    ],
    ids=["gap", "overlap", "short", "long", "late-start"],
)
def test_malformed_version_spans_raise_naming_the_request(spans, problem):
    meta = {"id": "req-17", "weight_versions": _spans(*spans)}
    with pytest.raises(RuntimeError, match=rf"SGLang answer 'req-17' .*{problem}"):
        token_versions(meta, num_tokens=5, start_version=0, name="SGLang answer 'req-17' (3-token prompt)")
    out = _answer([9] * 5, [[9]] * 5)
    out["meta_info"].update(meta)
    with pytest.raises(RuntimeError, match=rf"SGLang answer 'req-17' \(1-token prompt\): .*{problem}"):
        CODEC.sample([1], out, wants_mask=True)


def test_a_version_tag_this_engine_never_pushed_raises():
    out = _answer([9], [[9]], version="v2")
    with pytest.raises(RuntimeError, match=r"weight_version 'v2' is neither 'default' nor an integer"):
        CODEC.sample([1], out, wants_mask=True)


def test_an_update_that_loaded_but_could_not_flush_is_a_success():
    """SGLang 0.5.23 answers an update with requests running (in-place pause) HTTP 400, success false, though the
    weights changed; any other failure still raises."""
    loaded = json.dumps({"success": False, "message": f"{LOADED_NOT_FLUSHED} because requests are still running "
                         "or queued. Retract or finish them, then call /flush_cache."})  # fmt: skip
    assert update_answer(URL, "/update_weights_from_disk", 400, loaded)["success"] is False
    with pytest.raises(ValueError, match=r"rejected POST /update_weights_from_disk \(HTTP 400\): .*shape"):
        update_answer(URL, "/update_weights_from_disk", 400, '{"success": false, "message": "shape mismatch"}')
    with pytest.raises(ValueError, match=r"\(HTTP 400\): Weights were"):  # not SGLang's JSON answer
        update_answer(URL, "/update_weights_from_disk", 400, LOADED_NOT_FLUSHED)
    with pytest.raises(RuntimeError, match="reported failure on /update_weights_from_disk: " + LOADED_NOT_FLUSHED):
        update_answer(URL, "/update_weights_from_disk", 200, loaded)  # only SGLang's own 400 is the load's success
    assert update_answer(URL, "/pause_generation", 200, '{"success": true}') == {"success": True}


def test_pause_mode_is_checked_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match=r"pause_mode \('abort'\) must be 'retract' .* or 'in_place'"):
        SGLangEngine(urls=["http://127.0.0.1:1"], vocab_size=64, workdir=tmp_path, pause_mode="abort")
    assert list(tmp_path.iterdir()) == []  # nothing launched, no work dir made


def test_status_codes_and_reported_failures():
    assert generate_answer(URL, 200, '{"output_ids": []}') == {"output_ids": []}
    with pytest.raises(
        ValueError, match=rf"SGLang at {URL} rejected POST /generate \(HTTP 400\): bad top_k; check"
    ):
        generate_answer(URL, 400, "bad top_k")
    failed = '{"success": false, "message": "shape mismatch"}'
    with pytest.raises(
        RuntimeError, match=rf"SGLang at {URL} reported failure on /update_weights_from_disk: shape"
    ):
        parse_answer("POST", URL, "/update_weights_from_disk", 200, failed, label="SGLang")


def test_error_message_reads_sglang_and_smg_bodies():
    assert error_message('{"error": {"message": "too long"}}') == "too long"
    assert error_message('{"error": "worker gone"}') == "worker gone"
    assert error_message("Internal Server Error") == "Internal Server Error"
    assert error_message("x" * 600) == "x" * 500


def test_served_vocab_is_read_from_sglangs_rejection():
    assert vocab_probe_body()["token_ids_logprob"] == [2**31 - 1]
    # SGLang 0.5.23's tokenizer_manager message, read wherever it stands in the error body
    message = "token_ids_logprob contains out-of-vocabulary token id 2147483647; valid range is [0, 512)."
    text = json.dumps({"error": {"message": message}})
    assert served_vocab(400, text) == 512
    assert served_vocab(200, text) is None and served_vocab(400, "other") is None


def _sglang_routes_payload(ids: torch.Tensor) -> str:
    """SGLang 0.5.23's own encoding (TokenizerManager, skip_tokenizer_init path): the scheduler's int32 host-buffer
    rows [tokens, num_hidden_layers, top_k] as `pybase64.b64encode(val.numpy().tobytes()).decode("utf-8")`."""
    import pybase64

    assert ids.dtype == torch.int32
    return pybase64.b64encode(ids.numpy().tobytes()).decode("utf-8")


def test_routed_experts_are_asked_for_and_decoded_from_sglangs_payload():
    """A Qwen3-MoE with a dense first layer (mlp_only_layers=[0]): SGLang sends a row for every decoder layer,
    the dense one never written (zeros); the Sample keeps the MoE layers, in the router's order, as uint8."""
    from topp_rl.data.routes import MoeRouting
    from topp_rl.engines.sglang.routes import decode_routes, encode_routes

    routing = MoeRouting(layer_ids=(1, 2), top_k=2, num_experts=4, num_hidden_layers=3)
    codec = Codec(vocab_size=100, max_candidates=4, b64=True, routing=routing)
    params = SamplingParams(top_p=0.9, max_new_tokens=3)
    assert codec.payload([1, 2, 3], params, seed=None, index=0)["return_routed_experts"] is True
    assert "return_routed_experts" not in CODEC.payload([1, 2, 3], params, seed=None, index=0)
    prompt, tokens = [1, 2, 3], [5, 6]
    fed = len(prompt) + len(tokens) - 1  # SGLang's [0, seqlen - 1)
    every_layer = torch.randint(0, 4, (fed, 3, 2), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    every_layer[:, 0] = 0  # the dense layer: never captured
    out = _answer(tokens, [[5, 9], [6]])
    out["meta_info"]["routed_experts"] = _sglang_routes_payload(every_layer)
    assert encode_routes(every_layer) == out["meta_info"]["routed_experts"]
    sample = codec.sample(prompt, out, wants_mask=True)
    assert sample.routes.dtype == torch.uint8 and torch.equal(sample.routes, every_layer[:, 1:].to(torch.uint8))
    aborted = codec.sample(prompt, _answer(tokens, None, reason=None), wants_mask=True)
    assert aborted.status == SampleStatus.ABORTED and aborted.routes is None
    del out["meta_info"]["routed_experts"]
    with pytest.raises(ValueError, match="returned no 'routed_experts'.*--enable-return-routed-experts"):
        codec.sample(prompt, out, wants_mask=True)
    short = {"routed_experts": _sglang_routes_payload(every_layer[:-1])}
    with pytest.raises(ValueError, match=r"holds 18 ids, expected 4 fed tokens x 3 layers x top_k 2 = 24"):
        decode_routes(short, routing, tokens=fed, name="x")
    wrong = every_layer.clone()
    wrong[2, 2, 1] = 9
    with pytest.raises(ValueError, match=r"MoE layer 1 \(decoder layer 2\) routes token 2 to expert 9, outside"):
        decode_routes({"routed_experts": _sglang_routes_payload(wrong)}, routing, tokens=fed, name="x")


def test_launched_servers_get_the_capture_flag_and_cpu_servers_refuse_routes(tmp_path):
    from topp_rl.engines.sglang.engine import SGLangEngine
    from topp_rl.engines.sglang.routes import with_route_capture
    from topp_rl.models import build_tiny

    assert with_route_capture({"dtype": "float32"})["extra_args"] == ("--enable-return-routed-experts",)
    flagged = with_route_capture({"extra_args": ("--enable-return-routed-experts",)})
    assert flagged["extra_args"] == ("--enable-return-routed-experts",)
    model, tokenizer = build_tiny(family="qwen3_moe")
    with pytest.raises(ValueError, match=r"record_routes=true with an MoE model and a CPU SGLang server.*"
                                         r"set rollout.record_routes=false"):
        SGLangEngine.for_policy(model=model, tokenizer=tokenizer, workdir=tmp_path)
