"""The `/generate` codec of `SGLangEngine`: `SamplingParams` -> request body, SGLang's answer -> `Sample`. Pure
functions of their inputs (no HTTP: `serving.client` sends, `fleet.py` probes), so each rule is tested without a server.

Per response token the Sample gets:
- the candidate set: SGLang's sampling mask (the ids its sampler kept), decoded by `topp_rl.engines.serving.wire`,
  from our compact base64 arrays when the servers carry `patches/sglang` (`Codec.b64`), else from SGLang's
  nested JSON lists;
- `rollout_log_probs`: SGLang's `output_token_sampling_logprobs`, the sampled token's log-prob renormalised
  over the kept set;
- `rollout_raw_log_probs`: SGLang's `output_token_logprobs` (log_softmax(logits / T) before truncation);
- MoE models (`Codec.routing`): SGLang's routed experts of every fed token (`topp_rl.engines.sglang.routes`);
- its weight version (`token_versions`): SGLang's `weight_versions` spans ({"version", "start", "end"} over the
  output tokens, split where an update landed mid-request), each tag the integer an update pushed, or "default"
  (the launch weights) = `Codec.start_version`.
Departures from SGLang's defaults: the mask needs a finite top_k, so a request without one (top_k=0), or with
one above `max_candidates`, is sent as top_k = max_candidates + 1 (at most the vocab size; `mask_cap`), and
launched servers get `--sampling-mask-max-tokens` = that. A sample whose kept set exceeds `max_candidates` at any
token (it arrives as a full row of max_candidates + 1 ids) is never cut to the cap: it is ABORTED, with
`metadata["candidate_overflow"] = True` and the reason (`overflow_sample`); so is one SGLang itself aborts for a
set over its cap (HTTP 400, `ServerOverflow`). A set of at most max_candidates ids is exactly the one the user's
parameters keep. An untruncated request (top_p=1, top_k=0, min_p=0) asks for no mask (the set is the whole
vocabulary) and records no candidates, its renormalised log-prob being the raw one. A seed is forwarded as a
per-sample `sampling_seed` (seed, index); SGLang honours it only on servers started with
`--enable-deterministic-inference`, which its CPU torch_native backend rejects, so on CPU a seed does not
reproduce a rollout (and with min_p > 0 no seed is sent: SGLang's seeded sampler asserts on min-p). An aborted
request yields an empty Sample with status "aborted", never a half-filled one.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.routes import MoeRouting
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.engines.serving.answers import overflow_sample, spans_to_versions
from topp_rl.engines.serving.client import error_message, parse_answer
from topp_rl.engines.serving.wire import IDS_KEY, decode_candidates
from topp_rl.engines.sglang.routes import decode_routes

FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}
SEED_STRIDE = 1_000_003  # sampling_seed = seed * stride + sample index: distinct per sample, same per rerun
# SGLang's own abort when a realised set exceeds --sampling-mask-max-tokens (HTTP 400 on a non-streamed
# /generate; on GPU, from top-k cutoff ties): `get_sampling_mask_finish_reason` in its batch_result_processor.
SGLANG_OVERFLOW = "Sampling support exceeds --sampling-mask-max-tokens"
_VOCAB_PROBE_ID = 2**31 - 1  # SGLang rejects it in token_ids_logprob, naming its vocab size (checked before
# the scheduler: an out-of-vocabulary *input* id would crash the server instead)
_VOCAB_RANGE = re.compile(r"valid range is \[0, (\d+)\)")


@dataclass(frozen=True)
class ServerOverflow:
    """SGLang aborted the request because a realised set exceeded its --sampling-mask-max-tokens."""

    message: str


def mask_cap(max_candidates: int, vocab_size: int) -> int:
    """The servers' --sampling-mask-max-tokens: one more than max_candidates (at most the vocab), so a set cut at
    the cap (of max_candidates + 1 ids) tells an overflow apart from a set of exactly max_candidates."""
    return min(max_candidates + 1, vocab_size)


@dataclass(frozen=True)
class Codec:
    """How one engine writes its /generate requests and reads the answers."""

    vocab_size: int
    max_candidates: int
    b64: bool  # ask for the compact candidate arrays (servers carrying patches/sglang)
    record_candidates: bool = True
    record_raw_log_probs: bool = True
    routing: MoeRouting | None = None  # ask for and decode the routed experts (servers need the flag)
    # SGLang-only sampling keys added to every request, e.g. {"ignore_eos": True}
    extra: Mapping[str, Any] = field(default_factory=dict)
    start_version: int = 0  # the version of the launch weights (SGLang's "default"): `SGLangEngine.start_version`

    def top_k(self, params: SamplingParams) -> int:
        """The top_k sent: the user's when it bounds the set to max_candidates; else (no top-k, or a larger one)
        `mask_cap`, so that a set exceeding max_candidates arrives as a full row of max_candidates + 1 ids and
        is reported (`sample`), never silently cut to the cap. A set of at most max_candidates ids is exactly
        the one the user's parameters keep: the extra top-k cut did not bind."""
        if 0 < params.top_k <= self.max_candidates:
            return params.top_k
        return mask_cap(self.max_candidates, self.vocab_size)

    def payload(
        self, prompt: list[int], params: SamplingParams, *, seed: int | None, index: int
    ) -> dict[str, Any]:
        """The /generate body of sample `index` of a rollout; a mask is asked for only when `params` truncate."""
        wants_mask = params.truncates
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": self.top_k(params) if wants_mask else -1,
            "min_p": params.min_p,
            "max_new_tokens": params.max_new_tokens,
            "stop_token_ids": list(params.stop_token_ids),
        }
        clash = sampling.keys() & self.extra.keys()
        if clash:
            raise ValueError(
                f"extra_sampling_params sets {sorted(clash)}, which SamplingParams controls; set them there"
            )
        sampling.update(self.extra)
        if seed is not None and params.min_p == 0:
            sampling["sampling_seed"] = (seed * SEED_STRIDE + index) % (2**63)
        body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
        if self.routing is not None:
            body["return_routed_experts"] = True  # from the first token: routed_experts_start_len 0
        if wants_mask:
            body["return_sampling_mask"] = True
            if self.b64:
                body["return_sampling_mask_b64"] = True
        return body

    def sample(self, prompt: list[int], out: dict[str, Any] | ServerOverflow, *, wants_mask: bool) -> Sample:
        """The Sample of one answer (`generate_answer`): status from SGLang's finish reason (`stop` -> completed,
        `length` -> truncated, else aborted and empty), the tokens with their log-probs and candidate sets."""
        if isinstance(out, ServerOverflow):
            return overflow_sample(prompt, out.message, weight_version=None)
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in FINISH_STATUS:  # "abort" (or no reason at all): keep nothing of a partial response
            return Sample(prompt_ids=prompt, status=SampleStatus.ABORTED,
                          metadata={"finish_reason": meta.get("finish_reason"), "candidate_overflow": False})  # fmt: skip
        tokens = [int(t) for t in out["output_ids"]]
        raw = [float(lp) for lp, tok, *_ in meta["output_token_logprobs"]]
        raw_ids = [int(tok) for _, tok, *_ in meta["output_token_logprobs"]]
        if raw_ids != tokens:
            raise RuntimeError(
                f"SGLang returned output_token_logprobs for {raw_ids}, not the output ids {tokens}"
            )
        if wants_mask:
            log_probs = [float(x) for x in meta["output_token_sampling_logprobs"]]
            cands = decode_candidates(meta, num_tokens=len(tokens), vocab_size=self.vocab_size, tokens=tokens)
            if cands is None:
                raise RuntimeError("SGLang returned no sampling mask although the request asked for one")
            lengths = cands.row_lengths()
            if tokens and int(lengths.max()) > self.max_candidates:
                at = int(torch.argmax((lengths > self.max_candidates).int()))
                message = (f"candidate set larger than max_candidates={self.max_candidates} (response token {at} "
                           f"kept more than {self.max_candidates} ids); raise rollout.max_candidates, or bound the "
                           "set with top_k <= max_candidates")  # fmt: skip
                return overflow_sample(prompt, message, weight_version=meta.get("weight_version"))
        else:
            log_probs, cands = raw, None  # untruncated: the renormalised distribution is the full one
        sample = Sample(prompt_ids=prompt, status=FINISH_STATUS[reason],
                        metadata={"weight_version": meta.get("weight_version"), "candidate_overflow": False})  # fmt: skip
        sample.append_response_tokens(
            tokens,
            log_probs,
            cands if self.record_candidates else None,
            raw_log_probs=raw if self.record_raw_log_probs else None,
        )
        name = f"SGLang answer {meta.get('id')!r} ({len(prompt)}-token prompt)"
        sample.set_token_versions(token_versions(meta, num_tokens=len(tokens), start_version=self.start_version,
                                                 name=name))  # fmt: skip
        if self.routing is not None:
            sample.routes = decode_routes(meta, self.routing, tokens=len(prompt) + len(tokens) - 1, name=name)
            sample.check_lengths()
        return sample


def token_versions(meta: Mapping[str, Any], *, num_tokens: int, start_version: int, name: str) -> list[int]:
    """The weight version of each output token of an answer's `meta_info` (`serving.answers.spans_to_versions`)."""
    return spans_to_versions(meta.get("weight_versions"), meta.get("weight_version"), num_tokens=num_tokens,
                             start_version=start_version, name=name, expects="SGLang 0.5.23's")


def generate_answer(url: str, status: int, text: str) -> dict[str, Any] | ServerOverflow:
    """A /generate's answer: the JSON, or `ServerOverflow` for SGLang's own overflow abort (HTTP 400)."""
    if status == 400 and SGLANG_OVERFLOW in text:
        return ServerOverflow(error_message(text))
    return parse_answer("POST", url, "/generate", status, text, label="SGLang")


# ---- connect-time probes (sent by fleet.py) -------------------------------------------------------------------
def probe_body(*, b64: bool) -> dict[str, Any]:
    """A one-token request asking for the mask; with `b64` only a patched server answers with IDS_KEY."""
    body = {
        "input_ids": [0],
        "sampling_params": {"max_new_tokens": 1, "top_k": 2, "temperature": 1.0},
        "return_sampling_mask": True,
    }
    return {**body, "return_sampling_mask_b64": True} if b64 else body


def has_candidates(answer: dict[str, Any], *, b64: bool) -> bool:
    """Whether a probe's answer carries the candidate sets in the asked form."""
    return (IDS_KEY if b64 else "output_token_sampling_mask") in answer.get("meta_info", {})


def vocab_probe_body() -> dict[str, Any]:
    """A request SGLang rejects (HTTP 400) naming its vocab size: `served_vocab` reads the answer."""
    return {"input_ids": [0], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
            "token_ids_logprob": [_VOCAB_PROBE_ID]}  # fmt: skip


def served_vocab(status: int, text: str) -> int | None:
    """The vocab size named by SGLang's rejection of `vocab_probe_body`; None when the answer is another."""
    found = _VOCAB_RANGE.search(text) if status == 400 else None
    return int(found.group(1)) if found else None
