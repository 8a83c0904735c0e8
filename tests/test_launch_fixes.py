"""Why each launch workaround in accel_trainer/launch_fixes.py exists, and that it holds.

The launch traps are shown for real in test_multiprocess.py; these are the in-process checks.
"""

from __future__ import annotations

import pytest
from accelerate import Accelerator

from accel_trainer import LayoutError, launch_fixes


def test_a_world_smaller_than_the_launcher_started_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LayoutError, match="started 2 processes but each sees a world of 1"):
        launch_fixes.check_launched_world(1)
    launch_fixes.check_launched_world(2)


def test_a_single_process_started_for_a_multi_process_cpu_launch_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(LayoutError, match="cpu_ddp.yaml"):
        launch_fixes.refuse_single_process_cpu_launch()
    monkeypatch.delenv("MASTER_ADDR")
    launch_fixes.refuse_single_process_cpu_launch()  # a 1-process CPU launch is fine


def test_canary_a_second_accelerator_with_another_precision_needs_a_state_reset():
    """accelerate's AcceleratorState is a singleton; when this stops raising, forget_accelerate_state can go."""
    Accelerator(cpu=True, mixed_precision="no")
    with pytest.raises(ValueError, match="restart your runtime"):
        Accelerator(cpu=True, mixed_precision="bf16")

    launch_fixes.forget_accelerate_state()

    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
