"""The verbs of one optimizer step for the current layout, chosen once at start.

The loop calls `backward`, `clip_grad_norm`, `optimizer_step` and `zero_grad` on a `StepVerbs`, which speaks
accelerate's verbs (`accelerator.backward`, `accelerator.clip_grad_norm_`, `AcceleratedOptimizer.step`) where
they do work that matters: a gradient scaler to unscale and step through (fp16) or sharded gradients
(FSDP). Elsewhere (no scaler; one process, DDP or CPU DDP) those verbs only add per-step overhead:
`AcceleratedOptimizer.step` runs `importlib.util.find_spec` twice per step (its LOMO check), `zero_grad`
runs `inspect.signature` every call, about 150 us per step on the CPU; `backward` and `clip_grad_norm_` add
version checks and parameter scans (~16 us). There the same operations go to torch directly, measured
bit-identical (tests/test_step.py), which lifted the tiny-model ratio from ~0.92 to ~0.97 of a plain loop.

DeepSpeed, XLA and Megatron-LM layouts are refused when the Accelerator is built (distributed.py), so the
fast choice is made only among layouts whose behaviour is known.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

_PLAIN_LAYOUTS = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class StepVerbs:
    """backward, clip, step and zero_grad for one prepared optimizer on the current layout."""

    def __init__(self, accelerator: Accelerator, optimizer: AcceleratedOptimizer) -> None:
        self.accelerator = accelerator
        self.optimizer = optimizer
        # Decided once: neither the layout nor the presence of a scaler changes during a run.
        self.direct = accelerator.scaler is None and accelerator.distributed_type in _PLAIN_LAYOUTS

    def backward(self, loss: torch.Tensor) -> None:
        """`accelerator.backward`, including its division by the accumulation steps."""
        if not self.direct:
            self.accelerator.backward(loss)
            return
        steps = self.accelerator.gradient_accumulation_steps
        (loss / steps if steps > 1 else loss).backward()

    def clip_grad_norm(self, parameters: Any, max_norm: float) -> torch.Tensor:
        """`accelerator.clip_grad_norm_` (which unscales fp16 gradients and handles sharded ones first)."""
        if not self.direct:
            norm = self.accelerator.clip_grad_norm_(parameters, max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # tensor parallel: a replicated DTensor

    def optimizer_step(self) -> bool:
        """Take the optimizer step; returns False when the fp16 scaler skipped it (inf/NaN gradients)."""
        if self.direct:
            self.optimizer.optimizer.step()
            return True
        self.optimizer.step()
        return not self.optimizer.step_was_skipped

    def zero_grad(self) -> None:
        """Drop the gradients (set to None) without accelerate's per-call signature inspection.

        Always direct: the loop calls it only after an optimizer step, where accelerate's own `zero_grad`
        would do the same.
        """
        self.optimizer.optimizer.zero_grad(set_to_none=True)
