"""Specification of the learning-rate schedule: linear warmup, then cosine, linear or constant decay."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch

from accel_trainer.config.train_config import TrainConfig
from accel_trainer.errors import ConfigError
from accel_trainer.optim.schedules import build_scheduler, lr_multiplier, peak_lr


def schedule(cfg: TrainConfig, num_steps: int | None = None) -> list[float]:
    """The multiplier of optimizer steps 0 .. num_steps - 1 (max_steps by default)."""
    return [lr_multiplier(step, cfg) for step in range(cfg.max_steps if num_steps is None else num_steps)]


def test_warmup_rises_linearly_from_lr_over_warmup_steps_to_lr():
    cfg = TrainConfig(max_steps=100, warmup_steps=4, lr_schedule="constant")
    assert schedule(cfg, 6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_the_first_step_never_has_a_zero_learning_rate():
    for warmup_steps in (0, 1, 10):
        assert lr_multiplier(0, TrainConfig(max_steps=20, warmup_steps=warmup_steps)) > 0


def test_cosine_decays_from_the_peak_to_min_lr_ratio_at_max_steps():
    cfg = TrainConfig(max_steps=100, warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    values = schedule(cfg)
    assert values[10] == pytest.approx(1.0)  # decay starts at the peak
    decay = values[10:]
    assert all(earlier > later for earlier, later in pairwise(decay))  # strictly falling
    # Step k uses lr_multiplier(k); after the last step (k = max_steps - 1) the schedule has reached the floor.
    assert lr_multiplier(cfg.max_steps, cfg) == pytest.approx(0.1)
    assert 0.1 < values[-1] < 0.1 + 0.001
    assert lr_multiplier(cfg.max_steps + 50, cfg) == pytest.approx(0.1)  # and stays there


def test_cosine_is_half_way_between_peak_and_floor_half_way_through_the_decay():
    cfg = TrainConfig(max_steps=110, warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.0)
    assert lr_multiplier(60, cfg) == pytest.approx(0.5)
    cfg.min_lr_ratio = 0.2
    assert lr_multiplier(60, cfg) == pytest.approx(0.6)


def test_cosine_follows_half_a_cosine_period():
    cfg = TrainConfig(max_steps=40, warmup_steps=0, lr_schedule="cosine")
    expected = [0.5 * (1 + math.cos(math.pi * step / 40)) for step in range(40)]
    assert schedule(cfg) == pytest.approx(expected)


def test_linear_decays_in_equal_steps_to_min_lr_ratio_at_max_steps():
    cfg = TrainConfig(max_steps=14, warmup_steps=4, lr_schedule="linear", min_lr_ratio=0.5)
    decay = schedule(cfg)[4:]
    assert decay == pytest.approx([1.0 - 0.05 * k for k in range(10)])
    assert lr_multiplier(cfg.max_steps, cfg) == pytest.approx(0.5)


def test_constant_holds_the_peak_after_warmup_whatever_min_lr_ratio():
    cfg = TrainConfig(max_steps=20, warmup_steps=2, lr_schedule="constant", min_lr_ratio=0.1)
    assert schedule(cfg, 30)[2:] == [1.0] * 28


def test_peak_lr_is_lr_without_a_scaling_rule():
    assert peak_lr(TrainConfig(lr=3e-4, global_batch_size=512, lr_scaling="none")) == 3e-4


def test_linear_scaling_multiplies_lr_by_the_batch_ratio():
    cfg = TrainConfig(lr=1e-3, global_batch_size=256, reference_batch_size=64, lr_scaling="linear")
    assert peak_lr(cfg) == pytest.approx(4e-3)


def test_sqrt_scaling_multiplies_lr_by_the_square_root_of_the_batch_ratio():
    cfg = TrainConfig(lr=1e-3, global_batch_size=256, reference_batch_size=64, lr_scaling="sqrt")
    assert peak_lr(cfg) == pytest.approx(2e-3)


@pytest.mark.parametrize("lr_scaling", ["linear", "sqrt"])
def test_a_scaling_rule_without_reference_batch_size_is_a_config_error_saying_what_to_set(lr_scaling):
    with pytest.raises(ConfigError, match=f"lr_scaling={lr_scaling} needs reference_batch_size="):
        peak_lr(TrainConfig(lr_scaling=lr_scaling, reference_batch_size=0))


@pytest.mark.parametrize("lr_schedule", ["cosine", "linear", "constant"])
def test_the_built_scheduler_gives_each_groups_scaled_peak_times_lr_multiplier_at_every_step(lr_schedule):
    cfg = TrainConfig(
        max_steps=25,
        warmup_steps=5,
        lr=1e-3,
        lr_schedule=lr_schedule,
        min_lr_ratio=0.1,
        lr_scaling="linear",
        global_batch_size=128,
        reference_batch_size=64,
    )
    body, head = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [body], "lr": 1e-3}, {"params": [head], "lr": 5e-2}])
    scheduler = build_scheduler(optimizer, cfg)
    used = []
    for _ in range(cfg.max_steps):
        used.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    # Each group's own LR is its peak; the batch-size rule doubles it (128 / 64).
    for group, peak in enumerate([2e-3, 1e-1]):
        assert [lrs[group] for lrs in used] == pytest.approx([peak * lr_multiplier(k, cfg) for k in range(25)])
        assert optimizer.param_groups[group]["lr"] == pytest.approx(peak * lr_multiplier(cfg.max_steps, cfg))
