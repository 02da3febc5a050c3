"""On-policy distillation losses against a dense float64 reverse KL on small vocabularies.

Each test position is enumerated exactly: every kept token y of the position is one loss token weighted by its
sampling probability (loss_mask = q(y), fractional weights), so the token-mean loss and its gradient are the
expectations over the student's sampling distribution, with no Monte Carlo error. The student's log-probs come
from the project's op (`token_logprobs` over the kept sets of `sampling_candidates`); the reference is
log_softmax over the kept set with -inf elsewhere.
"""

import pytest
import torch

from topp_rl.losses import GRPOLoss, LossInputs, OPDLoss
from topp_rl.ops import Candidates, sampling_candidates, token_logprobs

V, P = 64, 5  # vocabulary, positions
SAMPLING = {"top_p=1.0": {"top_p": 1.0}, "top_p=0.9": {"top_p": 0.9}, "top_k=20": {"top_k": 20}}


def positions(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(P, V, generator=g, dtype=torch.float64) * 2
    teacher = student + torch.randn(P, V, generator=g, dtype=torch.float64)
    return student, teacher


def kept_sets(logits: torch.Tensor, sampling: dict) -> list[list[int]]:
    return sampling_candidates(logits.float(), **sampling).to_lists()


def dense_kl(student: torch.Tensor, teacher: torch.Tensor, sets: list[list[int]], *, teacher_masked: bool) -> torch.Tensor:
    """Mean over positions of KL(q || p) = sum_{y in S} q(y) (log q(y) - log p(y)), dense, float64."""
    keep = torch.zeros_like(student, dtype=torch.bool)
    for i, s in enumerate(sets):
        keep[i, s] = True
    log_q = torch.log_softmax(student.masked_fill(~keep, float("-inf")), -1)
    log_p = torch.log_softmax(teacher.masked_fill(~keep, float("-inf")) if teacher_masked else teacher, -1)
    gap = torch.where(keep, log_q - log_p, 0.0)  # 0, not nan, outside S (and no nan in the backward)
    return (log_q.exp() * gap).sum(-1).mean()


def enumerated(student: torch.Tensor, teacher: torch.Tensor, sets: list[list[int]], *, teacher_masked: bool,
               behaviour: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
    """LossInputs fields with one token per (position, kept id), weighted by its sampling probability (q, or
    `behaviour`'s kept-set probability when given), and the student log-probs (with grad) from the op."""
    rows = [i for i, s in enumerate(sets) for _ in s]
    tokens = torch.tensor([y for s in sets for y in s])
    cands = Candidates.from_lists([sets[i] for i in rows])
    logprobs = token_logprobs(student[rows], tokens, cands=cands)
    teacher_lp = token_logprobs(teacher[rows], tokens, cands=cands if teacher_masked else None)
    sampler = logprobs if behaviour is None else token_logprobs(behaviour[rows], tokens, cands=cands)
    fields = {
        "old_logprobs": logprobs.detach(),
        "advantages": torch.zeros(len(rows), dtype=torch.float64),
        "loss_mask": sampler.detach().exp(),
        "seq_index": torch.tensor(rows),
        "num_loss_tokens_global": float(P),  # each position's weights sum to 1
        "num_sequences_global": P,
        "teacher_logprobs": teacher_lp,
        "rollout_logprobs": sampler.detach(),
    }
    return fields, logprobs


@pytest.mark.parametrize("teacher_masked", [True, False], ids=["kept-set teacher", "full-vocab teacher"])
@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING.keys())
def test_opd_value_and_gradient_equal_the_dense_reverse_kl(sampling, teacher_masked):
    student, teacher = positions()
    sets = kept_sets(student, sampling)
    leaf = student.clone().requires_grad_(True)
    fields, logprobs = enumerated(leaf, teacher, sets, teacher_masked=teacher_masked)
    loss, metrics = OPDLoss()(LossInputs(logprobs=logprobs, **fields))
    (grad,) = torch.autograd.grad(loss, leaf)

    ref_leaf = student.clone().requires_grad_(True)
    ref = dense_kl(ref_leaf, teacher, sets, teacher_masked=teacher_masked)
    (ref_grad,) = torch.autograd.grad(ref, ref_leaf)

    kl_sum, tokens = metrics["train/teacher_kl"]
    torch.testing.assert_close(kl_sum / tokens, ref.item(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loss.item(), ref.item(), rtol=1e-10, atol=1e-12)  # ratio 1: loss = E_q[k1]
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    if teacher_masked:  # same support: KL >= 0, and > 0 since the teacher differs
        assert ref.item() > 0
    if sampling.get("top_p", 1.0) < 1.0 or sampling.get("top_k"):
        assert min(len(s) for s in sets) < V  # the kept sets do cut the vocabulary


def test_full_vocab_teacher_is_the_kept_set_kl_minus_log_teacher_mass():
    student, teacher = positions(1)
    sets = kept_sets(student, {"top_p": 0.9})
    kept = dense_kl(student, teacher, sets, teacher_masked=True)
    full = dense_kl(student, teacher, sets, teacher_masked=False)
    log_mass = torch.stack([torch.logsumexp(teacher[i].log_softmax(-1)[s], 0) for i, s in enumerate(sets)])
    torch.testing.assert_close(full, kept - log_mass.mean(), rtol=1e-12, atol=1e-12)
    assert (log_mass < 0).all()


def test_stale_samples_importance_weighted_give_the_on_policy_gradient():
    """Samples of an older policy b, weighted by TIS exp(old - rollout) = q / b (uncapped), have the same
    expected gradient as on-policy samples: the grad of KL(q || p)."""
    student, teacher = positions(2)
    sets = kept_sets(student, {"top_p": 0.9})
    behaviour = student + 0.3 * torch.randn(student.shape, generator=torch.Generator().manual_seed(3),
                                            dtype=torch.float64)
    leaf = student.clone().requires_grad_(True)
    fields, logprobs = enumerated(leaf, teacher, sets, teacher_masked=True, behaviour=behaviour)
    loss, _ = OPDLoss(tis_cap=1e9)(LossInputs(logprobs=logprobs, **fields))
    (grad,) = torch.autograd.grad(loss, leaf)
    ref_leaf = student.clone().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad(dense_kl(ref_leaf, teacher, sets, teacher_masked=True), ref_leaf)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_grpo_with_teacher_kl_adds_coeff_times_the_reverse_kl_gradient():
    student, teacher = positions(4)
    sets = kept_sets(student, {"top_k": 20})
    coeff = 0.25
    reward_adv = torch.randn(P, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def grad_of(loss_fn, *, with_reward: bool) -> tuple[torch.Tensor, dict]:
        leaf = student.clone().requires_grad_(True)
        fields, logprobs = enumerated(leaf, teacher, sets, teacher_masked=True)
        if with_reward:
            fields["advantages"] = reward_adv[fields["seq_index"]]
        loss, metrics = loss_fn(LossInputs(logprobs=logprobs, **fields))
        return torch.autograd.grad(loss, leaf)[0], metrics

    combined, metrics = grad_of(GRPOLoss(teacher_kl_coef=coeff), with_reward=True)
    reward_only, _ = grad_of(GRPOLoss(), with_reward=True)
    ref_leaf = student.clone().requires_grad_(True)
    ref = dense_kl(ref_leaf, teacher, sets, teacher_masked=True)
    (kl_grad,) = torch.autograd.grad(ref, ref_leaf)
    torch.testing.assert_close(combined, reward_only + coeff * kl_grad, rtol=1e-9, atol=1e-12)
    kl_sum, n = metrics["train/teacher_kl"]
    torch.testing.assert_close(kl_sum / n, ref.item(), rtol=1e-10, atol=1e-12)


def test_tokens_outside_the_loss_carry_no_teacher_term():
    """Environment tokens (loss_mask 0) change neither the loss nor the teacher figures."""
    student, teacher = positions(6)
    sets = kept_sets(student, {"top_p": 0.9})
    fields, logprobs = enumerated(student, teacher, sets, teacher_masked=True)
    base_loss, base = OPDLoss()(LossInputs(logprobs=logprobs, **fields))
    extra = 3
    padded = {k: (torch.cat([v, torch.full((extra,), -7.0 if v.is_floating_point() else P, dtype=v.dtype)])
                  if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
    padded["loss_mask"][-extra:] = 0.0
    loss, metrics = OPDLoss()(LossInputs(logprobs=torch.cat([logprobs, torch.full((extra,), -1.0,
                                                                              dtype=torch.float64)]), **padded))
    torch.testing.assert_close(loss, base_loss)
    for key in ("train/teacher_kl", "train/teacher_logprob_mean"):
        torch.testing.assert_close(metrics[key], base[key])


def test_teacher_term_without_teacher_logprobs_is_refused():
    student, teacher = positions()
    fields, logprobs = enumerated(student, teacher, kept_sets(student, {"top_p": 0.9}), teacher_masked=True)
    fields["teacher_logprobs"] = None
    with pytest.raises(ValueError, match="teacher_kl_coeff=1.0 .*teacher=hf_path"):
        OPDLoss()(LossInputs(logprobs=logprobs, **fields))
    with pytest.raises(ValueError, match="teacher_kl_coeff=-0.1 must be >= 0"):
        GRPOLoss(teacher_kl_coef=-0.1)
    with pytest.raises(ValueError, match="algo=opd with teacher_kl_coeff=0"):
        OPDLoss(teacher_kl_coef=0.0)
    _, metrics = GRPOLoss()(LossInputs(logprobs=logprobs, **fields))  # off and no teacher: no teacher figures
    assert "train/teacher_kl" not in metrics
