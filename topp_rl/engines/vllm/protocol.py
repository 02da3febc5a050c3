"""The `/inference/v1/generate` codec of `VLLMEngine`: `SamplingParams` -> request body, vLLM's answer -> `Sample`.
Pure functions of their inputs (no HTTP), so each rule is tested without a server.

The kept set comes from vLLM's processed log-probs (servers run with `--logprobs-mode processed_logprobs`): the
log-probs after temperature, min-p, top-k and top-p, in that order (vLLM's sampler on CPU; `sampling_candidates(
convention="vllm")` states the rule), renormalised over what survives, every dropped id at -inf (sent as -9999).
A request asks for the top `top_k + 1` of them per token: the finite entries are exactly the kept set, their values
the renormalised log-probs, and the sampled token's entry is its `rollout_log_probs`. vLLM keeps every id tied at the
k-th value, so a set may hold more than top_k ids; all top_k + 1 entries are then finite and the list cannot show
the whole set: that sample is ABORTED and flagged `candidate_overflow` with the reason (the rule of
`serving.answers.overflow_sample`), never cut. Hence a truncating request needs 0 < top_k <= max_candidates
(`check_params`). An untruncated request (top_p=1, top_k=0, min_p=0) asks for the sampled token's log-prob only and
records no candidates (the set is the whole vocabulary).

Native masks (`Codec.native_masks`): a GPU server started with `--return-sampling-mask` (vLLM's V2 model runner)
answers each token's kept ids itself (`sampling_mask`, one id list per output token); the request then asks only for
the sampled token's processed log-prob, and ties cannot overflow (a set above `max_candidates` is aborted as one). vLLM refuses such a server's requests unless
top_k > 0 (it bounds the mask's size), so top_k is required there (`check_params`).

vLLM's order differs from SGLang's (`topp_rl.data.params`: top-k and top-p both on the unrenormalised
probabilities, min-p last); the trainer scores over the recorded sets, so its log-probs are exact whichever
convention the engine followed. Per-sample seeds are honoured (`seed * SEED_STRIDE + index`): a rerun reproduces
its samples. Each token's weight version comes from vLLM's `weight_versions` spans ("default": the launch weights).
No raw (untruncated) log-probs are recorded for truncated requests: the processed mode gives only the renormalised
ones.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.engines.serving.answers import overflow_sample, spans_to_versions
from topp_rl.ops import Candidates
from topp_rl.ops.candidates import rows_missing_token

GENERATE_PATH = "/inference/v1/generate"
FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}
SEED_STRIDE = 1_000_003  # seed = seed * stride + sample index: distinct per sample, same per rerun
NEG_INF = -9999.0  # how vLLM's JSON carries a -inf log-prob (a dropped id)
EXPECTS = "vLLM 0.32's"
# The sampling keys `payload` derives from SamplingParams (and the kept-set reading relies on).
OWN_KEYS = frozenset({"n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "stop_token_ids", "logprobs",
                      "detokenize", "seed"})  # fmt: skip


def check_params(params: SamplingParams, *, max_candidates: int, vocab_size: int, native_masks: bool = False) -> None:
    """Refuse sampling whose kept set the top-(k+1) log-probs cannot show: truncated sampling (top_p < 1 or
    min_p > 0) without 0 < top_k <= max_candidates, or a top_k that reaches the vocabulary. With native masks:
    what vLLM refuses on a `--return-sampling-mask` server (top_k 0; temperature 0 never reaches an engine)."""
    if native_masks and not 0 < params.top_k <= max_candidates:
        raise ValueError(
            f"top_k={params.top_k}: a vLLM server that returns native sampling masks (--return-sampling-mask) "
            f"serves only 0 < top_k <= max_candidates ({max_candidates}), vLLM's bound on the mask size; set "
            "rollout.top_k (and the eval's top_k), or serve without the flag (sets read from log-probs)"
        )
    if params.truncates and not 0 < params.top_k <= max_candidates:
        raise ValueError(
            f"rollout=vllm with top_p={params.top_p}, min_p={params.min_p} needs 0 < top_k <= max_candidates "
            f"({max_candidates}), got top_k={params.top_k}: the kept set is read from vLLM's top-(top_k + 1) processed "
            "log-probs, which an unbounded set does not fit; set rollout.top_k (e.g. 20, 50), or use rollout=sglang "
            "(native masks of any size up to max_candidates), or rollout=embedded"
        )
    if params.top_k + 1 > vocab_size:
        raise ValueError(
            f"top_k={params.top_k} must be below the vocabulary size ({vocab_size}): the engine asks vLLM for "
            "top_k + 1 log-probs per token; lower rollout.top_k"
        )


def logprobs_asked(params: SamplingParams, *, native_masks: bool = False) -> int:
    """Log-probs asked per token: top_k + 1 when truncating (the last tells an overflow), else 0 (the sampled one);
    0 with native masks (the server names the set)."""
    return params.top_k + 1 if params.truncates and not native_masks else 0


def check_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """`extra_sampling_params` as a dict; ValueError when it sets a key the engine derives from SamplingParams."""
    extra = dict(extra or {})
    clash = sorted(extra.keys() & OWN_KEYS)
    if clash:
        raise ValueError(f"extra_sampling_params sets {clash}, which the engine derives from SamplingParams (and "
                         "the kept sets depend on); set them through SamplingParams / rollout.*, or drop them")  # fmt: skip
    return extra


def payload(
    prompt: list[int], params: SamplingParams, *, seed: int | None, index: int, extra: Mapping[str, Any] | None = None,
    native_masks: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The body of sample `index` of a rollout (one sample per request); `extra`: more vLLM sampling keys
    (`check_extra`); `native_masks`: the server answers the sets, so only the sampled log-prob is asked for."""
    sampling = {
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": params.min_p,
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "logprobs": logprobs_asked(params, native_masks=native_masks),
        "detokenize": False,
        **(extra or {}),
    }
    if seed is not None:
        sampling["seed"] = (seed * SEED_STRIDE + index) % (2**63)
    return {"token_ids": prompt, "sampling_params": sampling, "output_mode": "tokens"}


@dataclass(frozen=True)
class Codec:
    """How one engine reads vLLM's answers."""

    vocab_size: int
    record_candidates: bool = True
    start_version: int = 0  # the version of the launch weights (vLLM's "default")
    native_masks: bool = False  # the sets come from the answer's `sampling_mask`, not from the top-(k+1) log-probs
    max_candidates: int = 4096

    def sample(self, prompt: list[int], answer: Mapping[str, Any], params: SamplingParams) -> Sample:
        """The Sample of one answer: status from vLLM's finish reason (`stop` -> completed, `length` -> truncated,
        else aborted and empty), the tokens with their renormalised log-probs and kept sets."""
        choice = answer["choices"][0]
        reason = choice.get("finish_reason")
        name = f"vLLM answer {answer.get('request_id')!r} ({len(prompt)}-token prompt)"
        if reason not in FINISH_STATUS:  # "abort" (or none): keep nothing of a partial response
            return Sample(prompt_ids=prompt, status=SampleStatus.ABORTED,
                          metadata={"finish_reason": {"type": reason}, "candidate_overflow": False})  # fmt: skip
        tokens = [int(t) for t in choice["token_ids"]]
        content = (choice.get("logprobs") or {}).get("content") or []
        if [int(c["token_id"]) for c in content] != tokens:
            raise RuntimeError(f"{name}: log-probs for {[c['token_id'] for c in content]}, not the output {tokens}")
        log_probs = [float(c["logprob"]) for c in content]
        cands = None
        if self.native_masks:
            kept = native_sets(choice.get("sampling_mask"), num_tokens=len(tokens), name=name)
            too_big = next((i for i, row in enumerate(kept) if len(row) > self.max_candidates), None)
            if too_big is not None:
                message = (f"kept set at response token {too_big} holds {len(kept[too_big])} ids, above "
                           f"rollout.max_candidates={self.max_candidates}; raise it or lower rollout.top_k")
                return overflow_sample(prompt, message, weight_version=None)
            cands = candidates_of(kept, tokens, name=name)
        elif params.truncates:
            kept, overflow_at = kept_sets(content, asked=logprobs_asked(params))
            if overflow_at is not None:
                message = (f"kept set at response token {overflow_at} holds more than top_k={params.top_k} ids (ties at "
                           f"the k-th log-prob are all kept; the top-{params.top_k + 1} log-probs vLLM returns cannot "
                           "show the whole set); raise rollout.top_k, or serve float32 (bf16 ties are common)")  # fmt: skip
                return overflow_sample(prompt, message, weight_version=None)
            cands = candidates_of(kept, tokens, name=name)
        sample = Sample(prompt_ids=prompt, status=FINISH_STATUS[reason], metadata={"candidate_overflow": False})
        sample.append_response_tokens(tokens, log_probs, cands if self.record_candidates else None)
        sample.set_token_versions(spans_to_versions(choice.get("weight_versions"), None, num_tokens=len(tokens),
                                                    start_version=self.start_version, name=name, expects=EXPECTS))  # fmt: skip
        return sample


def kept_sets(content: list[Mapping[str, Any]], *, asked: int) -> tuple[list[list[int]], int | None]:
    """Each token's kept ids, most probable first: the finite entries of its top-`asked` processed log-probs. vLLM
    lists the sampled token first, then the top `asked` without it where it is among them (so `asked` entries, else
    `asked + 1`). Also returns the first token whose top `asked` are all finite (an overflow: the set may hold more),
    else None."""
    kept = []
    for i, token in enumerate(content):
        entries = token["top_logprobs"]
        if len(entries) not in (asked, asked + 1) or int(entries[0]["token_id"]) != int(token["token_id"]):
            raise RuntimeError(f"vLLM returned {len(entries)} log-probs at response token {i}, asked for {asked} "
                               "(plus the sampled token first); this client expects vLLM 0.32's logprobs")  # fmt: skip
        top = sorted(entries if len(entries) == asked else entries[1:], key=lambda e: -float(e["logprob"]))
        finite = [int(e["token_id"]) for e in top if float(e["logprob"]) > NEG_INF]
        if len(finite) == asked:
            return kept, i
        kept.append(finite)
    return kept, None


def native_sets(mask: Any, *, num_tokens: int, name: str) -> list[list[int]]:
    """The kept ids per output token from a native `sampling_mask` answer; RuntimeError naming `name` when the
    server sent none (not started with --return-sampling-mask) or a count other than one list per token."""
    if not isinstance(mask, list) or len(mask) != num_tokens:
        got = f"{len(mask)} mask rows" if isinstance(mask, list) else f"sampling_mask={mask!r}"
        raise RuntimeError(f"{name}: {got} for {num_tokens} output tokens; native masks need every server started "
                           "with --return-sampling-mask (vLLM's V2 model runner)")  # fmt: skip
    return [[int(t) for t in row] for row in mask]


def candidates_of(kept: list[list[int]], tokens: list[int], *, name: str) -> Candidates:
    """The CSR Candidates of the kept rows; RuntimeError naming `name` when a sampled token is not in its row."""
    lengths = torch.tensor([len(row) for row in kept], dtype=torch.int64)
    offsets = torch.zeros(len(kept) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(lengths, 0)
    cands = Candidates(ids=torch.tensor([t for row in kept for t in row], dtype=torch.int32), offsets=offsets)
    missing = rows_missing_token(cands, torch.tensor(tokens, dtype=torch.long))
    if missing.numel():
        i = int(missing[0])
        raise RuntimeError(f"{name}: sampled token {tokens[i]} at response position {i} is not among its kept ids "
                           f"{kept[i]}; is the server running --logprobs-mode processed_logprobs?")
    return cands
