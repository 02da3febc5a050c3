"""`DataParallelCollectives` on 4 gloo ranks (one spawn, every layout): sums, maxima and gathers run over the
data-parallel group, derived from the DP rank and the TP x CP peers. The ranks of one peer group hold DIFFERENT
values here, so the old reduction (a world sum divided by the copies per DP rank, which assumed equal copies)
is wrong and the DP reduction is right; and a datamodule's rollout under TP peers sums its denominators over
DP ranks."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.parallel.collectives import DataParallelCollectives
from topp_rl.parallel.peers import RolloutPeers
from topp_rl.rollout import RolloutDataModule, SamplingParams
from topp_rl.tasks import CopyDigitTask

WORLD = 4
TOK = build_char_tokenizer()


def _peer_groups() -> dict[str, list[list[int]]]:
    """Peer groups of each layout (ranks that share one rollout); every rank creates every group, in order."""
    return {"tp2": [[0, 1], [2, 3]],  # Megatron order: TP fastest, DP rank = rank // 2
            "strided": [[0, 2], [1, 3]],  # peers that are not neighbours: DP rank = rank % 2
            "tp2_cp2": [[0, 1, 2, 3]]}  # one DP rank: the reduction is local


def _peers(layout: str, groups: dict) -> RolloutPeers:
    rank = dist.get_rank()
    (ranks,) = [r for r in _peer_groups()[layout] if rank in r]
    group = groups[layout, tuple(ranks)]
    return RolloutPeers(group=group, source=dist.get_global_rank(group, 0))


def _reduce(dp: DataParallelCollectives, value: float) -> dict:
    rank = dist.get_rank()
    return {"sum": dp.sum(torch.tensor([value], dtype=torch.float64)).item(), "max": dp.max(rank),
            "gather": dp.gather_objects(f"r{rank}"), "local": dp.is_local}


def _old_formula(value: float, dp_size: int) -> float:
    """What `_dp_sum` computed before: the world sum divided by the ranks per DP rank."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return (t / (dist.get_world_size() // dp_size)).item()


def _rollout_under_tp_peers(groups: dict) -> dict:
    """A real datamodule step with TP=2 peers and DP=2: the sources generate, their peers receive the samples."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine = EmbeddedEngine(build_tiny_model(tokenizer=TOK, seed=0, initializer_range=0.2), progress=False)
    dm = RolloutDataModule(engine=engine, task=CopyDigitTask(), tokenizer=TOK,
                           params=SamplingParams(top_p=0.9, max_new_tokens=3, n=3), prompts_per_step=4,
                           max_tokens_per_micro_batch=24, dp_rank=rank // 2, dp_size=2)
    dm.peers = _peers("tp2", groups)  # what `setup` asks a SharesRollouts strategy for
    batch = dm.rollout(dm.ticket(0))
    return {"loss_tokens": sum(sum(s.loss_mask) for s in batch.samples), "count": len(batch.samples),
            "denominators": {(mb.num_loss_tokens_global, mb.num_sequences_global) for mb in batch.micro_batches},
            "micro_batches": len(batch.micro_batches)}


def rank_main(rank: int) -> dict:
    groups = {(layout, tuple(ranks)): dist.new_group(ranks)
              for layout, layout_groups in _peer_groups().items() for ranks in layout_groups}
    value = 10.0 ** rank  # different on every rank, peers included
    out = {}
    for layout, dp_rank, dp_size in (("tp2", rank // 2, 2), ("strided", rank % 2, 2), ("tp2_cp2", 0, 1)):
        dp = DataParallelCollectives.build(dp_rank=dp_rank, dp_size=dp_size, peers=_peers(layout, groups))
        out[layout] = _reduce(dp, value) | {"old": _old_formula(value, dp_size)}
    out["ddp"] = _reduce(DataParallelCollectives.build(dp_rank=rank, dp_size=WORLD, peers=RolloutPeers()), value)
    try:  # 4 ranks alone, told there are 2 DP ranks: DP rank 0 twice in one group
        DataParallelCollectives.build(dp_rank=rank // 2, dp_size=2, peers=RolloutPeers())
    except ValueError as err:
        out["refused"] = str(err)
    out["rollout"] = _rollout_under_tp_peers(groups)
    return out


@pytest.mark.distributed
def test_sums_maxima_and_gathers_run_over_the_data_parallel_group():
    ranks = run_distributed(rank_main, WORLD)
    # TP=2: DP groups {0, 2} and {1, 3} (one rank of each DP rank, at the same position among its peers).
    tp2 = [r["tp2"] for r in ranks]
    assert [r["sum"] for r in tp2] == [101.0, 1010.0, 101.0, 1010.0]
    assert [r["old"] for r in tp2] == [555.5] * 4  # 1111 / 2: right only if the peers' values were equal
    assert [r["max"] for r in tp2] == [2, 3, 2, 3]
    assert [r["gather"] for r in tp2] == [["r0", "r2"], ["r1", "r3"], ["r0", "r2"], ["r1", "r3"]]
    # Peers {0, 2} and {1, 3}: the DP groups are {0, 1} and {2, 3}.
    strided = [r["strided"] for r in ranks]
    assert [r["sum"] for r in strided] == [11.0, 11.0, 1100.0, 1100.0]
    assert [r["gather"] for r in strided] == [["r0", "r1"], ["r0", "r1"], ["r2", "r3"], ["r2", "r3"]]
    # TP x CP = 4, one DP rank: nothing to reduce (the old formula averaged the four peers: 1111 / 4).
    assert [(r["tp2_cp2"]["sum"], r["tp2_cp2"]["local"]) for r in ranks] == [(10.0 ** k, True) for k in range(4)]
    assert [r["tp2_cp2"]["old"] for r in ranks] == [277.75] * 4
    assert [r["tp2_cp2"]["gather"] for r in ranks] == [[f"r{k}"] for k in range(4)]
    # Every rank its own DP rank: the world.
    assert [r["ddp"]["sum"] for r in ranks] == [1111.0] * 4 and [r["ddp"]["max"] for r in ranks] == [3] * 4
    assert ranks[0]["ddp"]["gather"] == ["r0", "r1", "r2", "r3"]
    assert [r["refused"] for r in ranks] == [
        "the ranks at position 0 among their rollout peers ([0, 1, 2, 3]) hold DP ranks [0, 0, 1, 1], but "
        "dp_size=2 needs each of 0 .. 1 once; pass the trainer's data-parallel rank and size (leave dp_rank / "
        "dp_size unset) or a strategy that names each rank's TP x CP peers"] * 4
    # The datamodule under TP=2 peers: both peers of a DP rank hold its rollout; denominators span both DP ranks.
    rollout = [r["rollout"] for r in ranks]
    assert rollout[0]["loss_tokens"] == rollout[1]["loss_tokens"] and rollout[2]["loss_tokens"] == rollout[3]["loss_tokens"]
    total = float(rollout[0]["loss_tokens"] + rollout[2]["loss_tokens"])
    assert all(r["denominators"] == {(total, 12)} and r["count"] == 6 for r in rollout)
    assert len({r["micro_batches"] for r in rollout}) == 1
