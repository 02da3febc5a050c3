"""The rollout metrics a training step logs, as (sum, count) pairs (reduced across ranks once per step by the
callbacks). Every rank returns the same keys: TP x CP peers of a source count 0 where only the source measured."""

from topp_rl.data import PackedBatch
from topp_rl.data.sample import Sample
from topp_rl.engines.versioned import VersionedEngine
from topp_rl.parallel.peers import RolloutPeers

Stats = dict[str, tuple[float, float]]


def step_stats(samples: list[Sample], micro: list[PackedBatch], *, generate_s: float, dropped: int,
               groups: int) -> Stats:
    return {
        "perf/generate_s": (generate_s, 1.0),
        "perf/generate_tokens_per_s": (sum(s.response_length for s in samples) / max(generate_s, 1e-9), 1.0),
        "rollout/dropped_group_frac": (float(dropped), float(groups)),
        "rollout/num_micro_batches": (float(len(micro)), 1.0),
        # Samples whose kept set outgrew rollout.max_candidates: aborted by the engine, never truncated.
        "rollout/candidate_overflow_frac": (float(sum(bool(s.metadata.get("candidate_overflow")) for s in samples)),
                                            float(len(samples))),
    }


def group_stats(groups: dict[str, float], *, refill_rounds: int | None) -> Stats:
    """`data.drop_zero_variance_groups=true`: the step's prompt groups over all DP ranks (`groups`: DP-global counts,
    the same on every rank, so the mean over ranks keeps them). generated = trained + filtered + surplus.
    `refill_rounds`: with `data.refill=true`, the rounds after the step's own generation."""
    stats = {f"rollout/groups_{key}": (groups[key], 1.0) for key in ("generated", "filtered", "trained")}
    if refill_rounds is None:
        return stats
    return stats | {
        "rollout/groups_surplus": (groups["surplus"], 1.0),  # informative groups past prompts_per_step, left out
        "rollout/refill_rounds": (float(refill_rounds), 1.0),
        # 1 when a DP rank stopped at data.max_refill_factor short of its share: the step trained fewer groups.
        "rollout/refill_capped": (float(groups["capped_ranks"] > 0), 1.0),
    }


def ahead_stats(own: list[Sample] | None, engine: VersionedEngine | None, *, wait_s: float) -> Stats:
    """Rollouts ahead (`rollout.max_staleness >= 1`): the wait for the step generated ahead, and how many updates
    old its samples' oldest tokens are (`own`: the source's samples, None on a peer)."""
    if own is None:
        return {"perf/rollout_wait_s": (0.0, 0.0), "rollout/weight_staleness": (0.0, 0.0)}
    return {"perf/rollout_wait_s": (wait_s, 1.0),
            "rollout/weight_staleness": (float(sum(engine.version - s.weight_version for s in own)), float(len(own)))}


def share_stats(peers: RolloutPeers, *, share_s: float, shared_bytes: int) -> Stats:
    """The TP x CP broadcast's cost, measured on the source."""
    return {"perf/rollout_share_s": (share_s if peers.is_source else 0.0, float(peers.is_source)),
            "perf/rollout_share_bytes": (float(shared_bytes), float(peers.is_source))}
