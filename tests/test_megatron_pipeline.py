"""Pipeline parallelism on the Megatron backbone (megatron-core's 1F1B schedule through `Backbone.forward_backward`)
equals the same backbone at pp = 1, on gloo CPU ranks.

One spawn per world size checks every case: fp32 tiny Qwen2 (tied embeddings: two copies at pp 2, kept equal),
Llama (untied) and Qwen3 (QK-norm, its gradient summed over TP), 4 layers, three packed micro-batches of very different lengths (5 to 61 tokens: the activations
between stages change shape every micro-batch; the spawn's timeout turns a hang into a failure), GRPO with a KL
reference (its own pipelined backbone) and 4 AdamW steps. Against pp = 1 at the same TP x CP, run in the same
processes (the spare ranks as data-parallel replicas): each step's loss and gradient norm (relative 1e-5), the on-policy records' masked and
unmasked log-probs and entropy (1e-5), the weights after the 4 steps gathered from every stage under HF names
(absolute 1e-5, see `_check`), the gradient export of the first step; every stage returns the same outputs (the last stage's). World 2:
pp2; world 4: tp2_pp2 and pp2_cp2. The same spawns train a tiny Qwen3-MoE with routing replay (half the recorded
routes not the model's own) and the load-balancing loss: pp2 vs pp1 (world 2) and pp2_ep2 vs ep2 (world 4), the
same figures plus the MoE aux loss, expert load and routing agreement every rank logs (`_check_moe`).
They also run Qwen2 and Llama at pp 2 with the distributed optimizer (megatron's DDP + DistributedOptimizer,
`_check_sharded`) against the plain AdamW and pp 1. A third spawn (world 2) runs megatron's interleaved schedule
(virtual stages, pp2 x vpp2 on 8 layers) against pp1 and the non-interleaved pp2 the same way.
"""

import importlib.util
import math

import pytest
import torch
from dist_utils import run_distributed

NO_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core (the `megatron` extra) is not installed")
PRELOAD = ("megatron.core", "megatron.core.models.gpt", "megatron.core.pipeline_parallel", "topp_rl.megatron",
           "topp_rl.trainer.module", "transformers")
TEMP = 0.8
STEPS = 4
TOL = 1e-5
FAMILIES = ("qwen2", "llama", "qwen3")
# Qwen3-MoE (4 experts, top 2, every layer sparse): pp2 vs pp1 at world 2; pp2_ep2 vs ep2, tp2_pp2 vs tp2 and
# pp2_cp2 vs cp2 at world 4
MOE_LAYOUTS = {2: [(1, 1, 1)], 4: [(1, 1, 2), (2, 1, 1), (1, 2, 1)]}  # (tp, cp, ep), each at pp 2 vs pp 1
MOE_KEYS = ("train/moe_aux_loss", "train/expert_load_max_frac")
# the distributed optimizer at pp 2: a tied embedding (two copies, one weight) and an untied one
SHARDED_FAMILIES = ("qwen2", "llama")
# (tp, cp, pp) per world size; pp1 is the reference
LAYOUTS = {2: [(1, 1, 2)], 4: [(2, 1, 2), (1, 2, 2)]}


def _hf(family: str, layers: int = 4):
    from topp_rl.models import build_char_tokenizer, build_tiny_model

    return build_tiny_model(family, vocab_size=96, hidden=32, layers=layers, heads=4, kv_heads=2, seed=3,
                            tie_embeddings=family == "qwen2", tokenizer=build_char_tokenizer())


def _samples(model):
    """Prompt / response / candidate-row triples of very different lengths (5 to 61 tokens)."""
    from topp_rl.ops import sampling_candidates

    g = torch.Generator().manual_seed(0)
    out = []
    for prompt_len, response_len in ((3, 2), (30, 31), (4, 6), (9, 3), (20, 25), (2, 5)):
        prompt = torch.randint(3, 90, (prompt_len,), generator=g).tolist()
        response = torch.randint(3, 90, (response_len,), generator=g).tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        rows = sampling_candidates(logits, temperature=TEMP, top_p=0.7).to_lists()
        out.append((prompt, response, [sorted(set(r) | {t}) for r, t in zip(rows, response, strict=True)]))
    return out


def _micro(samples, groups=([0], [1, 2], [3, 4, 5])):
    """Three micro-batches: 5 tokens, 61 + 10 tokens, 12 + 45 + 7 tokens (or the samples of `groups`)."""
    from test_module import pack

    adv = torch.linspace(-1.0, 1.5, len(samples))
    return [pack(samples, idx, advantages=adv) for idx in groups]


def _train(hf, layout, micro, *, steps: int = STEPS, autocast: bool = False, sharded: bool = False,
           start=None, moe: bool = False, aux: float = 0.01) -> dict:
    """AdamW steps of GRPO + KL through the backbone's schedule; per-step figures and the final HF weights.
    `autocast`: under bf16 autocast (Lightning's bf16-mixed), float32 weights. `sharded`: megatron's DDP +
    distributed optimizer (`dist_opt.ShardedOptimizer`, as `parallel.distributed_optimizer=true` sets it up).
    `start`: (HF weights, the saved stages' (names, optimizer state) pairs) of a run at another pp size to go on
    from (the reference stays `hf`). `moe`: with routing replay and the load-balancing loss of weight `aux` (its
    gradient included); the step's MoE figures and routing agreement too."""
    from topp_rl.losses import GRPOLoss
    from topp_rl.megatron import MegatronBackbone
    from topp_rl.megatron.grads import GradSync, is_expert_param
    from topp_rl.megatron.stage_state import global_param_names, restage
    from topp_rl.trainer.hook import ToppLogProb
    from topp_rl.trainer.module import PolicyModule
    from topp_rl.trainer.records import OnPolicyRecord
    from topp_rl.trainer.timer import PhaseTimer

    extra = dict(routing_replay=True, moe_aux_loss_coeff=aux) if moe else {}
    if moe:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        # the aux loss's gradient scale, a process-wide tensor: 1.0 of shape [] once a backward ran outside the
        # schedule (pp 1), which the schedule's [1]-shaped scale cannot be copied into (one pp size per run in
        # train.py); unset, each layout sets its own 1
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
    policy = MegatronBackbone.from_hf(_with_weights(hf, start[0]) if start else hf, layout=layout, **extra)
    policy.train(moe)  # the load-balancing loss's gradient exists in training mode only (dropout is 0)
    reference = MegatronBackbone.from_hf(hf, layout=layout, routing_replay=moe)
    module = PolicyModule(policy=policy, reference=reference, loss=GRPOLoss(kl_coef=0.1),
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                          hook=ToppLogProb(use_mask=True, temperature=TEMP))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    if sharded:  # its buffers sum the gradients over DP x CP (here the CP ranks) and the tied embedding's copies
        from topp_rl.megatron.dist_opt import ShardedOptimizer, tied_copy

        opt = ShardedOptimizer(policy.model, opt, tied=tied_copy(policy))
        policy.use_grad_owner(opt)
    names = global_param_names(policy)
    if start:
        opt.load_state_dict(restage(start[1], names))
    params = {n for chunk in policy.chunks for n, _ in chunk.named_parameters()}  # every virtual stage's chunk
    out = {"loss": [], "grad_norm": [], "records": [], "stage": (
        sum(len(chunk.decoder.layers) for chunk in policy.chunks), "embedding.word_embeddings.weight" in params,
        "decoder.final_layernorm.weight" in params, "output_layer.weight" in params)}
    refs = module.reference_pass(micro)
    # CP ranks hold partial gradients: summed over the CP group as the strategy's GradSync does (the spare ranks
    # are data-parallel replicas of the same batch, so no data-parallel sum)
    cp_sum = GradSync(list(policy.parameters()), None if sharded else layout.cp_group)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        cp_sum.before()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            sums, records = module.accumulate_gradients(micro, refs, old=None, timer=PhaseTimer())
        cp_sum.after()
        if moe:
            # the EP ranks hold replicas of one batch, so each expert saw its tokens once per EP rank
            for name, p in policy.model.named_parameters():
                if is_expert_param(name) and p.grad is not None:
                    p.grad /= layout.ep_size
            out.setdefault("moe", []).append({k: sums[k] for k in MOE_KEYS})
            out.setdefault("agreement", []).append(OnPolicyRecord.concat(records).routing_agreement)
        if step == 0 and not sharded:  # sharded: the gradients are in megatron's buffers, not .grad
            out["grads"] = dict(policy_grads(policy))
        out["grad_norm"].append(policy.clip_grad_norm_(1.0))
        opt.step()
        loss, count = sums["train/loss"]
        out["loss"].append(loss / count)
        out["records"].append([(r.logprobs, r.logprobs_unmasked, r.entropy) for r in records])
    out["weights"] = dict(policy.hf_named_tensors())
    from topp_rl.megatron.dist_opt import plain_state_bytes

    out["state_bytes"] = opt.state_bytes() if sharded else plain_state_bytes(opt)
    if not sharded:
        stages = [None] * layout.pp_size  # every stage's (names, optimizer state), as a checkpoint holds them
        torch.distributed.all_gather_object(stages, (names, opt.state_dict()), group=layout.pp_group)
        out["optimizer"] = stages
    return out


def _with_weights(hf, weights: dict):
    import copy

    model = copy.deepcopy(hf)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied: the embedding
    return model


def policy_grads(policy):
    from topp_rl.megatron.export import hf_named_tensors

    return hf_named_tensors(policy, grads=True)


def _layout(tp: int, cp: int, pp: int, vocab: int, ep: int = 1, vpp: int = 1):
    from megatron.core import parallel_state as ps

    from topp_rl.parallel import ParallelLayout

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    return ParallelLayout.from_megatron(vocab)


def _hf_moe():
    from topp_rl.models import build_char_tokenizer, build_tiny_model

    # gate weights far from zero: routes that matter (replay changes the result)
    return build_tiny_model("qwen3_moe", vocab_size=96, hidden=32, layers=4, heads=4, kv_heads=2, seed=3,
                            tie_embeddings=False, initializer_range=0.2, tokenizer=build_char_tokenizer())


def _with_routes(hf, micro):
    """The micro-batches with recorded routes: the model's own top-k on even tokens, other experts on odd ones
    (so replay changes the result), no route on each sequence's last token (as a rollout records them)."""
    from topp_rl.data.routes import NO_ROUTE
    from topp_rl.models.moe import RouteRecorder, moe_routing

    experts = hf.config.num_experts
    for batch in micro:
        with RouteRecorder(hf, moe_routing(hf)) as recorder, torch.no_grad():
            own = []
            for seq in batch.tokens.split(batch.seq_lengths.tolist()):
                hf(input_ids=seq[None])
                own.append(recorder.take())
        own = torch.cat(own).long()  # [T, L, k]
        picked = torch.zeros(*own.shape[:2], experts, dtype=torch.bool).scatter_(-1, own, True)
        other = torch.arange(experts).expand(*own.shape[:2], experts)[~picked].view(*own.shape[:2], -1)
        other = other[..., : own.shape[-1]]
        routes = torch.where((torch.arange(own.shape[0]) % 2 == 1)[:, None, None], other, own)
        routes[torch.cumsum(batch.seq_lengths, 0) - 1] = NO_ROUTE
        batch.routes = routes.to(torch.int16)
    return micro


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    results = {}
    for family in FAMILIES:
        hf = _hf(family)
        micro = _micro(_samples(hf))
        for sizes in sorted({(tp, cp, p) for tp, cp, _ in LAYOUTS[world] for p in (1, 2)}):
            layout = _layout(*sizes, hf.config.vocab_size)
            results[(family, sizes)] = _train(hf, layout, micro)
            first, last = layout.pp_rank == 0, layout.is_last_stage
            tied = hf.config.tie_word_embeddings
            # each stage builds its own layers only: the embedding on the first, the head on the last (a tied
            # embedding: its own copy there at pp 2, none at pp 1)
            assert results[(family, sizes)]["stage"] == (4 // sizes[2], first, last,
                                                         last and (not tied or sizes[2] > 1)), (family, sizes)
            if sizes[2] > 1:
                results[(family, sizes, "describe")] = layout.describe(world_size=world, num_layers=4)
            if sizes[2] > 1 and family in SHARDED_FAMILIES:
                results[(family, sizes, "sharded")] = _train(hf, layout, micro, sharded=True)
            if family == "llama" and world == 2:
                results[(family, sizes, "bf16")] = _train(hf, layout, micro, steps=1, autocast=True)
        if world == 2 and family != "qwen3":
            # a resume at another pp size: 2 steps at pp a, the optimizer state regrouped by name, 2 at pp b
            for a, b in ((2, 1), (1, 2)):
                half = _train(hf, _layout(1, 1, a, hf.config.vocab_size), micro, steps=STEPS // 2)
                results[(family, "restaged", a, b)] = _train(hf, _layout(1, 1, b, hf.config.vocab_size), micro,
                                                             steps=STEPS // 2,
                                                             start=(half["weights"], half["optimizer"]))
    hf = _hf_moe()
    micro = _with_routes(hf, _micro(_samples(hf)))
    for tp, cp, ep in MOE_LAYOUTS[world]:
        for pp in (1, 2):
            layout = _layout(tp, cp, pp, hf.config.vocab_size, ep=ep)
            results[("qwen3_moe", (tp, cp, ep), pp)] = _train(hf, layout, micro, moe=True)
        if (tp, cp) == (1, 1):
            from megatron.core import parallel_state as ps

            # without the load-balancing loss the gradient differs: its gradient crossed the stages above
            results[("qwen3_moe", "no_aux")] = _train(hf, layout, micro, moe=True, aux=0.0, steps=1)
            # megatron's expert groups at pp 2 lie within a stage: the EP ranks are this stage's data-parallel ranks
            results[("qwen3_moe", "groups")] = (torch.distributed.get_process_group_ranks(layout.pp_group),
                                                torch.distributed.get_process_group_ranks(
                                                    ps.get_expert_model_parallel_group()))
            results[("qwen3_moe", "describe")] = layout.describe(world_size=world, num_layers=4)
    return results


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _check_restaged(got: dict, ref: dict, case) -> float:
    """A run resumed after STEPS // 2 steps at another pipeline layout (`got`) against the uninterrupted run
    (`ref`): its steps' loss and grad norm (1e-5 relative) and the weights after them (1e-5 absolute, returned)."""
    for key in ("loss", "grad_norm"):
        rel = max(_rel(x, y) for x, y in zip(got[key], ref[key][STEPS // 2:], strict=True))
        assert rel <= TOL, (case, key, got[key], ref[key])
    weights = max(float((got["weights"][k] - v).abs().max()) for k, v in ref["weights"].items())
    assert got["weights"].keys() == ref["weights"].keys() and weights <= TOL, (case, weights)
    return weights


def _check(results: list[dict], world: int) -> dict:
    figures = {}
    for family in FAMILIES:
        for sizes in LAYOUTS[world]:
            ref = results[0][(family, (*sizes[:2], 1))]  # the same TP x CP at pp = 1: what pipelining changes
            figures[(family, sizes)] = _compare([r[(family, sizes)] for r in results], ref, (family, sizes))
            if family in SHARDED_FAMILIES:
                figures[(family, sizes, "sharded")] = _check_sharded(results, family, sizes, ref)
    return figures


def _check_sharded(results: list[dict], family: str, sizes: tuple, ref: dict) -> dict:
    """The distributed optimizer at pp 2 against the plain AdamW at the same layout and at pp 1: every step's
    loss and grad norm (relative 1e-5; every stage alike), the weights after the 4 steps (absolute 1e-5); its AdamW
    state per rank is the plain one's divided by DP x CP (megatron pads its buffers: within 5%)."""
    plain = results[0][(family, sizes)]
    got = results[0][(family, sizes, "sharded")]
    for r in results[1:]:
        other = r[(family, sizes, "sharded")]
        assert other["loss"] == got["loss"] and other["grad_norm"] == got["grad_norm"], (family, sizes)
    figures = {}
    for name, base in (("plain", plain), ("pp1", ref)):
        loss_rel = max(_rel(a, b) for a, b in zip(got["loss"], base["loss"], strict=True))
        norm_rel = max(_rel(a, b) for a, b in zip(got["grad_norm"], base["grad_norm"], strict=True))
        weights = max(float((got["weights"][k] - v).abs().max()) for k, v in base["weights"].items())
        assert got["weights"].keys() == base["weights"].keys(), (family, sizes, name)
        assert loss_rel <= TOL and norm_rel <= TOL and weights <= TOL, (family, sizes, name, loss_rel, norm_rel,
                                                                        weights)
        figures[name] = dict(loss_rel=loss_rel, grad_norm_rel=norm_rel, weights_abs=weights)
    shards = sizes[1]  # DP x CP: the spare ranks of a pp 2 layout are its CP ranks here
    ratios = [r[(family, sizes, "sharded")]["state_bytes"] / r[(family, sizes)]["state_bytes"] for r in results]
    assert all(abs(ratio * shards - 1) <= 0.05 for ratio in ratios), (family, sizes, ratios)
    figures["state_bytes"] = [(r[(family, sizes)]["state_bytes"], r[(family, sizes, "sharded")]["state_bytes"])
                              for r in results]
    return figures


def _check_moe(results: list[dict], world: int) -> dict:
    pp_group, ep_group = results[0][("qwen3_moe", "groups")]
    if world == 4:  # ranks 0 and 1 hold stage 0 (PP outermost): the experts split over them
        assert pp_group == [0, 2] and ep_group == [0, 1], (pp_group, ep_group)
    return {sizes: _check_moe_layout(results, sizes) for sizes in MOE_LAYOUTS[world]}


def _check_moe_layout(results: list[dict], sizes) -> dict:
    """Qwen3-MoE with routing replay at pp 2 against pp 1 at the same (tp, cp, ep) `sizes`."""
    ref, got = results[0][("qwen3_moe", sizes, 1)], results[0][("qwen3_moe", sizes, 2)]
    for other in results[1:]:  # every stage logs the last stage's figures: the whole model's (CP ranks: own shard)
        mine, peer = other[("qwen3_moe", sizes, 2)], results[0][("qwen3_moe", sizes, 2)]
        if sizes[1] == 1:
            assert [mine[k] for k in ("loss", "grad_norm", "moe", "agreement")] == [
                peer[k] for k in ("loss", "grad_norm", "moe", "agreement")], sizes
        assert other[("qwen3_moe", sizes, 1)]["agreement"] == mine["agreement"], sizes  # each rank vs its pp1 self
    assert got["agreement"] == ref["agreement"], (got["agreement"], ref["agreement"])
    same, recorded = ref["agreement"][0]
    assert 0.3 < same / recorded < 0.7, ref["agreement"]  # half the recorded routes are not the model's own
    moe = max(_rel(g[k][0] / g[k][1], r[k][0] / r[k][1]) for g, r in zip(got["moe"], ref["moe"], strict=True)
              for k in MOE_KEYS)
    assert moe <= TOL and min(r["train/moe_aux_loss"][0] for r in ref["moe"]) > 0, (got["moe"], ref["moe"])
    figures = {"moe_figures_rel": moe}
    loss_rel = max(_rel(a, b) for a, b in zip(got["loss"], ref["loss"], strict=True))
    norm_rel = max(_rel(a, b) for a, b in zip(got["grad_norm"], ref["grad_norm"], strict=True))
    assert loss_rel <= TOL and norm_rel <= TOL, (got["loss"], ref["loss"], got["grad_norm"], ref["grad_norm"])
    aux_share = _rel(results[0][("qwen3_moe", "no_aux")]["grad_norm"][0], got["grad_norm"][0])
    assert sizes[:2] != (1, 1) or aux_share > 1e-4, aux_share
    mismatch = max(float((a - b).abs().max()) for sg, sr in zip(got["records"], ref["records"], strict=True)
                   for rg, rr in zip(sg, sr, strict=True) for a, b in zip(rg, rr, strict=True) if a.numel())
    assert mismatch <= TOL, mismatch
    assert got["weights"].keys() == ref["weights"].keys()
    weights = max(float((got["weights"][k] - v).abs().max()) for k, v in ref["weights"].items())
    assert weights <= TOL, weights
    # every layer's experts, gathered over EP and the stages
    assert all(got["weights"][f"model.layers.{i}.mlp.experts.down_proj"].shape[0] == 4 for i in range(4))
    grads = max(float((got["grads"][k] - v).abs().max() / v.abs().max().clamp(min=1e-12))
                for k, v in ref["grads"].items())
    assert grads <= TOL, grads
    figures |= dict(loss_rel=loss_rel, grad_norm_rel=norm_rel, mismatch=mismatch, weights_abs=weights, grads_rel=grads,
                    agreement=same / recorded)
    return figures | (dict(aux_grad_norm_share=aux_share) if sizes[:2] == (1, 1) else {})


def _compare(outs: list[dict], ref: dict, case) -> dict:
    """Every rank's `_train` figures (`outs`) against the reference run's (`ref`): see the module docstring."""
    family, sizes = case[:2]
    got = outs[0]
    for other in outs[1:]:  # every stage returns the last stage's figures
        assert other["loss"] == got["loss"] and other["grad_norm"] == got["grad_norm"], (family, sizes)
    loss_rel = max(_rel(a, b) for a, b in zip(got["loss"], ref["loss"], strict=True))
    norm_rel = max(_rel(a, b) for a, b in zip(got["grad_norm"], ref["grad_norm"], strict=True))
    assert loss_rel <= TOL and norm_rel <= TOL, (family, sizes, got["loss"], ref["loss"], got["grad_norm"],
                                                 ref["grad_norm"])
    mismatch = 0.0
    for step_got, step_ref in zip(got["records"], ref["records"], strict=True):
        for rec_got, rec_ref in zip(step_got, step_ref, strict=True):
            for a, b in zip(rec_got, rec_ref, strict=True):
                assert a.shape == b.shape, (family, sizes)
                if a.numel():  # a CP rank may hold no response token of a short micro-batch
                    mismatch = max(mismatch, float((a - b).abs().max()))
    assert mismatch <= TOL, (family, sizes, mismatch)
    assert got["weights"].keys() == ref["weights"].keys(), (family, sizes)
    # Absolute: the weights are O(0.01-1), and the K bias's true gradient is zero (softmax ignores a shift
    # shared by all keys), so AdamW turns its round-off into lr-sized steps in either layout.
    weights = max(float((got["weights"][k] - v).abs().max()) for k, v in ref["weights"].items())
    worst = max((float((got["weights"][k] - v).abs().max()), k) for k, v in ref["weights"].items())
    assert weights <= TOL, (family, sizes, worst)
    grads = max(float((got["grads"][k] - v).abs().max() / v.abs().max().clamp(min=1e-12))
                for k, v in ref["grads"].items())
    assert grads <= TOL, (family, sizes, grads)
    return dict(loss_rel=loss_rel, grad_norm_rel=norm_rel, mismatch=mismatch, weights_abs=weights,
                grads_rel=grads)


@NO_MEGATRON
@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_equals_pp1_with_variable_length_micro_batches():
    results = run_distributed(_worker, 2, 2, timeout=300, preload=PRELOAD)
    figures = _check(results, 2) | {"qwen3_moe": _check_moe(results, 2)}
    assert results[0][("qwen2", (1, 1, 2), "describe")] == (
        "world=2 dp=1 tp=1 cp=1 ep=1 pp=2 [stage 0: embedding + layers 0-1 | stage 1: layers 2-3 + head]")
    # bf16 autocast: the stage outputs cross in the model's dtype (a 16-bit activation in a float32 receive
    # buffer gave a grad norm of 6478 against 1.5). At pp 2 the tensor crossing the boundary (forward the
    # activation, backward its gradient) is rounded to bf16 once more than at pp 1: every element within one unit
    # round-off u = 2^-8 (relative), and the loss and the grad norm move by at most about u with it (to first order;
    # the backward is linear in the gradient that crossed). The kernels decide where under u it lands: 3.4e-6 with
    # AVX2 kernels (ONEDNN_MAX_CPU_ISA=AVX2), 1.34e-4 with AVX-512 bf16 / AMX kernels, an Intel Xeon and an AMD
    # EPYC alike; a crossed dtype is 10^6 u away.
    bf16 = {pp: results[0][("llama", (1, 1, pp), "bf16")] for pp in (1, 2)}
    figures["bf16"] = {k: _rel(bf16[2][k][0], bf16[1][k][0]) for k in ("loss", "grad_norm")}
    # Resumed at another pp size (the optimizer state of 2 steps regrouped by parameter name, `stage_state`): steps
    # 3-4 and the weights after them equal the uninterrupted pp1 run's (a Qwen2 tied embedding: one parameter at pp 1,
    # two copies with the same moments at pp 2).
    for family in ("qwen2", "llama"):
        for a, b in ((2, 1), (1, 2)):
            figures[(family, f"pp{a}->pp{b}")] = _check_restaged(results[0][(family, "restaged", a, b)],
                                                                 results[0][(family, (1, 1, 1))], (family, a, b))
    print(figures)
    bf16_u = torch.finfo(torch.bfloat16).eps / 2
    assert figures["bf16"]["loss"] <= bf16_u and figures["bf16"]["grad_norm"] <= bf16_u, figures["bf16"]


@NO_MEGATRON
@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_pp2_and_pp2_cp2_equal_pp1():
    results = run_distributed(_worker, 4, 4, timeout=600, preload=PRELOAD)
    print(_check(results, 4) | {"qwen3_moe": _check_moe(results, 4)})
    assert results[0][("qwen3_moe", "describe")] == (
        "world=4 dp=2 tp=1 cp=1 ep=2 pp=2 [stage 0: embedding + layers 0-1 | stage 1: layers 2-3 + head]")


# ----- virtual (interleaved) pipeline stages: megatron's forward_backward_pipelining_with_interleaving -----
VPP_LAYERS = 8  # pp2 x vpp2: four chunks of two layers, rank 0 holding layers 0-1 and 4-5, rank 1 2-3 and 6-7
# (tp, cp, pp, vpp): pp1 and pp2 (non-interleaved) are the references of pp2 vpp2
VPP_SIZES = ((1, 1, 1, 1), (1, 1, 2, 1), (1, 1, 2, 2))
# micro-batches: the three of `_micro` (m = 3: megatron's default group of pp = 2 is refused for m mod 2 = 1, so
# groups of 3), five (m = 5: groups of 3, a last group of 2) and two (m = pp: the first rank runs every forward in
# its warm-up; megatron's own shape exchange hangs there), all of very different lengths; and four at depth-first
# groups of 2 (m = 4) for one family
FIVE = ([0], [1], [2, 3], [4], [5])
FOUR = ([0], [1, 2], [3], [4, 5])
TWO = ([0, 1, 2], [3, 4, 5])


def _vpp_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    results = {}
    for family in FAMILIES:
        hf = _hf(family, layers=VPP_LAYERS)
        samples = _samples(hf)
        cases = {"m3": _micro(samples), "m5": _micro(samples, FIVE), "m2": _micro(samples, TWO)} | (
            {"m4": _micro(samples, FOUR)} if family == "llama" else {})
        for sizes in VPP_SIZES:
            layout = _layout(*sizes[:3], hf.config.vocab_size, vpp=sizes[3])
            for m, micro in cases.items():
                results[(family, sizes, m)] = _train(hf, layout, micro, steps=STEPS if m == "m3" else 2)
            chunks = layout.vpp_size
            first, last, tied = layout.pp_rank == 0, layout.is_last_stage, hf.config.tie_word_embeddings
            assert results[(family, sizes, "m3")]["stage"] == (VPP_LAYERS // sizes[2], first, last,
                                                               last and (not tied or sizes[2] > 1)), (family, sizes)
            if chunks > 1:
                results[(family, sizes, "describe")] = layout.describe(world_size=world, num_layers=VPP_LAYERS)
        if family != "qwen3":
            # a resume at another vpp size (the optimizer state named by global layer, `stage_state`): 2 steps at
            # layout a, 2 at layout b
            for a, b in ((VPP_SIZES[2], VPP_SIZES[0]), (VPP_SIZES[1], VPP_SIZES[2])):
                half = _train(hf, _layout(*a[:3], hf.config.vocab_size, vpp=a[3]), cases["m3"], steps=STEPS // 2)
                results[(family, "restaged", a, b)] = _train(hf, _layout(*b[:3], hf.config.vocab_size, vpp=b[3]),
                                                             cases["m3"], steps=STEPS // 2,
                                                             start=(half["weights"], half["optimizer"]))
    return results


@NO_MEGATRON
@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_vpp2_equals_pp1_and_pp2_with_variable_length_micro_batches():
    """Interleaved virtual stages (8 layers, pp2 x vpp2: each rank runs two chunks, the last rank's second one
    scores) against pp1 and the non-interleaved pp2: loss, grad norm, gradients, weights after the AdamW steps and
    the masked on-policy log-probs within 1e-5, for 2, 3, 4 and 5 micro-batches of very different lengths (the
    spawn's timeout turns a hang into a failure); and a run resumed at another vpp size (pp2 vpp2 -> pp1, pp2 ->
    pp2 vpp2) equals the uninterrupted one."""
    results = run_distributed(_vpp_worker, 2, 2, timeout=500, preload=PRELOAD)
    figures = {}
    for family in FAMILIES:
        for m in ("m3", "m5", "m2") + (("m4",) if family == "llama" else ()):
            got = [r[(family, VPP_SIZES[2], m)] for r in results]
            for ref in VPP_SIZES[:2]:
                figures[(family, m, f"vs pp{ref[2]}")] = _compare(got, results[0][(family, ref, m)], (family, m, ref))
    # resumed at another vpp size: steps 3-4 and the weights after them equal the uninterrupted pp1 run's
    for family in ("qwen2", "llama"):
        for a, b in ((VPP_SIZES[2], VPP_SIZES[0]), (VPP_SIZES[1], VPP_SIZES[2])):
            figures[(family, f"{a}->{b}")] = _check_restaged(results[0][(family, "restaged", a, b)],
                                                             results[0][(family, VPP_SIZES[0], "m3")], (family, a, b))
    assert results[0][("qwen2", VPP_SIZES[2], "describe")] == (
        "world=2 dp=1 tp=1 cp=1 ep=1 pp=2 vpp=2 [stage 0: embedding + layers 0-1, layers 4-5 | stage 1: layers 2-3, "
        "layers 6-7 + head]")
    print(figures)


# ----- train.py at parallel=pp2: strategy, rollouts shared over the stages, weight sync, metrics, checkpoints -----
TRAIN = ("model.layers=4", "rollout.max_new_tokens=12")
DIST_OPT = "parallel.distributed_optimizer=true"  # on top of test_megatron_train's TINY (3 steps)
# the source rank generates the next step on a background thread (one update stale) beside the pipeline's
# collectives; with 2 PPO epochs the on-policy pass is its own pipelined forward_only
OVERLAP = ("rollout.overlap=true", "rollout.engine.share_weights=false", "algo.loss.tis_cap=2.0",
           "module.ppo_epochs=2", "seed=1")  # seed 1: rewards from the first step on
TRAIN_KEYS = ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/rollout_logprob_abs_diff_max",
              "train/rollout_logprob_abs_diff_unmasked", "train/entropy", "train/loss_scale")
# fp16 autocast with a dynamic loss scale whose start overflows (3e6; doubled after every good step): step 1
# overflows (skipped, the scale halved), step 2 trains at 1.5e6 (measured at pp 1). Two steps: the rollouts of a
# third already differ between the layouts (fp16 round-off flips AdamW's first update of near-zero gradients,
# lr-sized, and with it sampled tokens), and with them where the scale overflows.
FP16 = ("trainer=cpu_fp16", "+trainer.plugins.0.init_scale=3.0e6", "+trainer.plugins.0.growth_interval=1", "seed=1",
        "trainer.max_steps=2")


VPP_TRAIN = ("parallel.vpp_size=2", "model.layers=8")


def _fit(output_dir, parallel: str, *extra: str, ckpt_path=None) -> dict:
    """One train.py run; its CSV metrics (global rank 0), the exported weights, and whether the engine holds them."""
    import csv

    from helpers import compose_config
    from test_megatron_train import TINY

    from topp_rl.engines.embedded import EmbeddedEngine
    from topp_rl.train import build_run

    cfg = compose_config(output_dir, *TINY, *TRAIN, f"parallel={parallel}", *extra)
    run = build_run(cfg)
    try:
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt_path)
        exported = dict(run.module.hf_named_tensors())  # every stage's weights, on every rank
        engine = run.datamodule.engine
        synced = None  # an engine that keeps its weights in memory: compared bit for bit
        if isinstance(engine, EmbeddedEngine):
            synced = all(torch.equal(engine.model.state_dict()[n], t) for n, t in exported.items())
    finally:
        run.datamodule.close_engine()
    metrics = {}
    if run.trainer.is_global_zero:
        (path,) = output_dir.glob("csv/*/metrics.csv")
        with path.open() as f:
            rows = list(csv.DictReader(f))
        metrics = {k: [float(r[k]) for r in rows if r.get(k)] for k in (*TRAIN_KEYS, *MOE_KEYS,
                                                                         "train/routing_agreement")}
    from topp_rl.megatron.dist_opt import ShardedOptimizer, plain_state_bytes

    (opt,) = run.trainer.strategy.optimizers
    state_bytes = opt.state_bytes() if isinstance(opt, ShardedOptimizer) else plain_state_bytes(opt)
    return {"metrics": metrics, "weights": exported, "synced": synced, "has_engine": engine is not None,
            "state_bytes": state_bytes}


def _train_worker(rank: int, tmp: str) -> dict:
    import os
    from pathlib import Path

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group is up: Lightning only reads ranks
    out = {"pp2": _fit(Path(tmp) / "pp2", "pp2")}
    out["part"] = _fit(Path(tmp) / "part", "pp2", "trainer.max_steps=2", "checkpoint.every_n_steps=1")
    out["resumed"] = _fit(Path(tmp) / "resumed", "pp2", ckpt_path=Path(tmp) / "part/checkpoints/last.ckpt")
    out["overlap"] = _fit(Path(tmp) / "overlap", "pp2", *OVERLAP)
    # virtual stages: 8 layers in four chunks, two per rank; checkpointed after step 2 and resumed at pp2 vpp2
    out["vpp2"] = _fit(Path(tmp) / "vpp2", "pp2", *VPP_TRAIN)
    out["vpp2_part"] = _fit(Path(tmp) / "vpp2_part", "pp2", *VPP_TRAIN, "trainer.max_steps=2",
                            "checkpoint.every_n_steps=1")
    out["vpp2_resumed"] = _fit(Path(tmp) / "vpp2_resumed", "pp2", *VPP_TRAIN,
                               ckpt_path=Path(tmp) / "vpp2_part/checkpoints/last.ckpt")
    # fp16 at pp 2 against pp 1 on the same single replica (tp2: Megatron, one rollout for both ranks)
    out["fp16"] = _fit(Path(tmp) / "fp16", "pp2", *FP16)
    out["fp16_pp1"] = _fit(Path(tmp) / "fp16_pp1", "tp2", *FP16)
    return out


@NO_MEGATRON
@pytest.mark.distributed
@pytest.mark.slow
def test_train_py_at_pp2_follows_the_single_process_run(tmp_path):
    """`python train.py parallel=pp2` (2 gloo ranks, the first stage's rank runs the embedded engine) against the
    single-process HF-backbone run of the same config: every step's loss, grad norm, reward and entropy within 1e-5
relative,
    every step's masked rollout mismatch <= 1e-5 (unmasked far above: the mask matters), the engine holds the
    weights gathered from both stages, the final weights within 1e-4 (see there), the HF export of a pp2 checkpoint
holds the stages' weights bit for bit, a run with `rollout.overlap` (one update stale) and 2 PPO epochs follows
its single-process run within 1e-5, a run checkpointed after step 2 and
    resumed at pp2 gives the uninterrupted run's step 3, fp16 loss scaling at pp2 follows pp 1 (`_check_fp16`),
    and pp2 vpp2 (virtual stages, 8 layers) follows the single-process run of the 8-layer model, with its
    checkpoint resumed at pp2 vpp2."""
    results = run_distributed(_train_worker, 2, str(tmp_path), timeout=900, preload=PRELOAD + ("topp_rl.train",
                                                                                                   "hydra"))
    ref = _fit(tmp_path / "none", "none")
    got = results[0]["pp2"]
    assert [r["pp2"]["has_engine"] for r in results] == [True, False]  # the source rank alone generates
    assert got["synced"], "the engine's weights != the weights exported from both stages"
    m, r = got["metrics"], ref["metrics"]
    assert len(m["train/loss"]) == 3
    assert max(r["train/grad_norm"]) > 0  # a step that trains (here the 3rd: the first two draw no reward)
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/entropy"):
        assert m[key] == pytest.approx(r[key], rel=TOL, abs=1e-9), (key, m[key], r[key])
    assert max(m["train/rollout_logprob_abs_diff_max"]) <= TOL
    assert min(m["train/rollout_logprob_abs_diff_unmasked"]) > 1e-3
    weights = max(float((got["weights"][k] - v).abs().max()) for k, v in ref["weights"].items())
    # Against the HF backbone, not Megatron at pp 1 (that comparison, 1e-5, is the spawns' above): AdamW turns the
    # round-off of tiny gradients into lr-sized steps, and parallel=tp2 (pp 1) differs from this reference by 2.0e-5
    # on the same tensor (layer 2's v_proj) after these 3 steps, pp2 by 1.6e-5.
    worst = max((float((got["weights"][k] - v).abs().max()), k) for k, v in ref["weights"].items())
    assert got["weights"].keys() == ref["weights"].keys() and weights <= 1e-4, worst
    # The HF export of the pp2 checkpoint (python -m topp_rl.export) is the whole model the stages held, bit for bit.
    from safetensors.torch import load_file

    from topp_rl.run.export import export_checkpoint

    out_dir = export_checkpoint(tmp_path / "part" / "checkpoints" / "last.ckpt", tmp_path / "export_pp2")
    exported = load_file(str(out_dir / "model.safetensors"))
    held = results[0]["part"]["weights"]
    assert exported.keys() == held.keys() and all(torch.equal(exported[k], v) for k, v in held.items())
    overlap, overlap_ref = results[0]["overlap"]["metrics"], _fit(tmp_path / "none_overlap", "none", *OVERLAP)["metrics"]
    assert max(overlap_ref["train/grad_norm"]) > 0
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/rollout_logprob_abs_diff_max"):
        assert overlap[key] == pytest.approx(overlap_ref[key], rel=TOL, abs=1e-9), ("overlap", key)
    resumed = results[0]["resumed"]["metrics"]
    assert len(resumed["train/loss"]) == 1, "the resumed run trains only the 3rd step"
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
        assert resumed[key] == pytest.approx(m[key][-1:], rel=1e-5, abs=1e-7), key
    # virtual stages (pp2 vpp2, 8 layers) against the single-process run of the same 8-layer model
    vpp, vpp_ref = results[0]["vpp2"], _fit(tmp_path / "none8", "none", "model.layers=8")
    assert [r["vpp2"]["has_engine"] for r in results] == [True, False] and vpp["synced"]
    assert max(vpp_ref["metrics"]["train/grad_norm"]) > 0
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/entropy"):
        assert vpp["metrics"][key] == pytest.approx(vpp_ref["metrics"][key], rel=TOL, abs=1e-9), ("vpp2", key)
    assert max(vpp["metrics"]["train/rollout_logprob_abs_diff_max"]) <= TOL
    assert min(vpp["metrics"]["train/rollout_logprob_abs_diff_unmasked"]) > 1e-3
    vpp_weights = max(float((vpp["weights"][k] - v).abs().max()) for k, v in vpp_ref["weights"].items())
    assert vpp["weights"].keys() == vpp_ref["weights"].keys() and vpp_weights <= 1e-4, vpp_weights
    vpp_resumed = results[0]["vpp2_resumed"]["metrics"]
    assert len(vpp_resumed["train/loss"]) == 1, "the resumed run trains only the 3rd step"
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
        assert vpp_resumed[key] == pytest.approx(vpp["metrics"][key][-1:], rel=1e-5, abs=1e-7), ("vpp2", key)
    print({"vpp2": {k: max(_rel(a, b) for a, b in zip(vpp["metrics"][k], vpp_ref["metrics"][k], strict=True) if b)
                    for k in ("train/loss", "train/grad_norm")},
           "vpp2_mismatch_max": max(vpp["metrics"]["train/rollout_logprob_abs_diff_max"]),
           "vpp2_weights_abs": vpp_weights})
    _check_fp16(results[0]["fp16"], results[0]["fp16_pp1"])
    trains = r["train/grad_norm"].index(max(r["train/grad_norm"]))
    print({"loss_rel": _rel(m["train/loss"][trains], r["train/loss"][trains]),
           "grad_norm_rel": _rel(m["train/grad_norm"][trains], r["train/grad_norm"][trains]),
           "mismatch_max": max(m["train/rollout_logprob_abs_diff_max"]),
           "unmasked_min": min(m["train/rollout_logprob_abs_diff_unmasked"]), "weights_abs": weights})


def _check_fp16(got: dict, ref: dict) -> None:
    """fp16 loss scaling at pp 2 (the schedule scales the last stage's loss; the stages agree on every overflow)
    against pp 1: the same loss-scale trajectory and skipped steps, the finite grad norms and losses within the
    fp16 tolerance of tests/test_precision.py (2e-2 relative), the weights after the update within 1e-3."""
    m, r = got["metrics"], ref["metrics"]
    assert len(r["train/loss_scale"]) == 2 and m["train/loss_scale"] == r["train/loss_scale"], (m, r)
    skipped = [not math.isfinite(g) for g in r["train/grad_norm"]]
    assert any(skipped) and not all(skipped), r["train/grad_norm"]  # the test must see both kinds of step
    assert [not math.isfinite(g) for g in m["train/grad_norm"]] == skipped, m["train/grad_norm"]
    for key in ("train/grad_norm", "train/loss"):
        pairs = [(a, b) for a, b, skip in zip(m[key], r[key], skipped, strict=True) if not skip]
        assert all(_rel(a, b) <= 2e-2 for a, b in pairs), (key, pairs)
    # AdamW's first update is about lr * sign(gradient) per weight (lr 3e-3): fp16 round-off flips the sign of
    # near-zero gradients, so single weights differ by up to 2 lr (6.0e-3 measured) at any layout; the mean over
    # all weights is 2 lr times the share of flipped signs (2.0e-6: 0.03% flipped, with AVX2 and AVX-512 kernels
    # alike). A missed stage or a wrong scale moves a stage's weights by ~lr each, a mean of ~lr / 2: 1% of lr
    # (a 0.5% share flipped) keeps both 15x and more away from the bound.
    diffs = torch.cat([(got["weights"][k] - v).abs().flatten() for k, v in ref["weights"].items()])
    mean, worst = float(diffs.mean()), float(diffs.max())
    print({"fp16_loss_scale": m["train/loss_scale"], "fp16_skipped": skipped, "fp16_weights_mean_abs": mean,
           "fp16_weights_max_abs": worst, "fp16_grad_norm_rel": max(
               _rel(a, b) for a, b, s in zip(m["train/grad_norm"], r["train/grad_norm"], skipped, strict=True) if not s)})
    assert mean <= 3e-3 / 100 and worst <= 2 * 3e-3 * 1.01, (mean, worst)


def _train_worker4(rank: int, tmp: str) -> dict:
    import os
    from pathlib import Path

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="4",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    out = {p: _fit(Path(tmp) / p, p) for p in ("tp2_pp2", "pp2_cp2")}
    # two data-parallel replicas of two stages, against tp2 x dp2 (the same split of the prompts over 2 replicas)
    for p in ("pp2", "tp2"):
        out[f"{p}_dp2"] = _fit(Path(tmp) / f"{p}_dp2", p, "trainer.devices=4")
    # the same with the distributed optimizer (AdamW state sharded over the 2 replicas), and its resume after step 2
    sharded = ("trainer.devices=4", DIST_OPT)
    out["pp2_dp2_sharded"] = _fit(Path(tmp) / "pp2_dp2_sharded", "pp2", *sharded)
    out["sharded_part"] = _fit(Path(tmp) / "sharded_part", "pp2", *sharded, "trainer.max_steps=2",
                               "checkpoint.every_n_steps=1")
    out["sharded_resumed"] = _fit(Path(tmp) / "sharded_resumed", "pp2", *sharded,
                                  ckpt_path=Path(tmp) / "sharded_part/checkpoints/last.ckpt")
    # a resume at another pp size: tp2_pp2's step-2 checkpoint goes on at tp2_cp2 (pp 1; one replica in both)
    out["part_pp2"] = _fit(Path(tmp) / "part", "tp2_pp2", "trainer.max_steps=2", "checkpoint.every_n_steps=1")
    out["resumed_pp1"] = _fit(Path(tmp) / "resumed", "tp2_cp2", ckpt_path=Path(tmp) / "part/checkpoints/last.ckpt")
    return out


@NO_MEGATRON
@pytest.mark.distributed
@pytest.mark.slow
def test_train_py_at_tp2_pp2_and_pp2_cp2_follows_the_single_process_run(tmp_path):
    """`parallel=tp2_pp2` and `parallel=pp2_cp2` (4 gloo ranks, one data-parallel replica: the rollout is shared over
    its TP x CP x PP ranks): every step's loss, grad norm, reward and entropy within 1e-5 relative of the
    single-process HF run, masked mismatch <= 1e-5, the engine (rank 0 alone) holds every stage's weights. And
    `parallel=pp2 trainer.devices=4` (2 data-parallel replicas of 2 stages: the gradient sums over data-parallel
    ranks run around the schedule) follows `parallel=tp2 trainer.devices=4` (the same 2 replicas) within 1e-5, with
    the distributed optimizer too, whose checkpoint resumes (`_check_sharded_train`). A tp2_pp2 checkpoint resumed
    at tp2_cp2 (pp 2 -> 1, the optimizer state regrouped) gives the uninterrupted step 3."""
    results = run_distributed(_train_worker4, 4, str(tmp_path), timeout=900, preload=PRELOAD + ("topp_rl.train",
                                                                                                    "hydra"))
    ref = _fit(tmp_path / "none", "none")["metrics"]
    for parallel in ("tp2_pp2", "pp2_cp2"):
        assert [r[parallel]["has_engine"] for r in results] == [True, False, False, False], parallel
        got = results[0][parallel]
        assert got["synced"], parallel
        m = got["metrics"]
        assert max(ref["train/grad_norm"]) > 0 and len(m["train/loss"]) == 3, parallel
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/entropy"):
            assert m[key] == pytest.approx(ref[key], rel=TOL, abs=1e-9), (parallel, key, m[key], ref[key])
        assert max(m["train/rollout_logprob_abs_diff_max"]) <= TOL, parallel
        assert min(m["train/rollout_logprob_abs_diff_unmasked"]) > 1e-3, parallel
        print(parallel, {k: max(_rel(a, b) for a, b in zip(m[k], ref[k], strict=True) if b) for k in
                         ("train/loss", "train/grad_norm")}, max(m["train/rollout_logprob_abs_diff_max"]))
    pp_dp, tp_dp = results[0]["pp2_dp2"]["metrics"], results[0]["tp2_dp2"]["metrics"]
    # one engine per replica, on its first stage (megatron orders ranks with PP outermost: 0, 1 hold stage 0)
    assert [r["pp2_dp2"]["has_engine"] for r in results] == [True, True, False, False]
    assert max(tp_dp["train/grad_norm"]) > 0
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/entropy"):
        assert pp_dp[key] == pytest.approx(tp_dp[key], rel=TOL, abs=1e-9), ("pp2_dp2", key, pp_dp[key], tp_dp[key])
    assert max(pp_dp["train/rollout_logprob_abs_diff_max"]) <= TOL
    # the optimizer state regrouped from two stages to one (`stage_state.restage`): the uninterrupted run's step 3
    resumed = results[0]["resumed_pp1"]["metrics"]
    assert len(resumed["train/loss"]) == 1, "the resumed run trains only the 3rd step"
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
        assert resumed[key] == pytest.approx(results[0]["tp2_pp2"]["metrics"][key][-1:], rel=TOL, abs=1e-9), key
    # Step 3's update used the restored moments: the weights after it are the uninterrupted run's. Within 1e-4, as
    # the pp2 run against the HF run above: step 3 runs at another layout (tp2_cp2), whose round-off AdamW turns into
    # lr-sized steps on zero-true-gradient entries (1.0e-5 here); fresh moments would make every entry's step 3
    # update lr * sign(g), moving weights by up to the update printed (~lr = 3e-3) away from the uninterrupted run.
    uninterrupted, got = results[0]["tp2_pp2"]["weights"], results[0]["resumed_pp1"]["weights"]
    weights = max(float((got[k] - v).abs().max()) for k, v in uninterrupted.items())
    after_2 = results[0]["part_pp2"]["weights"]
    update = max(float((v - after_2[k]).abs().max()) for k, v in uninterrupted.items())
    assert got.keys() == uninterrupted.keys() and weights <= 1e-4, weights
    print("resumed at pp1: weights after step 3, abs", weights, "step 3's update", update)
    _check_sharded_train(results, tp_dp)


def _check_sharded_train(results: list[dict], ref: dict) -> None:
    """`parallel=pp2 parallel.distributed_optimizer=true trainer.devices=4` (megatron's DDP reduce-scatters over the
    2 replicas after the schedule, its optimizer steps each rank's half) against the same layout without it and
    against `ref`, pp 1 on the same 2 replicas (tp2 x dp2): every step's loss, grad norm, reward and entropy within 1e-5 relative, the final
    weights within 1e-5 of the plain pp2 x dp2 run's; each rank's AdamW state halved; the resume after step 2
    gives the uninterrupted run's step 3 and weights."""
    plain, got = results[0]["pp2_dp2"], results[0]["pp2_dp2_sharded"]
    m = got["metrics"]
    assert len(m["train/loss"]) == 3 and max(m["train/grad_norm"]) > 0
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/entropy"):
        assert m[key] == pytest.approx(plain["metrics"][key], rel=TOL, abs=1e-9), ("sharded", key)
        assert m[key] == pytest.approx(ref[key], rel=TOL, abs=1e-9), ("sharded vs pp 1", key)
    assert max(m["train/rollout_logprob_abs_diff_max"]) <= TOL
    assert got["synced"], "the engine's weights != the weights exported from both stages"
    weights = max(float((got["weights"][k] - v).abs().max()) for k, v in plain["weights"].items())
    assert got["weights"].keys() == plain["weights"].keys() and weights <= TOL, weights
    ratios = [r["pp2_dp2_sharded"]["state_bytes"] / r["pp2_dp2"]["state_bytes"] for r in results]
    assert all(0.45 < ratio < 0.55 for ratio in ratios), ratios  # DP = 2, up to megatron's bucket padding
    resumed = results[0]["sharded_resumed"]
    assert len(resumed["metrics"]["train/loss"]) == 1, "the resumed run trains only the 3rd step"
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
        assert resumed["metrics"][key] == pytest.approx(m[key][-1:], rel=1e-5, abs=1e-7), ("resumed", key)
    resumed_weights = max(float((resumed["weights"][k] - v).abs().max()) for k, v in got["weights"].items())
    assert resumed_weights <= 1e-6, resumed_weights
    print({"sharded_vs_plain_weights_abs": weights, "resumed_weights_abs": resumed_weights,
           "state_bytes_per_rank": [(r["pp2_dp2"]["state_bytes"], r["pp2_dp2_sharded"]["state_bytes"])
                                    for r in results],
           "sharded_vs_pp1_rel": {k: max(_rel(a, b) for a, b in zip(m[k], ref[k], strict=True) if b)
                                             for k in ("train/loss", "train/grad_norm")}})


def _sglang_worker(rank: int, tmp: str, url: str) -> dict:
    import os
    from pathlib import Path

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    # the module's server holds the default tiny model (2 layers: one per stage); test_megatron_train's settings.
    # SGLang on CPU ignores seeds, so whether a step draws a reward is chance; the entropy bonus gives every step a
    # gradient, so the weights pushed after steps 1 and 2 always differ from those the server started with.
    return _fit(Path(tmp) / "pp2", "pp2", "model.layers=2", "rollout.max_new_tokens=6", "rollout=sglang",
                f"rollout.engine.urls=['{url}']", "algo.entropy_coeff=0.01")


@NO_MEGATRON
@pytest.mark.distributed
@pytest.mark.sglang
@pytest.mark.slow
def test_sglang_rollouts_at_pp2(tmp_path, tiny_sglang_url):
    """A real SGLang server (float32) behind `parallel=pp2`: only the first stage's rank talks to it, and the weight
    sync pushes both stages' weights: after an update, the server's candidate-set log-probs still equal the
    trainer's (masked mismatch <= 1e-4 at every step, as at tp2 / cp2)."""
    results = run_distributed(_sglang_worker, 2, str(tmp_path), tiny_sglang_url, timeout=600,
                              preload=PRELOAD + ("topp_rl.train", "hydra"))
    assert [r["has_engine"] for r in results] == [True, False]
    m = results[0]["metrics"]
    assert len(m["train/loss"]) == 3 and min(m["train/grad_norm"][:-1]) > 0  # the last steps sample updated weights
    assert max(m["train/rollout_logprob_abs_diff_max"]) <= 1e-4
    assert min(m["train/rollout_logprob_abs_diff_unmasked"]) > 1e-3
    print(m["train/rollout_logprob_abs_diff_max"], m["train/grad_norm"])


# Qwen3-MoE through train.py at pp2_ep2: replay on, the load-balancing loss on (its gradient crosses the stages)
MOE_TRAIN = ("model.family=qwen3_moe", "rollout.routing_replay=true", "module.moe_aux_loss_coeff=0.01")


def _moe_train_worker4(rank: int, tmp: str) -> dict:
    import os
    from pathlib import Path

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="4",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    out = {p: _fit(Path(tmp) / p, p, *MOE_TRAIN) for p in ("pp2_ep2", "tp2_ep2")}
    out["part"] = _fit(Path(tmp) / "part", "pp2_ep2", *MOE_TRAIN, "trainer.max_steps=2", "checkpoint.every_n_steps=1")
    out["resumed"] = _fit(Path(tmp) / "resumed", "pp2_ep2", *MOE_TRAIN,
                          ckpt_path=Path(tmp) / "part/checkpoints/last.ckpt")
    return out


@NO_MEGATRON
@pytest.mark.distributed
@pytest.mark.slow
def test_train_py_moe_at_pp2_ep2_follows_tp2_ep2(tmp_path):
    """`python train.py parallel=pp2_ep2` with a tiny Qwen3-MoE, routing replay and the load-balancing loss
    (4 gloo ranks: 2 stages x 2 data-parallel ranks, each stage's experts split over its 2 ranks) against
    `parallel=tp2_ep2` (pp 1, the same 2 data-parallel replicas and prompt split; the single-process run splits
    the prompts otherwise): every step's loss, grad norm, reward, entropy, MoE aux loss and expert load within
    1e-5 relative, the same routing agreement, masked mismatch <= 1e-5; each replica's engine (on its first
    stage) holds every stage's weights, its experts gathered over EP; the HF export of a pp2_ep2 checkpoint
    holds the stages' weights bit for bit, and a run resumed from it gives the uninterrupted run's 3rd step."""
    results = run_distributed(_moe_train_worker4, 4, str(tmp_path), timeout=600,
                              preload=PRELOAD + ("topp_rl.train", "hydra"))
    got, ref = results[0]["pp2_ep2"]["metrics"], results[0]["tp2_ep2"]["metrics"]
    # one engine per replica, on its first stage (PP outermost: ranks 0 and 1 hold stage 0)
    assert [r["pp2_ep2"]["has_engine"] for r in results] == [True, True, False, False]
    assert results[0]["pp2_ep2"]["synced"] and results[1]["pp2_ep2"]["synced"]
    assert len(got["train/loss"]) == 3 and max(ref["train/grad_norm"]) > 0
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/entropy", *MOE_KEYS):
        assert got[key] == pytest.approx(ref[key], rel=TOL, abs=1e-9), (key, got[key], ref[key])
    assert got["train/routing_agreement"] == ref["train/routing_agreement"] == [1.0] * 3
    assert max(got["train/rollout_logprob_abs_diff_max"]) <= TOL
    assert min(got["train/rollout_logprob_abs_diff_unmasked"]) > 1e-3
    from safetensors.torch import load_file

    from topp_rl.run.export import export_checkpoint

    out_dir = export_checkpoint(tmp_path / "part" / "checkpoints" / "last.ckpt", tmp_path / "export_pp2_ep2")
    exported = load_file(str(out_dir / "model.safetensors"))
    held = results[0]["part"]["weights"]
    assert exported.keys() == held.keys() and all(torch.equal(exported[k], v) for k, v in held.items())
    assert exported["model.layers.3.mlp.experts.down_proj"].shape[0] == 4  # both EP ranks' experts
    resumed = results[0]["resumed"]["metrics"]
    assert len(resumed["train/loss"]) == 1, "the resumed run trains only the 3rd step"
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", *MOE_KEYS):
        assert resumed[key] == pytest.approx(got[key][-1:], rel=1e-5, abs=1e-7), key
    # the 3rd step's update used the restored AdamW state: each EP rank's own experts' moments
    final, resumed_final = results[0]["pp2_ep2"]["weights"], results[0]["resumed"]["weights"]
    resume_abs = max(float((resumed_final[k] - v).abs().max()) for k, v in final.items())
    assert resume_abs <= 1e-6, max((float((resumed_final[k] - v).abs().max()), k) for k, v in final.items())
    print({k: max(_rel(a, b) for a, b in zip(got[k], ref[k], strict=True) if b) for k in
           ("train/loss", "train/grad_norm", *MOE_KEYS)}, max(got["train/rollout_logprob_abs_diff_max"]),
          min(got["train/rollout_logprob_abs_diff_unmasked"]), got["train/grad_norm"], resume_abs)
