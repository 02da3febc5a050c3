"""THD packing of samples into micro-batches (`topp_rl.data.PackedBatch`) and the rollout step they form
(`RolloutBatch`).

Layout (docs/ARCHITECTURE.md): sequences (prompt + response) back to back with no padding; per response token
fields in sample order; candidates concatenated in sample order with EMPTY (= unrestricted) rows for samples
that recorded none and for non-trainable tokens; MoE routes (when recorded) aligned with the tokens, with a
NO_ROUTE row for each sequence's last token (never fed through the engine's model) and for samples without
routes. Packing is greedy in sample order under a token budget (deterministic, sequences never split), like
slime's, but without reordering samples by length.

`plan_step` is the one planner of a step's micro-batches: the greedy plan, then as many micro-batches as the
data-parallel rank with the most (`most`: a max over DP ranks), since every rank must run as many forwards.
"""

from collections.abc import Callable

import torch

from topp_rl.data import PackedBatch, Sample
from topp_rl.data.routes import NO_ROUTE
from topp_rl.ops import Candidates


def plan_micro_batches(seq_lengths: list[int], *, max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Greedy, in order: consecutive samples share a micro-batch while their tokens fit in `max_tokens`; then,
    while there are fewer than `min_count` micro-batches (data-parallel ranks must run the same number of
    forwards: FSDP gathers weights in each), the one with the most samples is halved, order kept."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= 1")
    groups: list[list[int]] = []
    used = max_tokens + 1
    for i, n in enumerate(seq_lengths):
        if n > max_tokens:
            raise ValueError(
                f"sample {i} has {n} tokens (prompt + response), more than the micro-batch budget max_tokens="
                f"{max_tokens}; sequences are never split: raise max_tokens_per_micro_batch to at least {n} "
                "or lower max_new_tokens"
            )
        if used + n > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    while len(groups) < min_count:
        j = max(range(len(groups)), key=lambda k: len(groups[k]))
        if len(groups[j]) < 2:
            raise ValueError(
                f"{len(seq_lengths)} samples cannot fill the {min_count} micro-batches this step needs (every "
                "data-parallel rank runs as many as the one that packed the most; the interleaved pipeline schedule "
                "at least parallel.pp_size); raise data.max_tokens_per_micro_batch so that fewer micro-batches are "
                "needed (with virtual pipeline stages: draw at least parallel.pp_size samples per data-parallel "
                "rank, or set parallel.vpp_size=1)"
            )
        half = len(groups[j]) // 2
        groups[j : j + 1] = [groups[j][:half], groups[j][half:]]
    return groups


def plan_step(samples: list[Sample], *, max_tokens: int, most: Callable[[int], int] | None = None
              ) -> list[list[int]]:
    """Sample indices of each micro-batch: greedy under `max_tokens`, then split to `most(count)` micro-batches,
    `most` giving the largest count of any DP rank (a collective; None: this rank alone)."""
    lengths = sequence_lengths(samples)
    plan = plan_micro_batches(lengths, max_tokens=max_tokens)
    count = len(plan) if most is None else most(len(plan))
    return plan if count <= len(plan) else plan_micro_batches(lengths, max_tokens=max_tokens, min_count=count)


def pack_samples(
    samples: list[Sample],
    advantages: list[float] | torch.Tensor,
    *,
    max_tokens: int,
    num_loss_tokens_global: float | None = None,
    num_sequences_global: int | None = None,
    most: Callable[[int], int] | None = None,
    trained_version: int | None = None,
) -> list[PackedBatch]:
    """Micro-batches of `samples` (in order) under `max_tokens` (`plan_step`); `advantages` is one value per
    sample.

    The global denominators default to this call's own totals (one DP rank); the datamodule passes the values
    summed over all DP ranks, and `most` (the max over DP ranks) for the micro-batch count. `trained_version`: the
    weight version this step trains, against which each token's staleness is counted (None: on-policy, all 0).
    """
    adv = torch.as_tensor(advantages, dtype=torch.float32).flatten()
    if adv.numel() != len(samples):
        raise ValueError(
            f"{adv.numel()} advantages for {len(samples)} samples; pass one advantage per sample"
        )
    for s in samples:
        s.check_lengths()
    if num_loss_tokens_global is None:
        num_loss_tokens_global = float(sum(sum(s.loss_mask) for s in samples))
    if num_sequences_global is None:
        num_sequences_global = len(samples)
    plan = plan_step(samples, max_tokens=max_tokens, most=most)
    return [
        _pack([samples[i] for i in idx], adv[idx], float(num_loss_tokens_global), int(num_sequences_global),
              trained_version)
        for idx in plan
    ]


def sequence_lengths(samples: list[Sample]) -> list[int]:
    return [len(s.prompt_ids) + s.response_length for s in samples]


def token_staleness(samples: list[Sample], trained_version: int) -> torch.Tensor:
    """int64 [R]: per response token, in sample order, the weight updates between its version and `trained_version`."""
    versions = torch.tensor([v for s in samples for v in s.token_versions()], dtype=torch.int64)
    return trained_version - versions


def _pack(samples: list[Sample], adv: torch.Tensor, loss_tokens: float, sequences: int,
          trained_version: int | None) -> PackedBatch:
    prompt_len = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
    resp_len = torch.tensor([s.response_length for s in samples], dtype=torch.long)
    seq_len = prompt_len + resp_len
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = seq_len.cumsum(0)
    starts = torch.repeat_interleave(cu[:-1].long(), seq_len)
    response_tokens = torch.tensor([t for s in samples for t in s.response_ids], dtype=torch.long)
    loss_mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float32)
    return PackedBatch(
        tokens=torch.tensor([t for s in samples for t in s.prompt_ids + s.response_ids], dtype=torch.long),
        cu_seqlens=cu,
        seq_lengths=seq_len,
        response_lengths=resp_len,
        position_ids=torch.arange(int(seq_len.sum())) - starts,
        loss_mask=loss_mask,
        advantages=torch.repeat_interleave(adv, resp_len),
        rollout_log_probs=torch.tensor(
            [x for s in samples for x in s.rollout_log_probs], dtype=torch.float32
        ),
        response_tokens=response_tokens,
        candidates=_candidates(samples, loss_mask),
        routes=_routes(samples),
        staleness=None if trained_version is None else token_staleness(samples, trained_version),
        rewards=torch.tensor(
            [0.0 if s.reward is None else float(s.reward) for s in samples], dtype=torch.float32
        ),
        group_index=torch.tensor([s.group_index for s in samples], dtype=torch.long),
        sample_index=torch.tensor([s.index for s in samples], dtype=torch.long),
        num_loss_tokens_global=loss_tokens,
        num_sequences_global=sequences,
    )


def _routes(samples: list[Sample]) -> torch.Tensor | None:
    """int16 [T, L, k] in token order: each sample's routes, then a NO_ROUTE row for its last token."""
    shapes = {tuple(s.routes.shape[1:]) for s in samples if s.routes is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"samples carry routes of different (moe_layers, top_k) shapes {sorted(shapes)}; "
                         "every sample of a step must come from the same model")
    (shape,) = shapes
    rows = []
    for s in samples:
        fed = len(s.prompt_ids) + s.response_length - 1
        own = s.routes.to(torch.int16) if s.routes is not None else torch.full((fed, *shape), NO_ROUTE,
                                                                               dtype=torch.int16)
        rows += [own, torch.full((1, *shape), NO_ROUTE, dtype=torch.int16)]
    return torch.cat(rows)


def _candidates(samples: list[Sample], loss_mask: torch.Tensor) -> Candidates | None:
    """Rows in sample order; empty rows for samples without candidates and for non-trainable tokens."""
    if all(s.candidates is None for s in samples):
        return None
    cands = Candidates.concat(
        [s.candidates if s.candidates is not None else Candidates.empty(s.response_length) for s in samples]
    )
    trainable = loss_mask > 0
    if bool(trainable.all()) or not bool((cands.row_lengths()[~trainable] > 0).any()):
        return cands
    # Some non-trainable token carries a set: blank it (vectorised), so only trainable rows restrict anything.
    lengths = cands.row_lengths() * trainable
    offsets = torch.zeros(cands.num_rows + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    ids = cands.ids[trainable[cands.row_of_ids()]]
    return Candidates(ids=ids, offsets=offsets.to(torch.int32))
