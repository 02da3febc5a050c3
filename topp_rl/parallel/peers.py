"""`RolloutPeers`: the ranks that train on one rollout (the tensor- and context-parallel peers of a data-parallel
rank) and their source, the one rank that generates for them."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class RolloutPeers:
    """The ranks that share this rank's rollouts: `group` (None when alone) and the global rank of its source."""

    group: dist.ProcessGroup | None = None
    source: int = 0

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def is_source(self) -> bool:
        return self.group is None or dist.get_rank() == self.source
