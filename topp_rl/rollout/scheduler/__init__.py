"""Rollouts ahead of training (`rollout.max_staleness=K`): generation runs up to K weight updates ahead of the step
that trains it, into a buffer of finished steps.

- K = 0 (the default): on-policy, each step generated in place right before it trains (no scheduler at all).
- K = 1 (`rollout.overlap=true` means the same): step k + 1 is generated while step k trains.
- K > 1: the generations of steps k + 1 .. k + K are in flight while step k trains. The generation of step s
  starts when step s - K's rollout is taken, by which time the weights step s - K trains are in the engine, so
  every token of step s was sampled at most K updates before the weights that train it.

Parts: `ahead.RolloutScheduler` (the generations in flight, keyed by step; checkpoint state),
`staleness` (the per-group staleness rule, which drops a group with a token older than K updates, and the
`rollout/staleness_*` metrics). The engine wrapper that counts weight versions and lets updates meet the
generations in flight is `topp_rl.engines.VersionedEngine`; with `rollout.partial_rollouts=true` responses in
flight continue across an update (`topp_rl.engines.base.InFlightUpdates`) and record each token's version.
"""

from topp_rl.rollout.scheduler.ahead import RolloutScheduler, versioned
from topp_rl.rollout.scheduler.staleness import check_staleness_key, drop_stale_groups, staleness_stats

__all__ = ["RolloutScheduler", "check_staleness_key", "drop_stale_groups", "staleness_stats", "versioned"]
