"""`DataParallelCollectives`: sums, maxima and object gathers over the data-parallel (DP) ranks of a run.

A rollout step's totals (loss-token and sequence counts, batch-advantage moments, micro-batch counts) are sums
or maxima over DP ranks. The ranks that share one DP rank (its TP x CP peers, or replicas) hold the same
rollout, so each is reduced over its DP group: one rank of every DP rank. A world all-reduce divided by the
copies per DP rank equals it only while the copies agree bit for bit, and costs a larger collective.

The DP group is derived from what the datamodule already has, the DP rank / size and the `RolloutPeers`: a
rank's replica is its position among its peers (0 for the source; 0 when alone), and the DP group of replica
q holds every rank at position q. Under Megatron's rank order (tp-cp-dp) that is megatron-core's
data-parallel group without CP. Groups are created the way torch requires (every rank creates every group, in
one order). Local (no collective) when not distributed, at world size 1, or when there is one DP rank.

No autograd: these reduce plain statistics, never a tensor that needs a gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from topp_rl.parallel.peers import RolloutPeers


class DataParallelCollectives:
    """Collectives over this rank's DP group; `group=None`: local, each one returns its input."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    @classmethod
    def build(cls, *, dp_rank: int, dp_size: int, peers: RolloutPeers) -> DataParallelCollectives:
        """A collective over the world (every rank calls it) unless local: this rank's DP group."""
        if dp_size == 1 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(None)
        position = 0 if peers.group is None else dist.get_group_rank(peers.group, dist.get_rank())
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (dp_rank, position))
        replicas = dp_groups(everyone, dp_size=dp_size)
        if len(replicas) == 1:  # one rank per DP rank (DDP, FSDP): the world itself
            return cls(dist.group.WORLD)
        groups = {q: dist.new_group(ranks) for q, ranks in sorted(replicas.items())}
        return cls(groups[position])

    @property
    def is_local(self) -> bool:
        return self.group is None

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over DP ranks (a new tensor; `t` itself when local)."""
        if self.group is None:
            return t
        out = t.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def max(self, value: int) -> int:
        """The largest `value` of any DP rank."""
        if self.group is None:
            return value
        out = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return int(out)

    def gather_objects(self, obj: object) -> list:
        """Every DP rank's `obj` (picklable), in the order of the group's ranks; `[obj]` when local."""
        if self.group is None:
            return [obj]
        out: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out


def dp_groups(everyone: list[tuple[int, int]], *, dp_size: int) -> dict[int, list[int]]:
    """Global ranks of each DP group, by replica, from every rank's (DP rank, position among its peers). Each
    group must hold DP ranks 0 .. dp_size - 1 once (else the reduction would count a rollout twice or never)."""
    replicas: dict[int, list[int]] = {}
    for rank, (_, position) in enumerate(everyone):
        replicas.setdefault(position, []).append(rank)
    for position, ranks in replicas.items():
        held = sorted(everyone[r][0] for r in ranks)
        if held != list(range(dp_size)):
            raise ValueError(
                f"the ranks at position {position} among their rollout peers ({ranks}) hold DP ranks {held}, but "
                f"dp_size={dp_size} needs each of 0 .. {dp_size - 1} once; pass the trainer's data-parallel "
                "rank and size (leave dp_rank / dp_size unset) or a strategy that names each rank's TP x CP peers"
            )
    return replicas
