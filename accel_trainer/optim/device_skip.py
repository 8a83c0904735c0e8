"""Optimizer steps that skip themselves on the device, so the non-finite guard need not read its verdict first.

torch's fused Adam, AdamW, SGD and Adagrad kernels take a `found_inf` tensor, as torch's `GradScaler` hands it
to them (`optimizer.found_inf`, `optimizer.grad_scale`, read by their `step` when `_step_supports_amp_scaling`):
where it holds 1.0 the kernel returns before it touches a parameter or a moment, and Adam and Adagrad take the
step count they had just added back. Such a step costs the device its verdict, not the host a read
(stopping/nonfinite.py reads it one step later). The default optimizer (`Recipe.build_optimizer`, fused AdamW on
the CPU and CUDA) is one; an optimizer without such a kernel (foreach or single-tensor torch optimizers, another
library's) cannot take a step back, so the guard reads its verdict before stepping it, as it always did.

A step before an optimizer holds its state is not skipped here either: the kernel would skip the update but the
step would still create the state (Adam's zero moments: the same trajectory, but checkpoints that hold moments
the guard's own path never made; fused SGD's momentum buffers, left uninitialised). Entry point: `DeviceSkip.of`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence

import torch

from accel_trainer.parallel.verbs import StepVerbs

# The torch optimizers whose `step` hands `found_inf` to their fused kernels.
_SKIPPING_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
_SKIPPING_STEPS = {inspect.unwrap(cls.step) for cls in _SKIPPING_CLASSES}  # under torch's profiling wrapper


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is one of torch's fused optimizers with torch's own `step`, which skips on `found_inf`."""
    own_step = inspect.unwrap(type(optimizer).step) in _SKIPPING_STEPS
    return own_step and bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class DeviceSkip:
    """The optimizers of a run whose every step may be skipped on the device; built by `of`, or None."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = tuple(optimizers)
        self.every_state_made = False  # once true, stays true: optimizers never drop a parameter's state

    @classmethod
    def of(cls, all_verbs: Sequence[StepVerbs | None], device: torch.device) -> DeviceSkip | None:
        """The skip for these step verbs' optimizers, or None when a step cannot skip itself: an optimizer without
        the kernel, or a layout whose step is not a plain `optimizer.step()` (a gradient scaler, sharded
        parameters: parallel/verbs.py's `direct`), or a device other than the CPU (where reading costs nothing,
        and the path runs so that every CPU test exercises it) and CUDA (where the late read waits on an event)."""
        if device.type not in ("cpu", "cuda") or not all(verbs is not None and verbs.direct for verbs in all_verbs):
            return None
        optimizers = [verbs.optimizer.optimizer for verbs in all_verbs if verbs is not None]
        return cls(optimizers) if all(skips_on_device(optimizer) for optimizer in optimizers) else None

    def ready(self) -> bool:
        """Whether every parameter with a gradient now has its optimizer state (see the module docstring); a
        host-side look at the state's keys, until every parameter of every optimizer has one."""
        if self.every_state_made:
            return True
        every = True
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                if isinstance(optimizer, torch.optim.SGD) and group["momentum"] == 0:
                    continue  # SGD without momentum keeps no state
                for parameter in group["params"]:
                    if not optimizer.state.get(parameter):
                        if parameter.grad is not None:
                            return False
                        every = False
        self.every_state_made = every
        return True

    @contextlib.contextmanager
    def unless(self, finite: torch.Tensor) -> Iterator[None]:
        """Within the block, the optimizers' steps do nothing where `finite` (a device bool) is false; GradScaler's
        own hand-over (torch/amp/grad_scaler.py: set before `step`, deleted after)."""
        found_inf = torch.logical_not(finite).to(torch.float32)  # the kernels compare it with 1.0
        for optimizer in self.optimizers:
            optimizer.grad_scale, optimizer.found_inf = None, found_inf  # type: ignore[attr-defined]
        try:
            yield
        finally:
            for optimizer in self.optimizers:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
