"""Routing replay on the Megatron backbone equals it on the HF backbone: on one packed batch whose routes differ
from the model's own on half the recorded tokens (so replay changes the result; each sequence's last token and a
few others carry no route), restricted log-probs within 1e-5 and every parameter gradient, the routers' included
(nonzero: they learn through the replayed weights), within 1e-5; `routing_agreement` summed over CP equals the
HF figure with replay on and off. Layouts (tp, cp, ep) ep2, tp2_ep2 and cp2 on 4 ranks, for Qwen3-MoE with and
without norm_topk_prob, in one gloo spawn. Gradients are compared as in test_megatron_equivalence (CP partial
sums added, experts summed over the expert-data-parallel group and divided by the replicas holding the batch).
"""

import copy
import importlib.util

import pytest
import torch
from dist_utils import run_distributed
from test_megatron_equivalence import TEMPERATURE, packed_batch

NO_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core (the `megatron` extra) is not installed")

CASES = [(1, 1, 2), (2, 1, 2), (1, 2, 1)]  # (tp, cp, ep) at world size 4: ep2, tp2_ep2, cp2
NORMS = (True, False)
TOL = 1e-5
PRELOAD = ("megatron.core", "megatron.core.models.gpt", "topp_rl.megatron", "topp_rl.trainer.hook", "transformers")


def routed_batch(model):
    """`packed_batch` with position ids and routes: the model's own top-2 of 4 on even tokens, the two other
    experts on odd ones, NO_ROUTE on each sequence's last token and on token 5."""
    from topp_rl.data.routes import NO_ROUTE
    from topp_rl.models.moe import RouteRecorder, moe_routing

    batch = packed_batch(model.config.vocab_size)
    batch.position_ids = torch.cat([torch.arange(n) for n in batch.seq_lengths.tolist()])
    with RouteRecorder(model, moe_routing(model)) as recorder, torch.no_grad():
        own = []
        for seq in batch.tokens.split(batch.seq_lengths.tolist()):
            model(input_ids=seq[None])
            own.append(recorder.take())
    own = torch.cat(own).long()  # [T, L, 2]
    picked = torch.zeros(*own.shape[:2], 4, dtype=torch.bool).scatter_(-1, own, True)
    other = torch.arange(4).expand(*own.shape[:2], 4)[~picked].view(own.shape)
    routes = torch.where((torch.arange(own.shape[0]) % 2 == 1)[:, None, None], other, own)
    routes[torch.cumsum(batch.seq_lengths, 0) - 1] = NO_ROUTE
    routes[5] = NO_ROUTE
    batch.routes = routes.to(torch.int16)
    return batch


def hf_replay(model, batch, *, replay: bool):
    """HF backbone: (log-probs [R], grads of sum(weights * log-probs) by HF name, routing agreement)."""
    from topp_rl.trainer.backbone import HFBackbone
    from topp_rl.trainer.hook import ToppLogProb

    backbone = HFBackbone(copy.deepcopy(model), routing_replay=replay)
    hidden, weight = backbone.forward_hidden(batch)
    out = ToppLogProb(temperature=TEMPERATURE)(batch, layout=backbone.layout, hidden=hidden, weight=weight)
    logprobs = torch.zeros(int(batch.response_lengths.sum())).index_put((out.token_index,), out.logprobs.detach())
    (batch.weights[out.token_index] * out.logprobs).sum().backward()
    grads = {n: p.grad.clone() for n, p in backbone.model.named_parameters() if p.grad is not None}
    return logprobs, grads, backbone.routing_agreement()


def _case(norm: bool, tp: int, cp: int, ep: int) -> dict[str, float]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from topp_rl.megatron import MegatronBackbone, load_hf_into
    from topp_rl.megatron.export import hf_state_dict
    from topp_rl.megatron.grads import is_expert_param
    from topp_rl.megatron.replay import megatron_moe_routing
    from topp_rl.models import build_tiny_model
    from topp_rl.models.moe import moe_routing
    from topp_rl.parallel import ParallelLayout
    from topp_rl.trainer.hook import ToppLogProb

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 expert_model_parallel_size=ep)
    try:
        # gate weights far from zero: sizeable router gradients, routes that matter
        model = build_tiny_model("qwen3_moe", seed=7, norm_topk_prob=norm, initializer_range=0.2)
        batch = routed_batch(model)
        ref_logprobs, ref_grads, ref_agree = hf_replay(model, batch, replay=True)
        plain_logprobs, _, plain_agree = hf_replay(model, batch, replay=False)
        layout = ParallelLayout.from_megatron(model.config.vocab_size)
        backbone = MegatronBackbone(model.config, layout=layout, routing_replay=True)
        load_hf_into(backbone.model, model.state_dict(), model.config, tp_size=tp,
                     tp_rank=layout.tp_rank, ep_size=ep, ep_rank=layout.ep_rank)
        hidden, weight = backbone.forward_hidden(batch)
        agree = torch.tensor(backbone.routing_agreement(), dtype=torch.float64)
        out = ToppLogProb(temperature=TEMPERATURE)(batch, layout=layout, hidden=hidden, weight=weight)
        (batch.weights[out.token_index] * out.logprobs).sum().backward()
        full = torch.zeros_like(ref_logprobs).index_put((out.token_index,), out.logprobs.detach())
        backbone.replay.force = False  # the same weights, routing by themselves: agreement is measured anyway
        with torch.no_grad():
            backbone.forward_hidden(batch)
        agree_plain = torch.tensor(backbone.routing_agreement(), dtype=torch.float64)
        if cp > 1:  # CP ranks hold disjoint tokens and partial parameter gradients: sum both
            for t in (full, agree, agree_plain):
                dist.all_reduce(t, group=layout.cp_group)
        for name, p in backbone.model.named_parameters():
            if is_expert_param(name):
                dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
            elif cp > 1:
                dist.all_reduce(p.grad, group=layout.cp_group)
        grads = hf_state_dict(backbone, grads=True)
        replicas = dist.get_world_size() // (tp * cp)
        grads = {n: g / replicas if ".mlp.experts." in n else g for n, g in grads.items()}
        routers = [n for n in ref_grads if n.endswith("mlp.gate.weight")]
        return {
            "routing_matches_hf": float(megatron_moe_routing(model.config) == moe_routing(model)),
            "logprobs": float((full - ref_logprobs).abs().max()),
            "replay_changes_logprobs": float((plain_logprobs - ref_logprobs).abs().max()),
            "grads": max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items() if n in grads),
            "grads_missing": float(len(set(ref_grads) - set(grads) - {"lm_head.weight"})),
            "router_grad_min": min(float(ref_grads[n].abs().max()) for n in routers),
            "routers": float(len(routers)),
            "agreement_matches_hf": float(tuple(agree.tolist()) == ref_agree),
            "agreement_plain_matches_hf": float(tuple(agree_plain.tolist()) == plain_agree),
            "agreement": ref_agree[0] / ref_agree[1],
        }
    finally:
        ps.destroy_model_parallel()


def _refusals() -> list[str]:
    """The error messages of replay on a dense model and of a batch without routes under replay."""
    from megatron.core import parallel_state as ps

    from topp_rl.megatron import MegatronBackbone
    from topp_rl.models import build_tiny_model
    from topp_rl.parallel import ParallelLayout

    ps.initialize_model_parallel()
    messages = []
    try:
        for family in ("qwen3", "qwen3_moe"):  # dense: refused at construction; MoE: at the routeless batch
            config = build_tiny_model(family).config
            try:
                backbone = MegatronBackbone(config, layout=ParallelLayout.from_megatron(config.vocab_size),
                                            routing_replay=True)
                backbone.forward_hidden(packed_batch(config.vocab_size))  # no `routes` field: None
            except ValueError as e:
                messages.append(str(e))
    finally:
        ps.destroy_model_parallel()
    return messages


def _all_cases(rank: int) -> dict:
    torch.manual_seed(0)
    return {(norm, *case): _case(norm, *case) for norm in NORMS for case in CASES} | {"refusals": _refusals()}


@NO_MEGATRON
@pytest.mark.distributed
def test_megatron_replay_matches_hf_replay_at_ep2_tp2_ep2_and_cp2():
    results = run_distributed(_all_cases, 4, timeout=600, preload=PRELOAD)
    dense, no_routes = results[0].pop("refusals")
    assert "routing_replay=True needs an MoE model; model_type='qwen3'" in dense and "turn replay off" in dense
    assert "this batch carries no routes" in no_routes and "rollout.record_routes=true" in no_routes
    for rank, per_case in enumerate(results):
        per_case.pop("refusals", None)
        for case, r in per_case.items():
            where = f"rank {rank} (norm, tp, cp, ep)={case}"
            assert r["routing_matches_hf"] == 1.0, (where, r)
            assert r["logprobs"] <= TOL, (where, r)
            assert r["replay_changes_logprobs"] > 1e-3, (where, r)  # the forced routes matter
            assert r["grads"] <= TOL and r["grads_missing"] == 0, (where, r)
            assert r["routers"] == 2 and r["router_grad_min"] > 1e-2, (where, r)
            assert r["agreement_matches_hf"] == 1.0 and r["agreement_plain_matches_hf"] == 1.0, (where, r)
            assert 0.3 < r["agreement"] < 0.7, (where, r)  # about half the recorded routes were changed
    print({k: {m: r[m] for m in ("logprobs", "grads", "router_grad_min", "replay_changes_logprobs")}
           for k, r in results[0].items()})
