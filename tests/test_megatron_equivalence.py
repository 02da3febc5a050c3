"""The Megatron backbone equals the HF model: logits, restricted log-probs and parameter gradients, at every
(TP, CP) in {(1,1), (2,1), (1,2), (2,2)}, for Qwen2 (tied embeddings, QKV bias), Llama (untied, llama3 RoPE),
Qwen3 (QK-norm, head_dim 24 != hidden / heads), Mistral (sliding window 5, shorter than two of the sequences)
and Qwen3-MoE (4 experts top-2; norm_topk_prob true and false; layer 1 dense via mlp_only_layers), the MoE also at
expert-parallel sizes 2 and 4 (with TP 2, CP 2). With EP, an expert sees the tokens of every rank of its TP x EP
group; the test gives every data-parallel replica the same batch, so an expert's gradient is the reference's
times the number of replicas in that group.

One 4-process gloo spawn checks every case (parallel state is re-initialised per layout; a layout with fewer
model-parallel ranks runs as data-parallel replicas). The reference is a single-process HF forward per sequence
with a dense masked log-softmax written out here. Gradients are compared under HF names after
`hf_state_dict(grads=True)`, which gathers the TP shards; CP ranks' partial gradients are summed first. The
export is bit-exact, in memory and as an HF checkpoint directory that `from_pretrained` reloads.
Equality of the TP=2 gradients also checks that the hidden-state gradient is summed over TP exactly once
(inside `candidate_head_logprobs`): a second sum would double every gradient below the final norm.
"""

import importlib.util
import tempfile
from types import SimpleNamespace

import pytest
import torch
from dist_utils import run_distributed

NO_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core (the `megatron` extra) is not installed")

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)]
MOE_LAYOUTS = [(1, 1, 2), (2, 1, 2), (1, 2, 2), (1, 1, 4)]  # (tp, cp, ep) at world size 4
FAMILIES = ["qwen2", "llama", "qwen3", "mistral", "qwen3_moe", "qwen3_moe_unnormed"]
MOE_FAMILIES = ("qwen3_moe", "qwen3_moe_unnormed")
TEMPERATURE = 0.8
TOL = 1e-5
PRELOAD = ("megatron.core", "megatron.core.models.gpt", "topp_rl.megatron", "topp_rl.trainer.hook", "transformers")


def hf_model(family: str):
    """Tiny HF model: Qwen2 tied with QKV bias; Llama untied with llama3 RoPE scaling (short original context,
    so the scaling changes most frequencies); Qwen3 with a head_dim unlike hidden / heads; Mistral with a sliding
    window shorter than the sequences; Qwen3-MoE (sparse layer 0, dense layer 1) routing with and without
    renormalised top-k weights."""
    from transformers import AutoModelForCausalLM

    from topp_rl.models import build_tiny_model

    if family == "qwen2":
        return build_tiny_model("qwen2", tie_embeddings=True, seed=1)
    if family == "qwen3":
        return build_tiny_model("qwen3", tie_embeddings=False, head_dim=24, seed=5)
    if family == "mistral":
        return build_tiny_model("mistral", tie_embeddings=False, sliding_window=5, seed=6)
    if family in MOE_FAMILIES:
        return build_tiny_model("qwen3_moe", tie_embeddings=True, mlp_only_layers=[1], seed=7,
                                norm_topk_prob=family == "qwen3_moe")
    config = build_tiny_model("llama", tie_embeddings=False).config
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16}
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert model.model.rotary_emb.rope_type == "llama3"
    return model


def packed_batch(vocab: int):
    """Three sequences; candidate rows: random sets, empty rows (unrestricted) and one sample without data."""
    from topp_rl.ops import Candidates

    g = torch.Generator().manual_seed(3)
    seq_lengths = torch.tensor([9, 14, 6])
    response_lengths = torch.tensor([4, 8, 3])
    tokens = torch.randint(0, vocab, (int(seq_lengths.sum()),), generator=g)
    starts = torch.cumsum(seq_lengths, 0) - seq_lengths
    response_tokens = torch.cat([tokens[s + L - R: s + L] for s, L, R in
                                 zip(starts.tolist(), seq_lengths.tolist(), response_lengths.tolist(), strict=True)])
    rows = []
    for i in range(int(response_lengths.sum())):
        if i >= 12 or i % 5 == 4:  # the last sample has no candidate data; some tokens are non-trainable
            rows.append([])
        else:
            k = int(torch.randint(1, 6, (1,), generator=g))
            rows.append(torch.randperm(vocab, generator=g)[:k].tolist())
    return SimpleNamespace(
        tokens=tokens, seq_lengths=seq_lengths, response_lengths=response_lengths,
        response_tokens=response_tokens, candidates=Candidates.from_lists(rows),
        weights=torch.randn(int(response_lengths.sum()), generator=g),
        rollout_log_probs=torch.zeros(int(response_lengths.sum())), loss_mask=torch.ones(int(response_lengths.sum())),
        routes=None, staleness=None,  # no recorded MoE routes, on-policy tokens (PackedBatch's defaults)
    )


def reference(model, batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """HF single process: (full logits [T, V], masked log-probs [R], grads of sum(weights * log-probs))."""
    model.zero_grad()
    hidden = torch.cat([model.model(input_ids=t[None]).last_hidden_state[0]
                        for t in batch.tokens.split(batch.seq_lengths.tolist())])
    logits = model.lm_head(hidden)
    ends = torch.cumsum(batch.seq_lengths, 0)
    rows = torch.cat([torch.arange(e - r - 1, e - 1) for e, r in zip(ends.tolist(), batch.response_lengths.tolist(), strict=True)])
    z = logits[rows] / TEMPERATURE
    mask = torch.zeros_like(z, dtype=torch.bool)
    for i, cand in enumerate(batch.candidates.to_lists()):
        if cand:
            mask[i] = True
            mask[i, cand] = False
            mask[i, batch.response_tokens[i]] = False
    logprobs = z.masked_fill(mask, float("-inf")).log_softmax(-1).gather(1, batch.response_tokens[:, None])[:, 0]
    (batch.weights * logprobs).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), logprobs.detach(), grads


def _case(family: str, tp: int, cp: int, ep: int = 1) -> dict[str, float]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from topp_rl.megatron import MegatronBackbone, load_hf_into
    from topp_rl.megatron.export import hf_state_dict, save_hf_checkpoint
    from topp_rl.megatron.grads import is_expert_param
    from topp_rl.parallel import ParallelLayout
    from topp_rl.trainer.hook import ToppLogProb

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 expert_model_parallel_size=ep)
    try:
        model = hf_model(family)
        batch = packed_batch(model.config.vocab_size)
        ref_logits, ref_logprobs, ref_grads = reference(model, batch)
        layout = ParallelLayout.from_megatron(model.config.vocab_size)
        backbone = MegatronBackbone(model.config, layout=layout)
        load_hf_into(backbone.model, model.state_dict(), model.config, tp_size=tp,
                     tp_rank=ps.get_tensor_model_parallel_rank(), ep_size=ep, ep_rank=layout.ep_rank)
        exported = hf_state_dict(backbone)
        with tempfile.TemporaryDirectory() as tmp:  # HF checkpoint export (collective; every rank writes its own)
            save_hf_checkpoint(backbone, tmp)
            reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).state_dict()
        hf_dir_exact = all(torch.equal(reloaded[n], t) for n, t in model.state_dict().items())
        hidden, weight = backbone.forward_hidden(batch)
        positions = layout.local_positions(batch.seq_lengths)
        lo, hi = layout.vocab_range()
        real = positions >= 0
        logit_err = ((hidden[real] @ weight.T) - ref_logits[positions[real], lo:hi]).abs().max().detach()

        out = ToppLogProb(temperature=TEMPERATURE)(batch, layout=layout, hidden=hidden, weight=weight)
        (batch.weights[out.token_index] * out.logprobs).sum().backward()
        full = torch.zeros_like(ref_logprobs).index_put((out.token_index,), out.logprobs.detach())
        if cp > 1:  # CP ranks hold disjoint tokens and partial parameter gradients: sum both
            dist.all_reduce(full, group=layout.cp_group)
        for name, p in backbone.model.named_parameters():
            if is_expert_param(name):  # as in training (GradSync): experts sum over the expert-DP group
                dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
            elif cp > 1:
                dist.all_reduce(p.grad, group=layout.cp_group)
        grads = hf_state_dict(backbone, grads=True)
        replicas = dist.get_world_size() // (tp * cp)  # every DP replica has this batch (see module docstring)
        grads = {n: g / replicas if ".mlp.experts." in n else g for n, g in grads.items()}
        token_index, onpolicy = ToppLogProb(temperature=TEMPERATURE).onpolicy(
            batch, layout=layout, hidden=hidden.detach(), weight=weight.detach())
        onpolicy_err = (onpolicy.logprobs - ref_logprobs[token_index]).abs().max()
        state = model.state_dict()
        return {
            "logits": float(logit_err),
            "logprobs": float((full - ref_logprobs).abs().max()),
            "onpolicy": float(onpolicy_err),
            "grads": max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()
                         if n in grads),
            "grad_names_missing": float(len(set(ref_grads) - set(grads) - {"lm_head.weight"})),
            "export_exact": float(all(torch.equal(exported[n], state[n]) for n in exported)
                                  and set(exported) | {"lm_head.weight"} >= set(dict(model.named_parameters()))),
            "tokens_covered": float(int((full != 0).sum()) == full.numel()),
            "hf_dir_exact": float(hf_dir_exact),
        }
    finally:
        ps.destroy_model_parallel()


def _all_cases(rank: int) -> dict:
    torch.manual_seed(0)
    cases = [(f, *layout) for f in FAMILIES for layout in LAYOUTS]
    cases += [(f, *layout) for f in MOE_FAMILIES for layout in MOE_LAYOUTS]
    return {case: _case(*case) for case in cases}


@NO_MEGATRON
@pytest.mark.distributed
def test_megatron_matches_hf_at_every_layout():
    results = run_distributed(_all_cases, 4, timeout=900, preload=PRELOAD)
    for rank, per_case in enumerate(results):
        for case, r in per_case.items():
            where = f"rank {rank} {case}"
            assert r["logits"] <= TOL, (where, r)
            assert r["logprobs"] <= TOL, (where, r)
            assert r["onpolicy"] <= TOL, (where, r)
            assert r["grads"] <= TOL, (where, r)
            assert r["grad_names_missing"] == 0, (where, r)
            assert r["export_exact"] == 1.0, (where, r)
            assert r["tokens_covered"] == 1.0, (where, r)
            assert r["hf_dir_exact"] == 1.0, (where, r)
    print({k: {m: v for m, v in r.items() if m in ("logits", "logprobs", "grads")} for k, r in results[0].items()})
