"""Learning-rate schedule: warmup then decay as multipliers (unit), and the lr a run logs per step."""

import math

import pytest
from helpers import column, compose_cfg, read_metrics

from topp_rl.train import train
from topp_rl.trainer.schedule import LRSchedule


def test_warmup_then_cosine_and_linear_multipliers():
    cosine = LRSchedule(warmup_steps=2, decay="cosine", min_ratio=0.1, total_steps=6)
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)] + [0.1]
    assert [cosine(s) for s in range(7)] == pytest.approx(expected)
    linear = LRSchedule(decay="linear", total_steps=4)
    assert [linear(s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert [LRSchedule()(s) for s in range(3)] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"lr total_steps=2 must be >= warmup_steps=5"):
        LRSchedule(warmup_steps=5, total_steps=2)
    with pytest.raises(ValueError, match=r"lr decay='step' must be 'constant', 'linear' or 'cosine'"):
        LRSchedule(decay="step")


def test_a_run_logs_the_scheduled_lr(tmp_path):
    train(compose_cfg(tmp_path, "logger=csv", "optimizer.lr=0.01", "trainer.max_steps=3",
                      "lr_schedule.warmup_steps=2", "lr_schedule.decay=linear"))
    # Step s trains with lr * multiplier(s): 0.5, 1.0, then linear decay over the one remaining step (1.0).
    assert column(read_metrics(tmp_path), "train/lr") == pytest.approx([0.005, 0.01, 0.01], rel=1e-7)
