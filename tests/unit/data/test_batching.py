"""Specification of the batch arithmetic: a layout-free global batch split into micro-batches and accumulation."""

from __future__ import annotations

import pytest

from accel_trainer.data.batching import BatchPlan, plan_batches
from accel_trainer.errors import ConfigError


@pytest.mark.parametrize(("num_processes", "accumulation_steps"), [(1, 8), (2, 4), (8, 1)])
def test_accumulation_steps_make_up_the_global_batch_on_any_number_of_processes(num_processes, accumulation_steps):
    plan = plan_batches(global_batch_size=64, micro_batch_size=8, num_processes=num_processes)
    assert plan == BatchPlan(64, 8, num_processes, accumulation_steps)
    assert plan.micro_batch_size * plan.num_processes * plan.accumulation_steps == plan.global_batch_size


@pytest.mark.parametrize(
    ("global_batch_size", "micro_batch_size", "num_processes", "per_step", "fix"),
    [
        (64, 32, 8, 256, "divisible by 256 or a smaller micro_batch_size that divides it: 8"),
        (64, 24, 1, 24, "divisible by 24 (48 or 72) or a smaller micro_batch_size that divides it: 16"),
        (100, 8, 2, 16, "divisible by 16 (96 or 112) or a smaller micro_batch_size that divides it: 5"),
        (5, 1, 2, 2, "divisible by 2 (4 or 6)"),  # no micro-batch splits 5 over 2 ranks
    ],
)
def test_sizes_that_do_not_divide_are_a_config_error_naming_the_numbers_and_the_fix(
    global_batch_size, micro_batch_size, num_processes, per_step, fix
):
    with pytest.raises(ConfigError) as caught:
        plan_batches(global_batch_size, micro_batch_size, num_processes)
    message = str(caught.value)
    assert f"global_batch_size={global_batch_size}" in message
    assert f"micro_batch_size={micro_batch_size}" in message
    assert f"{num_processes} data-parallel rank(s) = {per_step}" in message
    assert message.endswith(f"pick a global_batch_size {fix}")
    assert "\n" not in message


@pytest.mark.parametrize(("global_batch_size", "micro_batch_size"), [(0, 8), (64, 0), (-64, 8)])
def test_sizes_must_be_positive(global_batch_size, micro_batch_size):
    with pytest.raises(ConfigError, match="must be positive"):
        plan_batches(global_batch_size, micro_batch_size, 1)


def test_steps_per_epoch_counts_whole_global_batches_and_skips_the_incomplete_last_one():
    plan = plan_batches(global_batch_size=64, micro_batch_size=32, num_processes=1)
    assert plan.steps_per_epoch(128) == 2
    assert plan.steps_per_epoch(1617) == 25
    assert plan.steps_per_epoch(64) == 1


def test_steps_per_epoch_does_not_depend_on_the_layout():
    layouts = [plan_batches(64, 8, num_processes) for num_processes in (1, 2, 8)]
    assert {plan.steps_per_epoch(1000) for plan in layouts} == {15}


def test_a_dataset_smaller_than_one_global_batch_is_a_config_error_saying_to_lower_it():
    plan = plan_batches(global_batch_size=64, micro_batch_size=32, num_processes=2)
    with pytest.raises(ConfigError) as caught:
        plan.steps_per_epoch(63)
    message = str(caught.value)
    assert "63 samples" in message
    assert "global_batch_size=64" in message
    assert "lower global_batch_size" in message


@pytest.mark.parametrize(
    ("global_batch_size", "default", "num_processes", "fitted"),
    [(64, 64, 2, 32), (32, 16, 8, 4), (64, 24, 1, 16), (48, 32, 3, 16), (64, 32, 2, 32)],
)
def test_a_recipe_s_default_micro_batch_becomes_the_largest_not_above_it_that_splits_the_global_batch(
    global_batch_size, default, num_processes, fitted
):
    plan = plan_batches(global_batch_size, default, num_processes, fit=True)
    assert plan.micro_batch_size == fitted
    assert plan.fitted_from == (default if fitted != default else 0)  # what the header says


def test_a_micro_batch_the_user_set_is_never_changed_and_one_that_cannot_split_is_refused():
    with pytest.raises(ConfigError, match="global_batch_size=64 is not a multiple of micro_batch_size=64 x 2"):
        plan_batches(64, 64, 2)
    with pytest.raises(ConfigError, match=r"global_batch_size=63 is not a multiple of micro_batch_size=8 x 2"):
        plan_batches(63, 8, 2)


def test_a_global_batch_no_micro_batch_splits_names_the_ranks_not_the_recipe_s_default():
    """The default micro-batch follows the layout, so the refusal is about the ranks (found by a new-user trial)."""
    with pytest.raises(ConfigError, match=r"^global_batch_size=63 does not split over 2 data-parallel rank\(s\):"
                                          r" pick a multiple of 2 \(such as 64\)$"):  # fmt: skip
        plan_batches(63, 8, 2, fit=True)


def test_micro_batch_size_counts_as_set_in_an_override_or_the_config_file_only(tmp_path):
    from accel_trainer.config.fields import micro_batch_size_given

    config = tmp_path / "run.yaml"
    config.write_text("micro_batch_size: 8\n")
    assert micro_batch_size_given(None, {"micro_batch_size": 8}) and micro_batch_size_given(config, {})
    assert not micro_batch_size_given(None, {"lr": 0.1})
    config.write_text("lr: 0.1\n")
    assert not micro_batch_size_given(config, {})
