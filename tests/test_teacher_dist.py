"""The distillation teacher on the Megatron backbone at (TP, CP) in {(1,1), (2,1), (1,2), (2,2)} equals one
process: a teacher of another family and depth (Llama, 3 layers) than the policy (Qwen2, 2 layers), converted by
the same path the strategy uses (`MegatronBackbone.from_hf`). One 4-process gloo spawn checks every layout against
the HF backbone run whole in the same process: the teacher's log-probs over the kept sets and over the full
vocabulary, the OPD step's train/teacher_kl, train/teacher_logprob_mean and loss, and the policy's gradient (under
HF names, CP ranks' partial gradients summed as the strategy's GradSync does)."""

import importlib.util

import pytest
import torch
from dist_utils import run_distributed

NO_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core (the `megatron` extra) is not installed")
PRELOAD = ("megatron.core", "megatron.core.models.gpt", "topp_rl.megatron", "topp_rl.trainer.module", "transformers")
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
TOL = 1e-5
KEYS = ("train/teacher_kl", "train/teacher_logprob_mean", "train/loss")


def _models():
    from topp_rl.models import build_char_tokenizer, build_tiny_model

    sizes = dict(vocab_size=96, hidden=32, heads=4, kv_heads=2, tokenizer=build_char_tokenizer())
    return (build_tiny_model("qwen2", layers=2, seed=3, tie_embeddings=True, **sizes),
            build_tiny_model("llama", layers=3, seed=11, tie_embeddings=False, **sizes))


def _opd_step(policy, teacher, micro, *, teacher_use_mask: bool, cp_group=None) -> dict:
    """One OPD backward: the teacher's log-probs per micro-batch and the step's figures; the policy's gradients
    are left in .grad (CP ranks' partial gradients summed over `cp_group`)."""
    from test_module import TEMP

    from topp_rl.losses import OPDLoss
    from topp_rl.megatron.grads import GradSync
    from topp_rl.trainer.hook import ToppLogProb
    from topp_rl.trainer.module import PolicyModule
    from topp_rl.trainer.timer import PhaseTimer

    module = PolicyModule(policy=policy, loss=OPDLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          hook=ToppLogProb(use_mask=True, temperature=TEMP), teacher=teacher,
                          teacher_use_mask=teacher_use_mask)
    teachers = module.teacher_pass(micro)
    sync = GradSync(list(policy.parameters()), cp_group)
    sync.before()
    sums, _ = module.accumulate_gradients(micro, [None] * len(micro), old=None, timer=PhaseTimer(), teachers=teachers)
    sync.after()
    return {"teachers": teachers, "figures": {k: sums[k][0] / sums[k][1] for k in KEYS}}


def _megatron(tp: int, cp: int, hf_policy, hf_teacher, micro, *, teacher_use_mask: bool) -> tuple[dict, dict]:
    """`_opd_step` on Megatron backbones at (tp, cp), and the policy's gradients under HF names."""
    import copy

    from megatron.core import parallel_state as ps

    from topp_rl.megatron import MegatronBackbone
    from topp_rl.megatron.export import hf_named_tensors
    from topp_rl.parallel import ParallelLayout

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        layout = ParallelLayout.from_megatron(96)
        policy = MegatronBackbone.from_hf(copy.deepcopy(hf_policy), layout=layout)
        teacher = MegatronBackbone.from_hf(hf_teacher, layout=layout)
        out = _opd_step(policy, teacher, micro, teacher_use_mask=teacher_use_mask, cp_group=layout.cp_group)
        return out, {n: g.clone() for n, g in hf_named_tensors(policy, grads=True)}
    finally:
        ps.destroy_model_parallel()


def _all_cases(rank: int) -> dict:
    import copy

    from test_module import make_samples, pack

    from topp_rl.trainer.backbone import HFBackbone

    torch.manual_seed(0)
    hf_policy, hf_teacher = _models()
    samples = make_samples(hf_policy)
    micro = [pack(samples, [0, 1, 2], advantages=torch.zeros(6)), pack(samples, [3, 4, 5], advantages=torch.zeros(6))]
    out = {}
    for use_mask in (True, False):
        whole = HFBackbone(copy.deepcopy(hf_policy))
        ref = _opd_step(whole, HFBackbone(hf_teacher), micro, teacher_use_mask=use_mask)
        ref_grads = {n: p.grad for n, p in whole.model.named_parameters()}
        for tp, cp in LAYOUTS:
            got, grads = _megatron(tp, cp, hf_policy, hf_teacher, micro, teacher_use_mask=use_mask)
            out[(tp, cp, use_mask)] = {
                "teacher_logprobs": max(float((a - b).abs().max())
                                        for a, b in zip(got["teachers"], ref["teachers"], strict=True)),
                "figures": max(abs(got["figures"][k] - ref["figures"][k]) for k in KEYS),
                "grads": max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items() if n in grads),
                "grad_names": len(set(ref_grads) & set(grads)),
                "kl": got["figures"]["train/teacher_kl"],
            }
    return out


@NO_MEGATRON
@pytest.mark.distributed
def test_megatron_teacher_equals_one_process_at_tp2_and_cp2():
    results = run_distributed(_all_cases, 4, timeout=900, preload=PRELOAD)
    for rank, per_case in enumerate(results):
        for case, r in per_case.items():
            where = f"rank {rank} (tp, cp, teacher_use_mask)={case}"
            assert r["teacher_logprobs"] <= TOL, (where, r)
            assert r["figures"] <= TOL, (where, r)
            assert r["grads"] <= TOL and r["grad_names"] >= 10, (where, r)
            assert r["kl"] > 0.01, (where, r)  # a teacher unlike the policy
