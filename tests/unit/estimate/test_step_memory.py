"""estimate's memory tracker (accel_trainer/estimate/step_memory.py) on a model with frozen parameters."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from accel_trainer.estimate.step_memory import _LocalTensorTracker


def model_with_a_frozen_layer() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)  # a LoRA base, a preference tune's reference copy
    return model


def test_torchs_memory_tracker_hooks_the_gradient_of_frozen_parameters_too_which_torch_refuses():
    """Canary: the day torch's MemTracker leaves frozen parameters alone, `_LocalTensorTracker`'s
    `_track_module_params_and_buffers` goes."""
    model = model_with_a_frozen_layer()
    refused = pytest.raises(RuntimeError, match="cannot register a hook on a tensor that doesn't require gradient")
    with refused, MemTracker():
        model(torch.ones(1, 2)).sum().backward()


def test_estimates_tracker_counts_a_step_of_a_model_with_frozen_parameters():
    model = model_with_a_frozen_layer()
    with _LocalTensorTracker() as tracker:
        model(torch.ones(1, 2)).sum().backward()
    assert tracker.get_tracker_snapshot("peak")
