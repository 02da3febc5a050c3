"""One multi-turn trajectory (`topp_rl.rollout.agent_step`, `topp_rl.rollout.endpoint`): one or more `Sample`s
whose responses hold the model's turns (trainable, with their recorded log-probs and candidate sets) and the
environment's output between them (loss mask 0, log-prob 0, empty = unrestricted candidate rows), and the rules
that end it.

The token rule: a turn's prompt ids either extend the running sample's ids exactly (its prompt, then every
earlier turn's exact ids: the extra ids are environment tokens) and the turn joins that sample, or they do not
(a prefix break: the history was rewritten) and the turn starts a new sample of the same trajectory, whose prompt
is those ids. Every sample of a trajectory gets the trajectory's reward (`extend_to`, `finish`).

MoE routes: an engine records routes per `generate` call, for every token that call fed through the model (its
prompt, i.e. the whole transcript so far, and its response but the last token). The last model turn's call
therefore covers every earlier turn, the environment's tokens included; each sample keeps its last call's routes,
cut to the sample (`trajectory_routes`). The embedded engine recomputes the prefix each call; SGLang 0.5.23
reads a cached prefix's routes from the KV slots' capture (`srt/state_capturer`), i.e. the forward whose KV
later tokens attended to. A sample that holds environment tokens after its last model turn (it failed after
them) goes without routes (the trainer routes it itself, as packing does for any sample without routes).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

import torch

from topp_rl.data import PromptRecord
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.engines.serving.client import MAX_WAIT_S, is_seconds
from topp_rl.tasks.environment import (
    BAD_RETURN,
    FAULT_KINDS,
    TIMEOUT,
    EnvFault,
    EnvOutput,
    Episode,
    ModelTurn,
)

# Why a trajectory ended: the episode ended it, a budget (the model's context is one: no room for another
# turn), or the engine aborted it (never trained on) ...
END_ENV, END_MAX_TURNS, END_MAX_TOKENS, END_CONTEXT, END_ABORTED = "env", "max_turns", "max_tokens", "context", "aborted"
# ... or it failed (reward 0, counted in rollout/trajectories_failed; the fault's kind in rollout/env_errors/<kind>).
FAIL_ERROR, FAIL_TIMEOUT = "env_error", "env_timeout"


@dataclass(eq=False)
class Trajectory:
    record: PromptRecord
    samples: list[Sample] = field(default_factory=list)  # the running one last; none before the first turn
    episode: Episode | None = None
    turns: int = 0
    env_tokens: int = 0
    prefix_breaks: int = 0  # turns that started a new sample
    end: str | None = None  # None while it runs
    error: str | None = None  # the failure's message
    fault: str | None = None  # the failure's kind (`topp_rl.tasks.environment.FAULT_KINDS`, or TIMEOUT)
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    status: SampleStatus | None = None  # set on every sample at the end (TRUNCATED: ended by a budget)
    # Per sample (by position), its latest model turn's call's routes (MoE engines that record them); a Sample
    # takes routes only once complete.
    routes: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def sample(self) -> Sample:
        """The running sample (the latest)."""
        return self.samples[-1]

    @property
    def response_tokens(self) -> int:
        """Response tokens (model + environment) over all the trajectory's samples: what the budget counts."""
        return sum(s.response_length for s in self.samples)

    @property
    def live(self) -> bool:
        return self.end is None

    @property
    def failed(self) -> bool:
        return self.end in (FAIL_ERROR, FAIL_TIMEOUT)

    def fail(self, kind: str, message: str) -> None:
        """End it as failed (reward 0; `kind`: the fault's); with no model token yet there is nothing to train on
        (aborted)."""
        self.end = FAIL_TIMEOUT if kind == TIMEOUT else FAIL_ERROR
        self.fault, self.error, self.reward, self.status = kind, message, 0.0, None  # (no longer truncated)
        if self.response_tokens == 0:
            self.status = SampleStatus.ABORTED
            for s in self.samples:
                s.status = SampleStatus.ABORTED

    def extend_to(self, ids: list[int]) -> list[int]:
        """Make the running sample's ids `ids` (the prompt of the next model turn): when they extend its ids exactly
        the extra ids are appended as environment tokens (returned); otherwise a new sample starts with prompt
        `ids` (a prefix break, counted, unless it is the trajectory's first sample)."""
        ids = [int(t) for t in ids]
        if self.samples:
            have = self.sample.tokens
            if ids[: len(have)] == have:
                extra = ids[len(have):]
                if extra:
                    self.sample.append_response_tokens(extra, trainable=False)
                    self.env_tokens += len(extra)
                return extra
            self.prefix_breaks += 1
        self.samples.append(Sample(prompt_ids=ids))
        return []

    def add_model_turn(self, out: Sample, sent: list[int], *, max_tokens: int, tokenizer: Any) -> ModelTurn | None:
        """Append the engine's turn (cut to the token budget); None when the engine aborted. The turn belongs
        to the ids the engine conditioned it on (`out.prompt_ids`): when they are not `sent` (the running ids), the
        turn starts a new sample (a prefix break) rather than train log-probs conditioned on other ids."""
        if out.prompt_ids != sent:
            self.extend_to(out.prompt_ids)
        if out.status == SampleStatus.ABORTED:
            for s in self.samples:  # no reward comes: none of the trajectory's samples trains
                s.status = SampleStatus.ABORTED
            self.end = END_ABORTED
            self.sample.metadata["finish_reason"] = out.metadata.get("finish_reason")
            return None
        keep = min(out.response_length, max_tokens - self.response_tokens)  # budget cuts are exact
        ids = out.response_ids[:keep]
        self.sample.append_response_tokens(
            ids, out.rollout_log_probs[:keep], out.candidates[:keep] if out.candidates is not None else None,
            raw_log_probs=out.rollout_raw_log_probs[:keep] if out.rollout_raw_log_probs is not None else None,
            versions=out.token_versions()[:keep])  # a trajectory's turns may span weight updates
        self.turns += 1
        if out.routes is not None:
            self.routes[len(self.samples) - 1] = out.routes  # this sample's latest call (set on it in `finish`)
        finished = out.status == SampleStatus.COMPLETED and keep == out.response_length
        return ModelTurn(index=self.turns - 1, ids=ids, text=tokenizer.decode(ids, skip_special_tokens=True),
                         finished=finished)

    def add_env_output(self, output: EnvOutput, *, max_turns: int, max_tokens: int, tokenizer: Any,
                       vocab_size: int, source: str) -> None:
        """The episode's answer to the latest turn (`source`: the method that gave it, for messages): end on None
        or a budget, else append its tokens."""
        if output is None:
            self.end = END_ENV
            return
        ids = _env_ids(output, tokenizer, vocab_size, source=source)
        if self.turns >= max_turns:
            self.end_on_budget(END_MAX_TURNS)
        elif self.response_tokens + len(ids) >= max_tokens:  # no room left for a model token after it
            self.end_on_budget(END_MAX_TOKENS)
        else:
            self.sample.append_response_tokens(ids, trainable=False)
            self.env_tokens += len(ids)

    def end_on_budget(self, reason: str) -> None:
        self.end = reason
        self.status = SampleStatus.TRUNCATED

    def finish(self, *, trajectory: int) -> list[Sample]:
        """The trajectory's samples (`trajectory`: its number among the step's trajectories of this rank), each
        with the trajectory's reward and figures in `metadata` (read by `score_trajectories` and
        `trajectory_stats`; the figures count once per trajectory, on its first sample)."""
        if not self.samples:  # failed before its first turn: one empty sample stands for it (aborted, not trained)
            self.samples.append(Sample(prompt_ids=self.record.prompt_ids, status=SampleStatus.ABORTED))
        for j, s in enumerate(self.samples):
            if j in self.routes:
                s.routes = trajectory_routes(self.routes[j], fed=len(s.tokens) - 1)
            s.metadata |= {"trajectory_local": trajectory, "trajectory_sample": j,
                           "trajectory_samples": len(self.samples), "end": self.end, "env_reward": self.reward}
            if self.status is not None and s.status != SampleStatus.ABORTED:
                s.status = self.status
            if s.response_length == 0:  # a turn the engine never answered: nothing of it trains
                s.status = SampleStatus.ABORTED
        first = self.samples[0].metadata
        first |= {"turns": self.turns, "env_tokens": self.env_tokens, "prefix_breaks": self.prefix_breaks}
        if self.error is not None:
            first["env_error"] = self.error
            if self.response_tokens == 0:  # why it is aborted, where a step left with no trainable sample says so
                first.setdefault("finish_reason", {"type": "abort", "message": "failed before its first model turn: "
                                                   f"{self.error}"})
        if self.fault is not None:
            first["env_error_kind"] = self.fault
        if self.reward_info:
            first["env_reward_info"] = self.reward_info
        return self.samples


def trajectory_routes(last_call: torch.Tensor, *, fed: int) -> torch.Tensor | None:
    """The routes of a trajectory's `fed` tokens (prompt + response - 1) from its last model turn's call, cut when
    a budget cut that turn (a token's route depends only on the tokens up to it); None when environment tokens
    came after that call (a failed trajectory: the call never saw them)."""
    return last_call[:fed].clone() if last_call.shape[0] >= fed else None


def _env_ids(output: EnvOutput, tokenizer: Any, vocab_size: int, *, source: str) -> list[int]:
    """Environment output as token ids: text tokenised once (no special tokens added); ids (a list or tuple of
    ints, or a 1-D array) checked. Anything else is the environment's fault (bad_return): bytes or a dict would
    iterate as some other ids."""
    if isinstance(output, str):
        return list(tokenizer.encode(output, add_special_tokens=False))
    values = output.tolist() if hasattr(output, "tolist") and hasattr(output, "ndim") and output.ndim == 1 else output
    if not isinstance(values, list | tuple | range) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in values):
        raise EnvFault(BAD_RETURN, f"{source} returned {output!r:.80} ({type(output).__name__}); answer text (a str), "
                       "token ids (a list of ints) or None (the trajectory ends)")
    ids = [int(t) for t in values]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise EnvFault(BAD_RETURN, f"{source} answered token ids {bad[:5]} outside the vocabulary [0, {vocab_size}); "
                       "answer text, or ids of the policy's tokenizer")
    return ids


def score_trajectories(samples: list[Sample], records: list[PromptRecord], *, n: int, first_group: int) -> None:
    """Number a multi-turn step's samples in place and give each the reward of its trajectory. Trajectory t of
    this rank (`trajectory_local`, `n` per record, record-major) belongs to prompt group `first_group + t // n` and
    is trajectory `first_group * n + t` of the step (`metadata["trajectory"]`, the key advantages are computed
    over); sample indices run on from `first_group * n` (unique on the rank: the packer's sequence ids)."""
    for i, s in enumerate(samples):
        local = int(s.metadata["trajectory_local"])
        if not 0 <= local < len(records) * n:
            raise ValueError(f"sample {i} belongs to trajectory {local}, outside the {len(records)} x n={n} of this "
                             "step; a multi-turn step numbers its trajectories record-major from 0")
        s.index, s.group_index = first_group * n + i, first_group + local // n
        s.metadata["trajectory"] = first_group * n + local
        s.metadata.setdefault("answer", records[local // n].answer)
        if s.status != SampleStatus.ABORTED:
            s.reward = float(s.metadata["env_reward"])
            if "env_reward_info" in s.metadata:  # the episode's other entries: rollout/reward/<key>_mean (RolloutStats)
                info = s.metadata["env_reward_info"]
                s.metadata["rewards"] = {k: float(v) for k, v in info.items() if isinstance(v, int | float)}


def trajectory_stats(samples: list[Sample]) -> dict[str, tuple[float, float]]:
    """The multi-turn figures of a step's samples, per trajectory (read on each trajectory's first sample); every
    fault kind has its key on every step, so all ranks reduce the same keys."""
    firsts = [s.metadata for s in samples if s.metadata["trajectory_sample"] == 0]
    ends = [m["end"] for m in firsts]
    faults = [m.get("env_error_kind") for m in firsts if m["end"] == FAIL_ERROR]

    def count(kind: str) -> tuple[float, float]:  # per step of a rank (averaged over DP ranks)
        return float(ends.count(kind)), 1.0

    return {
        "rollout/turns_mean": (float(sum(m["turns"] for m in firsts)), float(len(firsts))),
        "rollout/env_tokens_frac": (float(sum(m["env_tokens"] for m in firsts)),
                                    float(sum(s.response_length for s in samples))),
        "rollout/samples_per_trajectory_mean": (float(len(samples)), float(len(firsts))),
        "rollout/prefix_breaks": (float(sum(m["prefix_breaks"] for m in firsts)), 1.0),
        "rollout/env_errors": count(FAIL_ERROR),
        **{f"rollout/env_errors/{kind}": (float(faults.count(kind)), 1.0) for kind in FAULT_KINDS},
        "rollout/env_timeouts": count(FAIL_TIMEOUT),
        "rollout/trajectories_failed": (float(sum(e in (FAIL_ERROR, FAIL_TIMEOUT) for e in ends)), 1.0),
        "rollout/max_turns_ended": count(END_MAX_TURNS),
        "rollout/max_tokens_ended": count(END_MAX_TOKENS),
        "rollout/context_ended": count(END_CONTEXT),
    }


def check_failed_share(samples: list[Sample], *, max_failed_frac: float, reduce_sum=None, fix: str) -> None:
    """Raise when more than `max_failed_frac` of a multi-turn step's trajectories failed, or when failures before
    the first model turn left a data-parallel rank nothing to train on (`reduce_sum`: sums a tensor over the DP
    ranks, so every rank decides alike on the step's counts; None: this rank's own; `fix`: what to do)."""
    firsts = [s for s in samples if s.metadata["trajectory_sample"] == 0]  # one per trajectory
    failed = [s for s in firsts if s.metadata["end"] in (FAIL_ERROR, FAIL_TIMEOUT)]
    # This rank has no sample to train on, and failed trajectories are among the reasons (else: the engine's aborts,
    # which the datamodule names).
    starved = bool(failed) and all(s.status == SampleStatus.ABORTED for s in samples)
    counts = torch.tensor([float(len(failed)), float(len(firsts)), float(starved)], dtype=torch.float64)
    n_failed, total, n_starved = (reduce_sum(counts) if reduce_sum is not None else counts).tolist()
    first = (f"{failed[0].metadata.get('env_error_kind')}: {failed[0].metadata.get('env_error')}" if failed
             else "on another data-parallel rank")
    if n_failed > max_failed_frac * total:
        raise RuntimeError(
            f"{int(n_failed)} of {int(total)} trajectories failed this step (share {n_failed / total:.2f} > "
            f"rollout.step.max_failed_frac={max_failed_frac}); first failure: {first}; {fix}")
    if n_starved > 0:
        raise RuntimeError(
            f"{int(n_failed)} of {int(total)} trajectories failed this step, and a data-parallel rank has no model "
            f"token left to train on (its trajectories failed before their first model turn, or the engine aborted "
            f"them); first failure: {first}; {fix}")


def check_step_settings(*, max_turns: int, max_trajectory_tokens: int, max_failed_frac: float,
                        timeout: tuple[str, float]) -> None:
    """The budgets, failure share and timeout (`timeout`: its key under rollout.step and value) of a multi-turn
    step (`rollout.step.*`), refused naming the key."""
    for name, value in (("max_turns", max_turns), ("max_trajectory_tokens", max_trajectory_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"rollout.step.{name}={value!r} must be an integer >= 1")
    if not _is_number(max_failed_frac) or not 0 <= max_failed_frac <= 1:
        raise ValueError(f"rollout.step.max_failed_frac={max_failed_frac!r} must be a number in [0, 1] (the share of "
                         "a step's trajectories allowed to fail before the step raises)")
    name, seconds = timeout
    if not is_seconds(seconds, zero_ok=False):  # the bound the config check and the serving client's waits use
        raise ValueError(f"rollout.step.{name}={seconds!r} must be a finite number of seconds in (0, {MAX_WAIT_S:g}] "
                         "(a call past it fails its trajectory; without a bound a hung call would hang the run), "
                         "e.g. 30")


def check_context(*, max_trajectory_tokens: int, context: int | None) -> None:
    """Refuse a trajectory budget the model's context cannot hold (`context`: its max_position_embeddings; None:
    not known): a trajectory is its prompt (one token at least) and up to `max_trajectory_tokens` response tokens.
    A trajectory that reaches the context under a smaller budget ends there, truncated (`END_CONTEXT`)."""
    if context is not None and max_trajectory_tokens >= context:
        raise ValueError(f"rollout.max_trajectory_tokens={max_trajectory_tokens} does not fit the model's context of "
                         f"{context} tokens (max_position_embeddings), which also holds the prompt; set "
                         f"rollout.max_trajectory_tokens below {context} less the longest prompt")


def room_for_turn(ids: list[int], *, max_new_tokens: int, context: int | None) -> bool:
    """Whether a model turn of up to `max_new_tokens` on `ids` fits the model's context (None: not known)."""
    return context is None or len(ids) + max_new_tokens <= context


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
