"""Data-parallel sources whose engines reach the same SGLang workers (given `urls` / `router_url`): the first
source pushes the weights for all, the others wait for it (`topp_rl.engines.shared.SharedWorkersEngine`).

Two sources pushing on their own crashed SGLang 0.5.23 (overlapping `/update_weights_from_disk` calls:
`InvalidStateError` in its tokenizer manager), and a push pauses the server with "abort", cancelling another
rank's rollout in flight.
"""

import torch.distributed as dist

from topp_rl.engines.base import RolloutEngine
from topp_rl.parallel.peers import RolloutPeers


def shared_workers(engine: RolloutEngine | None, peers: RolloutPeers, *, max_staleness: int) -> dict | None:
    """Called on every rank (a collective). The `SharedWorkersEngine` arguments for this source when the sources
    share workers (`pushes`: whether it is the one that pushes; `group`: the sources), else None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    mine = (peers.is_source, engine is not None and engine.shared_by_ranks)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    sources = [rank for rank, (is_source, _) in enumerate(everyone) if is_source]
    if len(sources) < 2 or not any(shared for _, shared in everyone):
        return None
    if max_staleness:
        raise ValueError(
            f"rollout.max_staleness={max_staleness} generates the next steps while this one trains, but the "
            f"{len(sources)} data-parallel ranks share their SGLang servers (rollout.engine.urls / router_url), so "
            "one rank's weight push would land in another's rollouts at a moment that rank does not know; set "
            "rollout.max_staleness=0 (and rollout.overlap=false), or let each rank launch its own servers (drop "
            "urls / router_url)"
        )
    group = dist.new_group(sources)  # every rank creates it, as torch requires
    return {"pushes": dist.get_rank() == sources[0], "group": group} if peers.is_source else None
