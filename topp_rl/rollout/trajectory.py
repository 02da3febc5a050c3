"""One multi-turn trajectory of the agent loop (`topp_rl.rollout.agent_step`): a single `Sample` whose response
holds the model's turns (trainable, with their recorded log-probs and candidate sets) and the environment's
output between them (loss mask 0, log-prob 0, empty = unrestricted candidate rows), and the rules that end it.

The token rule: the running ids (`sample.tokens`: the prompt, then every earlier turn's exact ids) are what the
engine is given for the next turn, so nothing is ever re-tokenised; environment text is tokenised once, here.

MoE routes: an engine records routes per `generate` call, for every token that call fed through the model (its
prompt, i.e. the whole transcript so far, and its response but the last token). The last model turn's call
therefore covers every earlier turn, the environment's tokens included; the trajectory keeps that call's routes,
cut to the sample (`trajectory_routes`). The embedded engine recomputes the prefix each call; SGLang 0.5.23
reads a cached prefix's routes from the KV slots' capture (`srt/state_capturer`), i.e. the forward whose KV
later tokens attended to. A trajectory that holds environment tokens after its last model turn (it failed after
them) goes without routes (the trainer routes it itself, as packing does for any sample without routes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from topp_rl.data import PromptRecord
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.tasks.environment import EnvOutput, Episode, ModelTurn

# Why a trajectory ended: the episode ended it, a budget, or the engine aborted it (never trained on) ...
END_ENV, END_MAX_TURNS, END_MAX_TOKENS, END_ABORTED = "env", "max_turns", "max_tokens", "aborted"
# ... or it failed (reward 0, counted in rollout/trajectories_failed).
FAIL_ERROR, FAIL_TIMEOUT, FAIL_PREFIX = "env_error", "env_timeout", "prefix_break"


@dataclass(eq=False)
class Trajectory:
    record: PromptRecord
    sample: Sample
    episode: Episode | None = None
    turns: int = 0
    env_tokens: int = 0
    end: str | None = None  # None while it runs
    error: str | None = None  # the failure's message
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    routes: torch.Tensor | None = None  # the latest model turn's call's routes (MoE engines that record them)

    @property
    def live(self) -> bool:
        return self.end is None

    @property
    def failed(self) -> bool:
        return self.end in (FAIL_ERROR, FAIL_TIMEOUT, FAIL_PREFIX)

    def fail(self, kind: str, message: str) -> None:
        self.end, self.error = kind, message

    def add_model_turn(self, out: Sample, sent: list[int], *, max_tokens: int, tokenizer: Any) -> ModelTurn | None:
        """Append the engine's turn (cut to the token budget); None when the engine did not answer `sent` itself
        (a prefix break: its log-probs would be conditioned on other ids) or aborted."""
        if out.prompt_ids != sent:
            self.fail(FAIL_PREFIX, f"the engine answered {len(out.prompt_ids)} prompt ids, not the {len(sent)} sent")
            return None
        if out.status == SampleStatus.ABORTED:
            self.sample.status, self.end = SampleStatus.ABORTED, END_ABORTED
            self.sample.metadata["finish_reason"] = out.metadata.get("finish_reason")
            return None
        keep = min(out.response_length, max_tokens - self.sample.response_length)  # budget cuts are exact
        ids = out.response_ids[:keep]
        self.sample.append_response_tokens(
            ids, out.rollout_log_probs[:keep], out.candidates[:keep] if out.candidates is not None else None,
            raw_log_probs=out.rollout_raw_log_probs[:keep] if out.rollout_raw_log_probs is not None else None)
        self.turns += 1
        if out.routes is not None:
            self.routes = out.routes
        finished = out.status == SampleStatus.COMPLETED and keep == out.response_length
        return ModelTurn(index=self.turns - 1, ids=ids, text=tokenizer.decode(ids, skip_special_tokens=True),
                         finished=finished)

    def add_env_output(self, output: EnvOutput, *, max_turns: int, max_tokens: int, tokenizer: Any,
                       vocab_size: int) -> None:
        """The episode's answer to the latest turn: end on None or a budget, else append its tokens."""
        if output is None:
            self.end = END_ENV
            return
        ids = _env_ids(output, tokenizer, vocab_size)
        if self.turns >= max_turns:
            self._end_on_budget(END_MAX_TURNS)
        elif self.sample.response_length + len(ids) >= max_tokens:  # no room left for a model token after it
            self._end_on_budget(END_MAX_TOKENS)
        else:
            self.sample.append_response_tokens(ids, trainable=False)
            self.env_tokens += len(ids)

    def _end_on_budget(self, reason: str) -> None:
        self.end = reason
        self.sample.status = SampleStatus.TRUNCATED

    def finish(self, *, trajectory: int) -> Sample:
        """The trajectory's sample (`trajectory`: its number in the step), its figures in `metadata` (read by
        `AgentLoopStep.score` and `stats`)."""
        if self.routes is not None:
            self.sample.routes = trajectory_routes(self.routes, fed=len(self.sample.tokens) - 1)
        meta = self.sample.metadata
        meta |= {"trajectory": trajectory, "turns": self.turns, "env_tokens": self.env_tokens, "end": self.end,
                 "env_reward": self.reward}
        if self.error is not None:
            meta["env_error"] = self.error
        if self.reward_info:
            meta["env_reward_info"] = self.reward_info
        return self.sample


def trajectory_routes(last_call: torch.Tensor, *, fed: int) -> torch.Tensor | None:
    """The routes of a trajectory's `fed` tokens (prompt + response - 1) from its last model turn's call, cut when
    a budget cut that turn (a token's route depends only on the tokens up to it); None when environment tokens
    came after that call (a failed trajectory: the call never saw them)."""
    return last_call[:fed].clone() if last_call.shape[0] >= fed else None


def _env_ids(output: EnvOutput, tokenizer: Any, vocab_size: int) -> list[int]:
    """Environment output as token ids: text tokenised once (no special tokens added), ids checked."""
    if isinstance(output, str):
        return list(tokenizer.encode(output, add_special_tokens=False))
    ids = [int(t) for t in output]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"the environment answered token ids {bad[:5]} outside the vocabulary [0, {vocab_size}); "
                         "answer text, or ids of the policy's tokenizer")
    return ids
