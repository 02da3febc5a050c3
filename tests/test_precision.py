"""trainer=cpu_fp16: float16 autocast with a loss scale. The module clips and logs the true gradient (unscaled
first), and an overflowing step is skipped with the scale halved, the weights untouched."""

import math

import pytest
import torch
from helpers import column, compose_cfg, read_metrics

from topp_rl.train import build_run, fit, train
from topp_rl.trainer.precision import LossScaledFP16

# Enough samples that some groups' rewards differ (a nonzero gradient); one step.
RUN = ("logger=csv", "export.hf=false", "trainer.max_steps=1", "rollout.prompts_per_step=8", "rollout.n_samples=8",
       "rollout.max_new_tokens=2")


def test_fp16_logs_and_clips_the_true_gradient(tmp_path):
    grads = {}
    for name, trainer in (("fp32", "cpu"), ("fp16", "cpu_fp16")):
        train(compose_cfg(tmp_path / name, f"trainer={trainer}", *RUN))
        rows = read_metrics(tmp_path / name)
        grads[name] = column(rows, "train/grad_norm")[0]
        if name == "fp16":
            assert column(rows, "train/loss_scale") == [2.0**16]  # no overflow: the scale is kept
    # Same step, same rollouts (the engine samples in float32 either way): the norms differ by fp16 rounding
    # only, not by the loss scale (2^16) Lightning's own 16-mixed would leave in them. 2e-2 is 41 u (fp16's unit
    # round-off u = 2^-11): under the first-order bound of one rounding of both operands (2 u) at each of the
    # 2-layer model's 13 matmul levels, forward and backward (52 u); measured 3e-5 with AVX2 and AVX-512 kernels.
    assert grads["fp32"] > 0.1 and grads["fp16"] == pytest.approx(grads["fp32"], rel=2e-2)


def test_an_overflowing_step_is_skipped_and_the_scale_halved(tmp_path):
    cfg = compose_cfg(tmp_path, "trainer=cpu_fp16", "+trainer.plugins.0.init_scale=1.0e30", *RUN)
    run = build_run(cfg)
    assert isinstance(run.trainer.precision_plugin, LossScaledFP16) and run.trainer.precision == "16-mixed"
    before = [p.detach().clone() for p in run.module.policy.parameters()]
    fit(run)
    for a, p in zip(before, run.module.policy.parameters(), strict=True):
        torch.testing.assert_close(p, a, rtol=0, atol=0)  # the update was skipped
    rows = read_metrics(tmp_path)
    assert column(rows, "train/loss_scale") == [float(torch.tensor(1.0e30)) / 2]  # the float32 scale, halved
    assert not math.isfinite(column(rows, "train/grad_norm")[0])  # logged as it was, the run goes on


def _overflow_on_one_rank(rank: int) -> dict:
    """Two ranks, each with its own parameter (a pipeline stage's layers): rank 1 alone gets an inf gradient."""
    plugin = LossScaledFP16(init_scale=8.0)
    weight = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([weight], lr=0.1)
    scales, weights = [], []
    for step in range(2):
        opt.zero_grad()
        if rank == 1:  # the last stage scales the loss; a stage before it never calls `scale` itself
            plugin.scaler.scale(torch.ones(()))
        overflow = rank == 1 and step == 0
        weight.grad = torch.full((3,), float("inf") if overflow else plugin.scaler.get_scale())  # 1 once unscaled
        plugin.unscale(opt)
        plugin.optimizer_step(opt, model=None, closure=lambda: None)
        scales.append(plugin.scaler.get_scale())
        weights.append(weight.detach().clone())
    return {"scales": scales, "weights": weights}


@pytest.mark.distributed
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    """A rank's overflow check sees only its own gradients (a pipeline stage, a shard): the plugin takes the
    world's maximum of the flags, so rank 1's inf skips rank 0's finite update too and halves both scales; the next
    step (finite everywhere) updates both."""
    from dist_utils import run_distributed

    results = run_distributed(_overflow_on_one_rank, 2, timeout=120)
    for r in results:
        assert r["scales"] == [4.0, 4.0]  # halved by the overflow, kept after the good step (growth_interval 2000)
        torch.testing.assert_close(r["weights"][0], torch.ones(3), rtol=0, atol=0)  # skipped everywhere
        torch.testing.assert_close(r["weights"][1], torch.full((3,), 0.9), rtol=0, atol=1e-7)  # grad 1 after unscale
