"""`Sample`: one prompt and its generated response, with everything training needs to score it exactly.

Per response token: the token id, a loss-mask bit, the log-prob of the sampled token under the truncated,
renormalised distribution it was drawn from, optionally the raw (full-vocabulary, temperature-scaled) log-prob,
and the candidate set the sampler kept (one `Candidates` row per token). An EMPTY candidate row means
"unrestricted"; it is only used as a placeholder for non-trainable tokens (tool output in multi-turn rollouts).
MoE models may add `routes`: per token fed through the model (prompt + response - 1), the experts every MoE layer
picked (`topp_rl.data.routes`); the engine sets them once the response is complete.
Unlike slime's Sample, the per-token fields can only grow together, through `append_response_tokens`.
"""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from topp_rl.data.routes import MoeRouting
from topp_rl.ops import Candidates
from topp_rl.ops.candidates import rows_missing_token


class SampleStatus(StrEnum):
    COMPLETED = "completed"  # stopped on EOS or a stop id
    TRUNCATED = "truncated"  # cut by max_new_tokens
    ABORTED = "aborted"  # the engine gave up (request failed); never trained on


@dataclass(eq=False, kw_only=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    rollout_raw_log_probs: list[float] | None = None
    candidates: Candidates | None = None
    # integer [len(tokens) - 1, moe_layers, top_k]: the routed experts (`MoeRouting.check` validates the ids)
    routes: torch.Tensor | None = None
    reward: float | None = None
    # Set by the pipeline (`number_samples`), not by engines: the prompt's and the sample's place in the step.
    group_index: int = 0
    index: int = 0
    status: SampleStatus = SampleStatus.COMPLETED
    metadata: dict[str, Any] = field(default_factory=dict)
    # Which weights sampled it: the number of weight updates its engine had received (`VersionedEngine`); with
    # per-token versions, the oldest of them.
    weight_version: int = 0
    # Per response token, the version of the weights that sampled it, where a response spans weight updates
    # (partial rollouts: `topp_rl.engines.base.InFlightUpdates`). None: every token was sampled by `weight_version`.
    weight_versions: list[int] | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        self.status = SampleStatus(self.status)
        self.check_lengths()

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def token_versions(self) -> list[int]:
        """The weight version of every response token."""
        if self.weight_versions is None:
            return [self.weight_version] * self.response_length
        return self.weight_versions

    def set_token_versions(self, versions: list[int]) -> None:
        """Record each response token's weight version; `weight_version` becomes the oldest (None-equivalent when
        they are all one version)."""
        versions = [int(v) for v in versions]
        if len(versions) != self.response_length:
            raise ValueError(f"{self._name()}: {len(versions)} weight versions for {self.response_length} response "
                             "tokens; record one per token")
        if versions:
            self.weight_version = min(versions)
        self.weight_versions = versions if len(set(versions)) > 1 else None

    @property
    def spans_versions(self) -> bool:
        """Its response was sampled by more than one weight version (a partial rollout across an update)."""
        return self.weight_versions is not None and len(set(self.weight_versions)) > 1

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append_response_tokens(
        self,
        tokens: list[int],
        log_probs: list[float] | None = None,
        candidates: Candidates | None = None,
        trainable: bool = True,
        *,
        raw_log_probs: list[float] | None = None,
        versions: list[int] | None = None,
    ) -> None:
        """Append response tokens (one turn, or a streamed chunk).

        Trainable tokens need `log_probs`, and `candidates` (one row each, holding the token) when this sample
        records candidates. Non-trainable tokens (tool output) must pass neither; they get loss mask 0, log-prob
        0.0 and empty candidate rows. `versions`: the weight version of each new token (a turn sampled across an
        update); left out, the new tokens take the newest version recorded so far.
        """
        tokens = [int(t) for t in tokens]
        n = len(tokens)
        if versions is not None and len(versions) != n:
            raise ValueError(f"{self._name()}: {n} tokens but {len(versions)} weight versions")
        if self.routes is not None and n:
            raise ValueError(
                f"{self._name()}: it carries routes for its first {self.routes.shape[0]} tokens; append every "
                "response token first, then set routes (the engine records them once the response is complete)"
            )
        if trainable:
            self._check_trainable_args(tokens, log_probs, candidates, raw_log_probs)
        elif log_probs is not None or candidates is not None or raw_log_probs is not None:
            raise ValueError(
                f"{self._name()}: non-trainable tokens must not carry log_probs / candidates / raw_log_probs; "
                "pass trainable=True for tokens the policy sampled"
            )
        # Start recording candidates on the first trainable chunk that has them; earlier tokens can only be
        # non-trainable (checked in _check_trainable_args), so empty placeholder rows are exact for them.
        earlier = self.token_versions()  # before the tokens grow
        if self.candidates is None and candidates is not None:
            self.candidates = Candidates.empty(self.response_length)
        if self.rollout_raw_log_probs is None and raw_log_probs is not None:
            self.rollout_raw_log_probs = [0.0] * self.response_length
        self.response_ids.extend(tokens)
        self.loss_mask.extend([int(trainable)] * n)
        self.rollout_log_probs.extend([float(x) for x in log_probs] if trainable else [0.0] * n)
        if self.rollout_raw_log_probs is not None:
            self.rollout_raw_log_probs.extend(
                [float(x) for x in raw_log_probs] if raw_log_probs is not None else [0.0] * n
            )
        if self.candidates is not None:
            new_rows = candidates if candidates is not None else Candidates.empty(n)
            self.candidates = Candidates.concat([self.candidates, new_rows])
        if versions is not None or self.weight_versions is not None:
            latest = max(earlier, default=self.weight_version)
            self.weight_versions = None  # set_token_versions checks the whole list against the new length
            self.set_token_versions(earlier + ([int(v) for v in versions] if versions is not None else [latest] * n))
        self.check_lengths()

    def _check_trainable_args(
        self,
        tokens: list[int],
        log_probs: list[float] | None,
        candidates: Candidates | None,
        raw_log_probs: list[float] | None,
    ) -> None:
        n = len(tokens)
        if log_probs is None or len(log_probs) != n:
            got = None if log_probs is None else len(log_probs)
            raise ValueError(f"{self._name()}: {n} trainable tokens need {n} log_probs, got {got}")
        if raw_log_probs is not None and len(raw_log_probs) != n:
            raise ValueError(f"{self._name()}: {n} tokens but {len(raw_log_probs)} raw_log_probs")
        has_trainable = any(self.loss_mask)
        if self.rollout_raw_log_probs is not None and raw_log_probs is None and n:
            raise ValueError(
                f"{self._name()}: this sample records raw log-probs; pass raw_log_probs for trainable tokens"
            )
        if candidates is None:
            if self.candidates is not None and n:
                raise ValueError(
                    f"{self._name()}: this sample records candidate sets; pass candidates for its trainable tokens"
                )
            return
        if self.candidates is None and has_trainable:
            raise ValueError(
                f"{self._name()}: earlier trainable tokens have no candidate sets, so later ones cannot add them; "
                "record candidates for every generated turn or for none"
            )
        if candidates.num_rows != n:
            raise ValueError(f"{self._name()}: {n} tokens but candidates have {candidates.num_rows} rows")
        missing = rows_missing_token(candidates, torch.tensor(tokens, dtype=torch.long))
        if missing.numel():
            i = int(missing[0])
            raise ValueError(
                f"{self._name()}: sampled token {tokens[i]} at chunk position {i} is missing from its candidate row; "
                "the sampled token is always in the set the sampler kept"
            )

    def check_lengths(self) -> None:
        """Raise ValueError unless every per-token field has `response_length` entries."""
        r = self.response_length
        lengths = {"loss_mask": len(self.loss_mask), "rollout_log_probs": len(self.rollout_log_probs)}
        if self.rollout_raw_log_probs is not None:
            lengths["rollout_raw_log_probs"] = len(self.rollout_raw_log_probs)
        if self.weight_versions is not None:
            lengths["weight_versions"] = len(self.weight_versions)
        if self.candidates is not None:
            lengths["candidates rows"] = self.candidates.num_rows
        if self.routes is not None:
            fed = len(self.prompt_ids) + r - 1  # the last token is never fed through the model
            if self.routes.dim() != 3 or self.routes.shape[0] != fed:
                raise ValueError(
                    f"{self._name()}: routes have shape {tuple(self.routes.shape)}, expected ({fed}, moe_layers, "
                    f"top_k): one row per token fed through the model (prompt {len(self.prompt_ids)} + response "
                    f"{r} - 1)"
                )
        bad = {k: v for k, v in lengths.items() if v != r}
        if bad:
            detail = ", ".join(f"{k}={v}" for k, v in bad.items())
            raise ValueError(
                f"{self._name()}: response_length={r} but {detail}; every per-token field needs one entry per "
                "response token (candidate offsets: response_length + 1)"
            )

    def check_routes(self, routing: MoeRouting) -> None:
        """Raise ValueError, naming this sample, the layer and the token, unless `routes` (when set) fit
        `routing`: one row per fed token, its MoE layers, top_k ids in [0, num_experts) each."""
        if self.routes is not None:
            routing.check(self.routes, tokens=len(self.prompt_ids) + self.response_length - 1, name=self._name())

    def _name(self) -> str:
        return f"Sample(index={self.index}, group={self.group_index})"


def number_samples(samples: list[Sample], *, prompts: int, n: int, first_group: int = 0) -> list[Sample]:
    """Number an engine's output in place: `n` samples per prompt, prompt-major (the `RolloutEngine` contract).
    Sample i is `first_group * n + i` and belongs to prompt `first_group + i // n` (step-global numbers when a
    data-parallel rank's prompts start at `first_group`)."""
    if len(samples) != prompts * n:
        raise ValueError(
            f"engine returned {len(samples)} samples for {prompts} prompts x n={n}; a RolloutEngine returns n "
            "samples per prompt, prompt-major"
        )
    for i, s in enumerate(samples):
        s.index, s.group_index = first_group * n + i, first_group + i // n
    return samples
