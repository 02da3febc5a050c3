"""RL losses against hand-written per-sample references (values and gradients), micro-batch equality,
KL estimators, TIS / ICEPOP and config validation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from topp_rl.losses import (
    CISPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    GSPOLoss,
    LossInputs,
    ReinforcePPLoss,
    kl_estimate,
)

LENGTHS = [3, 5, 1, 4]  # tokens per sample
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def make_batch(seed: int = 0, *, lengths=LENGTHS, spread: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    r = sum(lengths)
    old = -torch.rand(r, generator=g, dtype=torch.float64) * 3 - 0.05
    new = old + torch.randn(r, generator=g, dtype=torch.float64) * spread
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    adv_seq = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    mask = (torch.rand(r, generator=g) > 0.2).double()
    mask[0] = 1.0
    return {
        "logprobs": new,
        "old_logprobs": old,
        "advantages": adv_seq[seq].clone(),
        "loss_mask": mask,
        "seq_index": seq + 10,  # ids need not start at 0
        "ref_logprobs": old + torch.randn(r, generator=g, dtype=torch.float64) * 0.3,
        "rollout_logprobs": old + torch.randn(r, generator=g, dtype=torch.float64) * 0.5,
    }


def inputs_of(batch, *, lp, lo=0, hi=None, n_tok=None, n_seq=None):
    hi = len(batch["logprobs"]) if hi is None else hi
    fields = {k: (lp[lo:hi] if k == "logprobs" else v[lo:hi]) for k, v in batch.items()}
    return LossInputs(
        **fields,
        num_loss_tokens_global=float(batch["loss_mask"].sum()) if n_tok is None else n_tok,
        num_sequences_global=len(torch.unique(batch["seq_index"])) if n_seq is None else n_seq,
    )


def per_sample(batch, lp):
    """Yield per-sample dicts of python float lists (and the logprob tensor slice for autograd)."""
    start = 0
    for n in LENGTHS:
        sl = slice(start, start + n)
        yield {k: v[sl] for k, v in batch.items()} | {"lp": lp[sl]}
        start += n


def reference_aggregate(token_losses, batch, mode):
    """token_losses: list (per sample) of lists of per-token loss tensors (already masked)."""
    n_tok = float(batch["loss_mask"].sum())
    total = 0.0
    for sample_losses, s in zip(token_losses, per_sample(batch, batch["logprobs"]), strict=True):
        seq_sum = sum(sample_losses)
        if mode == "token-mean":
            total = total + seq_sum / n_tok
        elif mode == "seq-mean-token-mean":
            total = total + seq_sum / max(float(s["loss_mask"].sum()), 1.0) / len(LENGTHS)
        else:
            total = total + seq_sum / len(LENGTHS)
    return total


def ppo_token(lp, old, adv, lo, hi):
    r = torch.exp(lp - old)
    return torch.max(-adv * r, -adv * torch.clamp(r, lo, hi))


def reference_grpo(batch, lp, *, mode, eps=0.2, eps_high=0.28, kl_coef=0.0):
    losses, kls = [], []
    for s in per_sample(batch, lp):
        row, krow = [], []
        for t in range(len(s["lp"])):
            m = s["loss_mask"][t]
            row.append(
                m * ppo_token(s["lp"][t], s["old_logprobs"][t], s["advantages"][t], 1 - eps, 1 + eps_high)
            )
            x = s["lp"][t] - s["ref_logprobs"][t]
            krow.append(m * (torch.exp(-x) - 1 + x))
        losses.append(row)
        kls.append(krow)
    return reference_aggregate(losses, batch, mode) + kl_coef * reference_aggregate(kls, batch, mode)


def check(loss_fn, batch, reference):
    lp = batch["logprobs"].clone().requires_grad_(True)
    loss, metrics = loss_fn(inputs_of(batch, lp=lp))
    (grad,) = torch.autograd.grad(loss, lp)
    lp_ref = batch["logprobs"].clone().requires_grad_(True)
    ref = reference(lp_ref)
    (grad_ref,) = torch.autograd.grad(ref, lp_ref)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)
    assert grad.abs().sum() > 0
    return loss, grad, metrics


@pytest.mark.parametrize("mode", MODES)
def test_grpo_matches_reference_in_every_aggregation(mode):
    batch = make_batch(1)
    fn = GRPOLoss(eps_clip=0.2, eps_clip_high=0.28, aggregation=mode, kl_coef=0.05)
    loss, _, metrics = check(fn, batch, lambda lp: reference_grpo(batch, lp, mode=mode, kl_coef=0.05))
    assert metrics["train/loss"] == pytest.approx((float(loss.detach()), 1.0))
    # clip fraction vs a direct count over loss tokens
    r = torch.exp(batch["logprobs"] - batch["old_logprobs"])
    a = batch["advantages"]
    clipped = (-a * r.clamp(0.8, 1.28)) > (-a * r)
    m = batch["loss_mask"]
    assert metrics["train/clip_frac"] == pytest.approx((float((clipped * m).sum()), float(m.sum())))
    assert 0 < metrics["train/clip_frac"][0] < metrics["train/clip_frac"][1]


def test_dr_grpo_is_grpo_with_token_sum():
    batch = make_batch(2)
    fn = DrGRPOLoss(eps_clip=0.2, eps_clip_high=0.28)
    assert fn.aggregation == "seq-mean-token-sum"
    check(fn, batch, lambda lp: reference_grpo(batch, lp, mode="seq-mean-token-sum"))


def test_gspo_sequence_ratio_matches_reference():
    batch = make_batch(3, spread=0.05)
    eps, eps_high = 0.01, 0.02

    def reference(lp):
        losses = []
        for s in per_sample(batch, lp):
            m = s["loss_mask"]
            n = max(float(m.sum()), 1.0)
            log_s = sum(m[t] * (s["lp"][t] - s["old_logprobs"][t]) for t in range(len(m))) / n
            seq_ratio = torch.exp(log_s)
            a = s["advantages"][0]
            term = torch.max(-a * seq_ratio, -a * torch.clamp(seq_ratio, 1 - eps, 1 + eps_high))
            losses.append([m[t] * term for t in range(len(m))])
        return reference_aggregate(losses, batch, "seq-mean-token-mean")

    _, _, metrics = check(GSPOLoss(eps_clip=eps, eps_clip_high=eps_high), batch, reference)
    assert 0 < metrics["train/clip_frac"][0]  # some sequences clipped, so the test covers both branches


def test_cispo_matches_reference_and_keeps_gradient_of_clipped_tokens():
    batch = make_batch(4, spread=0.6)
    hi = 0.3

    def reference(lp):
        losses = []
        for s in per_sample(batch, lp):
            row = []
            for t in range(len(s["lp"])):
                w = torch.exp(s["lp"][t] - s["old_logprobs"][t]).detach().clamp(max=1 + hi)
                row.append(s["loss_mask"][t] * (-w * s["advantages"][t] * s["lp"][t]))
            losses.append(row)
        return reference_aggregate(losses, batch, "token-mean")

    _, grad_cispo, _ = check(CISPOLoss(eps_clip=1.0, eps_clip_high=hi), batch, reference)
    lp = batch["logprobs"].clone().requires_grad_(True)
    loss_ppo, _ = GRPOLoss(eps_clip=0.2, eps_clip_high=hi)(inputs_of(batch, lp=lp))
    (grad_ppo,) = torch.autograd.grad(loss_ppo, lp)
    r = torch.exp(batch["logprobs"] - batch["old_logprobs"])
    a, m = batch["advantages"], batch["loss_mask"]
    ppo_clipped = ((r > 1 + hi) & (a > 0)) | ((r < 0.8) & (a < 0))
    sel = ppo_clipped & (m > 0)
    assert sel.any()
    assert torch.all(grad_ppo[sel] == 0)  # PPO: the clipped branch has no gradient
    assert torch.all(grad_cispo[sel] != 0)  # CISPO: gradient flows through log pi with the clipped weight
    n = m.sum()
    expected = -a[sel] * r[sel].clamp(max=1 + hi) / n
    torch.testing.assert_close(grad_cispo[sel], expected)


def test_cispo_warns_on_two_sided_clip():
    with pytest.warns(UserWarning, match="eps_clip=0.2 < 1.0"):
        CISPOLoss(eps_clip=0.2)


def test_reinforce_pp_puts_kl_return_in_advantage():
    batch = make_batch(5)
    beta = 0.1

    def reference(lp):
        losses = []
        for s in per_sample(batch, lp):
            m = s["loss_mask"]
            kl = [m[t] * (s["old_logprobs"][t] - s["ref_logprobs"][t]) for t in range(len(m))]
            row = []
            for t in range(len(m)):
                adv = s["advantages"][t] - beta * sum(kl[t:])
                row.append(m[t] * ppo_token(s["lp"][t], s["old_logprobs"][t], adv, 0.8, 1.2))
            losses.append(row)
        return reference_aggregate(losses, batch, "token-mean")

    _, _, metrics = check(ReinforcePPLoss(kl_coef=beta, kl_estimator="k1"), batch, reference)
    assert "train/kl_loss" not in metrics  # the KL is in the reward, not the loss
    m = batch["loss_mask"]
    kl_sum = float(((batch["old_logprobs"] - batch["ref_logprobs"]) * m).sum())
    assert metrics["train/kl_ref"] == pytest.approx((kl_sum, float(m.sum())))


LOSSES = [
    lambda mode: GRPOLoss(aggregation=mode, kl_coef=0.1, kl_estimator="k2", tis_cap=1.5),
    lambda mode: GSPOLoss(
        aggregation=mode, eps_clip=0.01, eps_clip_high=0.02, icepop_low=0.5, icepop_high=2.0
    ),
    lambda mode: CISPOLoss(aggregation=mode, eps_clip_high=0.3, kl_coef=0.1),
    lambda mode: ReinforcePPLoss(aggregation=mode, kl_coef=0.1, tis_cap=2.0, icepop_low=0.4, icepop_high=3.0),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make_loss", LOSSES)
def test_micro_batches_sum_to_the_full_batch(make_loss, mode):
    batch = make_batch(6, spread=0.3)
    fn = make_loss(mode)
    lp = batch["logprobs"].clone().requires_grad_(True)
    full, full_metrics = fn(inputs_of(batch, lp=lp))
    (grad_full,) = torch.autograd.grad(full, lp)
    n_tok = float(batch["loss_mask"].sum())
    lp = batch["logprobs"].clone().requires_grad_(True)
    total, sums = 0.0, {}
    bounds = [0, 3, 8, 13]  # micro-batches [s0], [s1], [s2, s3]: sample boundaries
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        part, metrics = fn(inputs_of(batch, lp=lp, lo=lo, hi=hi, n_tok=n_tok, n_seq=len(LENGTHS)))
        total = total + part
        for k, (s, c) in metrics.items():
            s0, c0 = sums.get(k, (0.0, 0.0))
            sums[k] = (s0 + s, c0 + c)
    (grad_parts,) = torch.autograd.grad(total, lp)
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_parts, grad_full, rtol=1e-12, atol=1e-12)
    assert set(sums) == set(full_metrics)
    for k, (s, c) in sums.items():
        assert s / c == pytest.approx(full_metrics[k][0] / full_metrics[k][1], rel=1e-12), k
    assert sums["train/loss"][1] == pytest.approx(1.0)


def test_kl_estimators_match_formulas_and_k3_is_nonnegative():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(1000, generator=g, dtype=torch.float64) * 3
    ref = torch.randn(1000, generator=g, dtype=torch.float64) * 3
    x = lp - ref
    torch.testing.assert_close(kl_estimate(lp, ref, estimator="k1"), x)
    torch.testing.assert_close(kl_estimate(lp, ref, estimator="k2"), x**2 / 2)
    k3 = kl_estimate(lp, ref, estimator="k3")
    torch.testing.assert_close(k3, torch.exp(ref - lp) - 1 + (lp - ref))
    assert (k3 >= 0).all()
    assert float(kl_estimate(torch.tensor([-1.0]), torch.tensor([-1.0]), estimator="k3")) == 0.0


def test_k1_and_k3_are_unbiased_estimates_of_the_true_kl():
    g = torch.Generator().manual_seed(1)
    logits_p, logits_q = (
        torch.randn(8, generator=g, dtype=torch.float64),
        torch.randn(8, generator=g, dtype=torch.float64),
    )
    logp, logq = torch.log_softmax(logits_p, 0), torch.log_softmax(logits_q, 0)
    true_kl = float((logp.exp() * (logp - logq)).sum())
    ys = torch.multinomial(logp.exp(), 400_000, replacement=True, generator=g)
    for est in ("k1", "k3"):
        mean = float(kl_estimate(logp[ys], logq[ys], estimator=est).mean())
        assert mean == pytest.approx(true_kl, rel=0.02), est
    # exact expectations, no sampling noise
    p = logp.exp()
    assert float((p * kl_estimate(logp, logq, estimator="k3")).sum()) == pytest.approx(true_kl, rel=1e-12)


def test_tis_weights_and_icepop_mask():
    batch = make_batch(7, spread=0.0)  # ratio 1: the policy term is -A per token
    batch["logprobs"] = batch["old_logprobs"].clone()
    rho = torch.exp(batch["old_logprobs"] - batch["rollout_logprobs"])
    m, a = batch["loss_mask"], batch["advantages"]
    n = float(m.sum())
    cap = 1.2
    lp = batch["logprobs"].clone().requires_grad_(True)
    loss, metrics = GRPOLoss(tis_cap=cap)(inputs_of(batch, lp=lp))
    (grad,) = torch.autograd.grad(loss, lp)
    w = rho.clamp(max=cap)
    torch.testing.assert_close(loss, (-a * w * m).sum() / n)
    torch.testing.assert_close(grad, -a * w * m / n)  # d r / d lp = r = 1
    assert metrics["train/tis_weight_mean"] == pytest.approx((float((w * m).sum()), n))
    assert metrics["train/tis_clipped_frac"] == pytest.approx((float(((rho > cap) * m).sum()), n))

    low, high = 0.8, 1.25
    lp = batch["logprobs"].clone().requires_grad_(True)
    loss, metrics = GRPOLoss(icepop_low=low, icepop_high=high)(inputs_of(batch, lp=lp))
    (grad,) = torch.autograd.grad(loss, lp)
    keep = ((rho >= low) & (rho <= high)).double()
    assert 0 < float(keep.sum()) < len(keep)
    torch.testing.assert_close(loss, (-a * keep * m).sum() / n)  # dropped tokens still count in n
    assert torch.all(grad[keep == 0] == 0)
    assert metrics["train/icepop_masked_frac"] == pytest.approx((float(((1 - keep) * m).sum()), n))


def test_kl_flag_and_ref_requirement():
    batch = make_batch(8)
    assert GRPOLoss(kl_coef=0.1, kl_use_candidate_mask=False).kl_use_candidate_mask is False
    assert GRPOLoss(kl_coef=0.1).needs_ref_logprobs and not GRPOLoss().needs_ref_logprobs
    batch["ref_logprobs"] = None
    with pytest.raises(ValueError, match="ref_logprobs.*kl_coef=0"):
        GRPOLoss(kl_coef=0.1)(inputs_of_none(batch))
    batch["rollout_logprobs"] = None
    with pytest.raises(ValueError, match="rollout_logprobs.*tis_cap"):
        GRPOLoss(tis_cap=2.0)(inputs_of_none(batch))


def inputs_of_none(batch):
    return LossInputs(
        **{k: v for k, v in batch.items()},
        num_loss_tokens_global=float(batch["loss_mask"].sum()),
        num_sequences_global=len(LENGTHS),
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"aggregation": "mean"}, "aggregation='mean'.*token-mean"),
        ({"kl_estimator": "k4"}, "kl_estimator='k4'"),
        ({"kl_coef": -1.0}, "kl_coef=-1.0 must be >= 0"),
        ({"eps_clip": 0.0}, "eps_clip=0.0"),
        ({"tis_cap": 0.0}, "tis_cap=0.0 must be > 0"),
        ({"icepop_low": 0.5}, "set both"),
        ({"icepop_low": 1.5, "icepop_high": 2.0}, "low <= 1 <= high"),
    ],
)
def test_bad_config_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOLoss(**kwargs)


def test_bad_inputs_raise_value_error():
    batch = make_batch(9)
    with pytest.raises(ValueError, match=r"advantages has shape \(12,\), expected \(13,\)"):
        LossInputs(
            **(batch | {"advantages": batch["advantages"][:-1]}),
            num_loss_tokens_global=1.0,
            num_sequences_global=4,
        )
    with pytest.raises(ValueError, match="num_loss_tokens_global is 0"):
        LossInputs(**batch, num_loss_tokens_global=0, num_sequences_global=4)
    seq = batch["seq_index"].clone()
    seq[-1] = seq[0]  # sample 10 reappears at the end
    bad = LossInputs(**(batch | {"seq_index": seq}), num_loss_tokens_global=1.0, num_sequences_global=4)
    with pytest.raises(ValueError, match="not contiguous"):
        GSPOLoss()(bad)
    assert math.isfinite(GRPOLoss()(inputs_of(batch, lp=batch["logprobs"]))[0].item())


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=2, max_size=7),
    cuts=st.sets(st.integers(1, 6), max_size=3),
    which=st.integers(0, len(LOSSES) - 1),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 10**6),
)
def test_any_split_at_sample_boundaries_equals_the_full_batch(lengths, cuts, which, mode, seed):
    batch = make_batch(seed, lengths=lengths, spread=0.3)
    fn = LOSSES[which](mode)
    n_tok, n_seq = float(batch["loss_mask"].sum()), len(lengths)
    lp = batch["logprobs"].clone().requires_grad_(True)
    full, _ = fn(inputs_of(batch, lp=lp, n_seq=n_seq))
    (grad_full,) = torch.autograd.grad(full, lp)
    ends = torch.cumsum(torch.tensor(lengths), 0).tolist()
    bounds = [0] + [ends[c - 1] for c in sorted(cuts) if c < len(lengths)] + [ends[-1]]
    lp = batch["logprobs"].clone().requires_grad_(True)
    parts = [
        fn(inputs_of(batch, lp=lp, lo=lo, hi=hi, n_tok=n_tok, n_seq=n_seq))[0]
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    (grad_parts,) = torch.autograd.grad(sum(parts), lp)
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_parts, grad_full, rtol=1e-12, atol=1e-12)


def test_a_loss_says_whether_it_corrects_staleness():
    """What `rollout.overlap=true` asks of the loss (config validation reads this, not the config's key names)."""
    from topp_rl.losses import CISPOLoss, GRPOLoss

    assert not GRPOLoss().corrects_staleness and not CISPOLoss().corrects_staleness
    assert GRPOLoss(tis_cap=2.0).corrects_staleness
    assert CISPOLoss(icepop_low=0.5, icepop_high=2.0).corrects_staleness
