"""Rollout routing replay on the HF side (`topp_rl.models.moe`, `topp_rl.data.routes`): the embedded engine records the
experts of every fed token, samples / packing / checkpoints / the TP x CP broadcast carry them, and the HF
backbone replays them: with the rollout's own routes it is the plain forward bit for bit; with other routes the
MoE block equals a dense reference by hand, gradients included (the router still learns)."""

import dataclasses
import io

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from helpers import column, compose_cfg, read_metrics

from topp_rl.config import validate_routing
from topp_rl.data import Sample, SamplingParams
from topp_rl.data.routes import NO_ROUTE, MoeRouting
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_tiny_model
from topp_rl.models.moe import RouteRecorder, RouterReplay, moe_routing
from topp_rl.rollout.broadcast import samples_from_state, samples_to_state
from topp_rl.rollout.packing import pack_samples
from topp_rl.train import train
from topp_rl.trainer.backbone import HFBackbone

PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 12, 13]]  # unequal lengths: left padding in the engine's prefill


def moe(seed: int = 0, **kwargs):
    return build_tiny_model("qwen3_moe", seed=seed, **kwargs)


def rollout(model, *, share_weights: bool = False):
    engine = EmbeddedEngine(model, progress=False, share_weights=share_weights)
    return engine, engine.generate(PROMPTS, SamplingParams(top_p=0.9, max_new_tokens=6, n=2), seed=1)


def own_routes(model, tokens: list[int]) -> torch.Tensor:
    """The routers' own ids for one whole sequence in a single forward (no cache): [len(tokens), L, k]."""
    with RouteRecorder(model, moe_routing(model)) as recorder, torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
        return recorder.take()


def test_engine_records_every_fed_tokens_experts_also_when_sharing_a_replaying_module():
    model = moe()
    routing = moe_routing(model)
    assert routing == MoeRouting(layer_ids=(0, 1), top_k=2, num_experts=4, num_hidden_layers=2)
    assert (routing.dtype, routing.bytes_per_token) == (torch.uint8, 4)
    # The policy's backbone hooks the same module; outside a training forward its replay must not act.
    backbone = HFBackbone(model, routing_replay=True)
    _, samples = rollout(model, share_weights=True)
    assert backbone.replay is not None and len(samples) == 6
    for s in samples:
        assert s.routes.dtype == torch.uint8 and s.routes.shape == (len(s.tokens) - 1, 2, 2)
        s.check_routes(routing)
        # prefill (left-padded, batched) + cached decode steps == one plain forward of the whole sequence
        assert torch.equal(s.routes, own_routes(model, s.tokens)[:-1])
        assert not s.routes.is_inference()  # decoded in inference mode, handed out as an ordinary tensor
    dense = EmbeddedEngine(build_tiny_model("qwen3"), progress=False)
    assert dense.routing is None
    assert dense.generate([[1, 5]], SamplingParams(max_new_tokens=2))[0].routes is None


def test_replaying_the_rollouts_own_routes_is_the_plain_forward_bit_for_bit():
    model = moe()
    _, samples = rollout(model)
    (mb,) = pack_samples(samples, [0.0] * len(samples), max_tokens=200)
    plain = HFBackbone(moe())  # same seed: same weights, a separate module (no hooks shared)
    replay = HFBackbone(model, routing_replay=True)
    observe = HFBackbone(moe(), routing_replay=False)
    h_plain, _ = plain.forward_hidden(dataclasses.replace(mb, routes=None))
    h_replay, _ = replay.forward_hidden(mb)
    h_observe, _ = observe.forward_hidden(mb)
    assert torch.equal(h_plain, h_replay) and torch.equal(h_plain, h_observe)
    recorded = (mb.tokens.numel() - mb.num_samples) * 2  # every token but each sequence's last, 2 MoE layers
    assert replay.routing_agreement() == observe.routing_agreement() == (recorded, recorded)
    assert plain.routing_agreement() is None


def other_routes(own: torch.Tensor, num_experts: int = 4) -> torch.Tensor:
    """For top-2 of 4: the two experts the router did not pick (in ascending order), per token and layer."""
    rows = own.reshape(-1, own.shape[-1]).long()
    picked = torch.zeros(rows.shape[0], num_experts, dtype=torch.bool).scatter_(1, rows, True)
    rest = torch.arange(num_experts).expand(rows.shape[0], -1)[~picked].view(rows.shape[0], -1)
    return rest.view(own.shape)


def dense_moe_block(block, h: torch.Tensor, ids: torch.Tensor, *, norm: bool) -> torch.Tensor:
    """The MoE block by hand: sum_j w_j * expert_{ids_j}(h), w = softmax(h @ W_r.T)[ids] (/ their sum)."""
    probs = F.softmax(h @ block.gate.weight.T, dim=-1, dtype=torch.float)
    w = probs.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) if norm else w
    experts = block.experts
    out = torch.zeros_like(h)
    for j in range(ids.shape[1]):
        gate_up = torch.einsum("th,tih->ti", h, experts.gate_up_proj[ids[:, j]])
        gate, up = gate_up.chunk(2, dim=-1)
        down = torch.einsum("ti,thi->th", experts.act_fn(gate) * up, experts.down_proj[ids[:, j]])
        out = out + w[:, j : j + 1] * down
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_forced_routes_equal_a_dense_reference_and_reach_the_router(norm):
    model = moe(norm_topk_prob=norm, initializer_range=0.2)  # gate weights far from zero: sizeable gradients
    block = model.model.layers[1].mlp
    replay = RouterReplay(model, moe_routing(model), force=True)
    h = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, _, own = block.gate(h)
    ids = other_routes(own)
    ids[4] = own[4]  # one token keeps its own experts, one has no recorded route
    routes = torch.stack([torch.full_like(ids, NO_ROUTE), ids], dim=1)  # [tokens, layers 0-1, k]
    routes[7, 1] = NO_ROUTE
    want_ids = torch.where(routes[:, 1, :1] >= 0, routes[:, 1], own)
    with replay.using(routes):
        out = block(h[None])[0]
    out.square().sum().backward()
    grad = block.gate.weight.grad.clone()
    block.zero_grad()
    ref = dense_moe_block(block, h, want_ids, norm=norm)
    ref.square().sum().backward()
    # Other kernels (grouped_mm vs einsum) and summation orders: equal to float32 rounding of the tensor's scale.
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6 * float(ref.detach().abs().max()))
    assert grad.abs().max() > 1.0  # the router learns through the replayed weights
    torch.testing.assert_close(grad, block.gate.weight.grad, rtol=0, atol=2e-6 * float(grad.abs().max()))
    with torch.no_grad():  # outside `using` the router is HF's own
        assert torch.equal(block.gate(h)[2], own)


def test_replay_under_gradient_checkpointing_recomputes_the_same_routes():
    """A checkpointed layer recomputes in the backward, after `forward_hidden` returned: it must replay the
    routes of its own forward (torch's context_fn), so the gradients equal those without checkpointing."""
    _, samples = rollout(moe())
    (mb,) = pack_samples(samples, [0.0] * len(samples), max_tokens=200)
    forced = mb.routes.clone()
    keep = forced[:, :, 0] >= 0
    forced[keep] = other_routes(forced[keep]).to(torch.int16)
    mb = dataclasses.replace(mb, routes=forced)
    grads = []
    for checkpointing in (False, True):
        backbone = HFBackbone(moe(), routing_replay=True, gradient_checkpointing=checkpointing)
        hidden, _ = backbone.forward_hidden(mb)
        assert backbone.routing_agreement() == (0, int(keep.sum()))
        hidden.square().sum().backward()
        grads.append([p.grad.clone() for p in backbone.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_route_validation_names_the_sample_the_layer_and_the_fix():
    routing = MoeRouting(layer_ids=(0, 2), top_k=2, num_experts=4, num_hidden_layers=3)
    sample = Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5], loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0],
                    index=7, group_index=3)
    sample.routes = torch.zeros(4, 2, 2, dtype=torch.uint8)
    sample.check_lengths()
    sample.check_routes(routing)
    bad = sample.routes.clone()
    bad[2, 1, 0] = 4
    sample.routes = bad
    with pytest.raises(ValueError, match=r"Sample\(index=7, group=3\): MoE layer 1 \(decoder layer 2\) routes token "
                                         r"2 to expert 4, outside \[0, 4\)"):
        sample.check_routes(routing)
    sample.routes = torch.zeros(4, 3, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"routes have shape \(4, 3, 2\), expected \(4, 2, 2\)"):
        sample.check_routes(routing)
    sample.routes = torch.zeros(5, 2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"expected \(4, moe_layers, top_k\).*prompt 3 \+ response 2 - 1"):
        sample.check_lengths()
    sample.routes = torch.zeros(4, 2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="append every response token first, then set routes"):
        sample.append_response_tokens([6], [0.0])
    assert MoeRouting(layer_ids=(0,), top_k=8, num_experts=512, num_hidden_layers=1).dtype == torch.int16


def test_packing_aligns_routes_with_the_tokens_and_checkpoints_keep_them():
    _, samples = rollout(moe())
    samples[3].routes = None  # e.g. an engine that recorded none for it
    micro = pack_samples(samples, [0.0] * len(samples), max_tokens=24)
    assert len(micro) > 1
    rows = torch.cat([mb.routes for mb in micro])
    start = 0
    for s in samples:
        n = len(s.tokens)
        want = s.routes.to(torch.int16) if s.routes is not None else torch.full((n - 1, 2, 2), NO_ROUTE)
        assert torch.equal(rows[start : start + n - 1], want.to(torch.int16))
        assert (rows[start + n - 1] == NO_ROUTE).all()
        start += n
    assert start == rows.shape[0] and rows.dtype == torch.int16
    buffer = io.BytesIO()
    torch.save(samples_to_state(samples), buffer)
    buffer.seek(0)
    back = samples_from_state(torch.load(buffer, weights_only=True))
    for a, b in zip(samples, back, strict=True):
        assert (a.routes is None) == (b.routes is None)
        assert a.routes is None or (b.routes.dtype == torch.uint8 and torch.equal(a.routes, b.routes))
    old = samples_to_state(samples)  # a checkpoint written before routes existed
    for key in ("route_dtype", "route_shape"):
        del old["header"][key]
    del old["tensors"]["routes"]
    assert all(s.routes is None for s in samples_from_state(old))


def _share(rank: int, states: list[dict]) -> list:
    import torch.distributed as dist

    from topp_rl.parallel.peers import RolloutPeers
    from topp_rl.rollout.broadcast import share_samples

    peers = RolloutPeers(group=dist.group.WORLD, source=0)
    got, _ = share_samples(samples_from_state(states[0]) if rank == 0 else None, peers)
    return [s.routes for s in got]


@pytest.mark.distributed
def test_the_tp_cp_broadcast_carries_the_routes():
    _, samples = rollout(moe())
    samples[2].routes = None
    got = run_distributed(_share, 2, [samples_to_state(samples)])
    for routes in got:
        for s, r in zip(samples, routes, strict=True):
            assert (s.routes is None and r is None) or (r.dtype == s.routes.dtype and torch.equal(r, s.routes))


def test_routing_replay_is_refused_for_a_dense_model_or_without_recorded_routes(tmp_path):
    cfg = compose_cfg(tmp_path, "rollout.routing_replay=true")
    with pytest.raises(ValueError, match=r"config rollout.routing_replay=True: must be false for a dense model "
                                         r"\(Qwen2ForCausalLM has no MoE layers.*set rollout.routing_replay=false, "
                                         r"or train an MoE model"):
        validate_routing(cfg, build_tiny_model("qwen2"))
    validate_routing(cfg, moe())
    cfg = compose_cfg(tmp_path, "rollout.routing_replay=true", "rollout.record_routes=false")
    with pytest.raises(ValueError, match=r"set rollout.record_routes=true, or rollout.routing_replay=false"):
        validate_routing(cfg, moe())
    with pytest.raises(ValueError, match="routing_replay=True needs an MoE model"):
        HFBackbone(build_tiny_model("qwen2"), routing_replay=True)


def test_moe_trains_with_routing_replay_on_and_logs_agreement_either_way(tmp_path):
    """`train.py model=tiny model.family=qwen3_moe rollout.top_p=0.9 rollout.routing_replay=true`: the on-policy
    pass agrees with the rollout to float32 precision and picks the rollout's experts for every token and layer;
    with replay off the agreement is still measured (routes are recorded for every MoE model)."""
    for replay in ("true", "false"):
        out = tmp_path / replay
        summary = train(compose_cfg(out, "model.family=qwen3_moe", f"rollout.routing_replay={replay}",
                                    "logger=csv", "trainer.max_steps=3"))
        assert summary["train/rollout_logprob_abs_diff_max"] <= 1e-5, replay
        rows = read_metrics(out)
        assert column(rows, "train/routing_agreement") == [1.0, 1.0, 1.0], replay
        assert column(rows, "train/rollout_extreme_frac") == [0.0, 0.0, 0.0], replay
        assert max(column(rows, "train/rollout_logprob_abs_diff_max")) <= 1e-5, replay
    dense = tmp_path / "dense"
    train(compose_cfg(dense, "logger=csv"))
    keys = set().union(*read_metrics(dense))
    assert "train/rollout_extreme_frac" in keys and "train/routing_agreement" not in keys
