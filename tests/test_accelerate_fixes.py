"""Why each workaround in accel_trainer/accelerate_fixes.py exists, and that it holds.

The launch traps are shown for real in test_multiprocess.py; these are the in-process checks.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
from accelerate import Accelerator

from accel_trainer import LayoutError, accelerate_fixes


@pytest.fixture
def prepared_optimizer():
    model = torch.nn.Linear(4, 1)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.ones(2, 4)).sum().backward()
    return model, optimizer


def _count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_accelerated_optimizer_step_searches_installed_packages_on_every_call(monkeypatch, prepared_optimizer):
    _, optimizer = prepared_optimizer
    calls = _count_calls(monkeypatch, importlib.util, "find_spec")
    optimizer.step()
    assert len(calls) >= 1  # the per-step cost the fast path avoids (docs/accelerate-traps.md: ~150 us per step)


def test_fast_optimizer_step_and_zero_grad_do_no_package_search_or_signature_inspection(
    monkeypatch, prepared_optimizer
):
    model, optimizer = prepared_optimizer
    searches = _count_calls(monkeypatch, importlib.util, "find_spec")
    inspections = _count_calls(monkeypatch, inspect, "signature")
    before = model.weight.detach().clone()

    accelerate_fixes.optimizer_step(optimizer)
    accelerate_fixes.optimizer_zero_grad(optimizer)

    assert searches == [] and inspections == []
    assert not torch.equal(model.weight, before)  # the step was taken
    assert optimizer.optimizer.state[model.weight]["step"] == 1
    assert model.weight.grad is None


def test_a_world_smaller_than_the_launcher_started_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LayoutError, match="started 2 processes but each sees a world of 1"):
        accelerate_fixes.check_launched_world(1)
    accelerate_fixes.check_launched_world(2)


def test_a_single_process_started_for_a_multi_process_cpu_launch_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(LayoutError, match="cpu_ddp.yaml"):
        accelerate_fixes.refuse_single_process_cpu_launch()
    monkeypatch.delenv("MASTER_ADDR")
    accelerate_fixes.refuse_single_process_cpu_launch()  # a 1-process CPU launch is fine


def test_canary_a_second_accelerator_with_another_precision_needs_a_state_reset():
    """accelerate's AcceleratorState is a singleton; when this stops raising, forget_accelerate_state can go."""
    Accelerator(cpu=True, mixed_precision="no")
    with pytest.raises(ValueError, match="restart your runtime"):
        Accelerator(cpu=True, mixed_precision="bf16")

    accelerate_fixes.forget_accelerate_state()

    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
