"""megatron-core interop on gloo: `ParallelLayout.from_megatron` reads Megatron's TP/CP/PP groups correctly, and our
vocab-parallel log-prob equals -`megatron.core.tensor_parallel.vocab_parallel_cross_entropy` (values and
gradients w.r.t. the vocab-sharded logits). One spawn of 4 ranks runs every (tp, cp) grid.
"""

import importlib.util

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from topp_rl.ops import token_logprobs
from topp_rl.parallel import ParallelLayout

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="megatron-core (the `megatron` extra) is not installed"),
]

WORLD = 4
VOCAB = 96
GRIDS = [(2, 2, "zigzag"), (4, 1, "allgather"), (1, 2, "allgather"), (2, 1, "zigzag")]  # (tp, cp, cp_mode)
TEMPERATURES = (1.0, 0.8)


def expected_coords(rank, tp, cp):
    """Megatron's default order "tp-cp-ep-dp-pp": rank = tp_rank + tp * (cp_rank + cp * dp_rank)."""
    tp_rank, cp_rank, dp_rank = rank % tp, rank // tp % cp, rank // (tp * cp)
    base = dp_rank * tp * cp
    tp_ranks = [base + cp_rank * tp + t for t in range(tp)]
    cp_ranks = [base + c * tp + tp_rank for c in range(cp)]
    return tp_rank, cp_rank, tp_ranks, cp_ranks


def ranks_of(group):
    return None if group is None else dist.get_process_group_ranks(group)


def cross_entropy_pair(layout, temperature, seed):
    """(ours, megatron's) per-token values and logits gradients for sum(coef * logprob) on this TP shard."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(seed)
    seq, batch = 7, 3
    logits = torch.randn(seq, batch, VOCAB, generator=g) * 3
    target = torch.randint(VOCAB, (seq, batch), generator=g)
    coef = torch.randn(seq, batch, generator=g)
    start, end = layout.vocab_range()
    ours_in = logits[..., start:end].clone().requires_grad_()
    ours = token_logprobs(ours_in.reshape(seq * batch, -1), target.reshape(-1), temperature=temperature,
                          vocab_start=start, tp_group=layout.tp_group).view(seq, batch)
    (coef * ours).sum().backward()
    meg_in = logits[..., start:end].clone().requires_grad_()
    # It rewrites fp32 logits in place: hand it a copy. Temperature is ours to apply.
    meg = -vocab_parallel_cross_entropy((meg_in / temperature).clone(), target)
    (coef * meg).sum().backward()
    return dict(ours=ours.detach(), meg=meg.detach(), ours_grad=ours_in.grad, meg_grad=meg_in.grad)


def rank_main(rank):
    from megatron.core import parallel_state as ps

    out = {}
    try:
        ParallelLayout.from_megatron(VOCAB)
    except ValueError as err:
        out["uninitialised_error"] = str(err)
    for tp, cp, mode in GRIDS:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        layout = ParallelLayout.from_megatron(VOCAB, cp_mode=mode)
        out[tp, cp] = dict(
            fields=(layout.tp_size, layout.tp_rank, layout.cp_size, layout.cp_rank, layout.cp_mode,
                    layout.vocab_size),
            tp_ranks=ranks_of(layout.tp_group), cp_ranks=ranks_of(layout.cp_group), vocab_range=layout.vocab_range(),
            ce={t: cross_entropy_pair(layout, t, seed=10 * tp + cp) for t in TEMPERATURES},
            pp=(layout.pp_size, layout.pp_rank, ranks_of(layout.pp_group), layout.is_last_stage),
        )
        ps.destroy_model_parallel()
    out["pipelined"] = pipelined_layout()
    return out


def pipelined_layout() -> dict:
    """tp=2 x pp=2: the layout's PP coordinates, its log line, and the Megatron backbone's layout checks (dense
    and MoE models pipeline; an uneven layer split is refused)."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from topp_rl.megatron.backbone import check_layout

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    layout = ParallelLayout.from_megatron(VOCAB)
    out = dict(pp=(layout.pp_size, layout.pp_rank, ranks_of(layout.pp_group), layout.is_last_stage),
               describe=layout.describe(world_size=WORLD))
    dense = dict(vocab_size=VOCAB, model_type="qwen2", num_hidden_layers=4)
    check_layout(SimpleNamespace(**dense), layout)  # a dense model of 4 layers pipelines over 2 stages
    for name, config in (("moe", dense | dict(model_type="qwen3_moe", num_experts=4, decoder_sparse_step=1)),
                         ("uneven", dense | dict(num_hidden_layers=3))):
        try:
            check_layout(SimpleNamespace(**config), layout)
        except ValueError as err:
            out[name] = str(err)
    ps.destroy_model_parallel()
    return out


def test_from_megatron_and_vocab_parallel_cross_entropy_match():
    results = run_distributed(rank_main, WORLD, timeout=300, preload=("megatron.core",))
    for rank, res in enumerate(results):
        assert "initialize_model_parallel" in res["uninitialised_error"]
        for tp, cp, mode in GRIDS:
            got = res[tp, cp]
            tp_rank, cp_rank, tp_ranks, cp_ranks = expected_coords(rank, tp, cp)
            assert got["fields"] == (tp, tp_rank, cp, cp_rank, mode, VOCAB), (rank, tp, cp)
            assert got["tp_ranks"] == tp_ranks and got["cp_ranks"] == cp_ranks, (rank, tp, cp)
            assert got["pp"] == (1, 0, [rank], True), (rank, tp, cp)  # one stage: every rank is the last
            shard = VOCAB // tp
            assert got["vocab_range"] == (tp_rank * shard, (tp_rank + 1) * shard)
            for t, ce in got["ce"].items():
                where = f"rank {rank} tp={tp} cp={cp} temperature={t}"
                torch.testing.assert_close(ce["ours"], ce["meg"], atol=1e-5, rtol=1e-5, msg=where)
                torch.testing.assert_close(ce["ours_grad"], ce["meg_grad"], atol=1e-6, rtol=1e-5, msg=where)
                assert ce["ours_grad"].abs().sum() > 0
        # megatron's order tp-cp-ep-dp-pp: stage = rank // (tp * cp * dp), its peers 2 ranks apart
        stage = rank // 2
        assert res["pipelined"]["pp"] == (2, stage, [rank % 2, rank % 2 + 2], stage == 1)
        assert res["pipelined"]["describe"] == "world=4 dp=1 tp=2 cp=1 ep=1 pp=2"
        assert "moe" not in res["pipelined"]  # MoE models pipeline too (their routes split over the stages)
        assert "parallel.pp_size=2: must be a divisor of the model's layer count (num_hidden_layers=3" in res[
            "pipelined"]["uneven"]


def test_describe_prints_ep_and_ep_sizes_are_validated():

    layout = ParallelLayout(vocab_size=128)
    assert layout.describe(world_size=4) == "world=4 dp=4 tp=1 cp=1 ep=1"
    with pytest.raises(ValueError, match=r"ep_size=0 must be an int >= 1"):
        ParallelLayout(vocab_size=128, ep_size=0)
    with pytest.raises(ValueError, match=r"ep_size=2 needs ep_group"):
        ParallelLayout(vocab_size=128, ep_size=2)

