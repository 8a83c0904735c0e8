"""The verbs of one optimizer step for the current layout, chosen once at start.

The loop calls `backward`, `clip_grad_norm` and `zero_grad` on a `StepVerbs`, and `step_optimizers` on all of a
step's, which speak accelerate's verbs where they do work that matters: a gradient scaler to scale and unscale
through (fp16) or sharded gradients (FSDP). The optimizer step under fp16 is torch's own scaler recipe, since
accelerate's misreports a fused optimizer's skipped step and unscales a second optimizer twice. Elsewhere (no
scaler; one process, DDP or CPU DDP) accelerate's verbs only add per-step overhead, so the same operations go to
torch directly, bit-identical (tests/unit/parallel/test_step.py); where every parameter is a plain tensor in one
dtype on one device, `clip_one_group` runs torch's clipping kernels in torch's order without its per-call grouping
(a canary test fails when torch stops grouping on every call).
The measurements behind both choices are in docs/benchmarks.md ("Step verbs").

DeepSpeed, XLA and Megatron-LM layouts are refused when the Accelerator is built (parallel/accelerator.py), so the
fast choice is made only among layouts whose behaviour is known.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _device_has_foreach_support

_PLAIN_LAYOUTS = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class StepVerbs:
    """backward, clip, step and zero_grad for one prepared optimizer on the current layout."""

    def __init__(
        self, accelerator: Accelerator, optimizer: AcceleratedOptimizer, parameters: list[torch.Tensor]
    ) -> None:
        """`parameters`: what `clip_grad_norm` measures and clips (the prepared model's, or one alternating phase's
        optimizer's): they stay the same objects all run."""
        self.accelerator = accelerator
        self.optimizer = optimizer
        self.parameters = parameters
        # Decided once: neither the layout nor the presence of a scaler changes during a run.
        self.direct = accelerator.scaler is None and accelerator.distributed_type in _PLAIN_LAYOUTS
        self.one_group = self.direct and _one_foreach_group(self.parameters)

    def backward(self, loss: torch.Tensor) -> None:
        """`accelerator.backward`, including its division by the accumulation steps."""
        if not self.direct:
            self.accelerator.backward(loss)
            return
        steps = self.accelerator.gradient_accumulation_steps
        (loss / steps if steps > 1 else loss).backward()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The gradients' norm, after scaling them to at most `max_norm`; through `accelerator.clip_grad_norm_`
        where it unscales fp16 gradients or handles sharded ones first. With max_norm inf (no clipping asked) the
        direct layouts only measure: torch's clip would multiply every gradient by 1, or by NaN when the norm is
        not finite."""
        if not self.direct:
            norm = self.accelerator.clip_grad_norm_(self.parameters, max_norm)
        elif self.one_group:
            norm = clip_one_group(self.parameters, max_norm)
        elif max_norm == float("inf"):
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters if p.grad is not None])
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # tensor parallel: a replicated DTensor

    def optimizer_step(self) -> bool:
        """Take the optimizer step; returns False when the fp16 scaler skipped it (inf/NaN gradients)."""
        return step_optimizers([self])[0]

    def zero_grad(self) -> None:
        """Drop the gradients (set to None) without accelerate's per-call signature inspection.

        Always direct: the loop calls it only after an optimizer step, where accelerate's own `zero_grad`
        would do the same.
        """
        self.optimizer.optimizer.zero_grad(set_to_none=True)


def step_optimizers(all_verbs: Sequence[StepVerbs]) -> list[bool]:
    """Step the optimizers of one training step; for each, whether it stepped (False: the fp16 scaler skipped it).

    Under fp16 this is torch's recipe for several optimizers on one gradient scaler: `scaler.step` for each, one
    `scaler.update` after them all. accelerate's optimizer step updates the scale after each optimizer, which
    forgets that the others' gradients were unscaled already (by the gradient-norm measurement): the next
    optimizer unscaled them again and trained on gradients divided by the loss scale, in silence. The verdict
    is the scaler's own inf/NaN finding for that optimizer; accelerate's `step_was_skipped` watches for a
    call of the optimizer's `step` instead, and a fused optimizer (the default AdamW on CUDA) is always
    called, to skip inside its kernel, so accelerate reported every skipped step as taken
    (docs/accelerate-traps.md).
    """
    scaler = all_verbs[0].accelerator.scaler
    if scaler is None:
        for verbs in all_verbs:
            if verbs.direct:
                verbs.optimizer.optimizer.step()
            else:  # sharded gradients: accelerate's step (no scaler, so never skipped)
                verbs.optimizer.step()
        return [True] * len(all_verbs)
    # An optimizer none of whose parameters got a gradient this step (a phase that trains only the others) has
    # nothing to step, and the scaler refuses it ("No inf checks were recorded for this optimizer").
    optimizers = [verbs.optimizer.optimizer for verbs in all_verbs if _has_gradients(verbs.optimizer.optimizer)]
    for optimizer in optimizers:
        scaler.step(optimizer)  # unscales first unless the gradient norm did; skips on inf/NaN gradients
    # fp16 reads a verdict back every step anyway (the scaler's own step does for an unfused optimizer)
    found = {id(optimizer): sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())
             for optimizer in optimizers}  # fmt: skip
    if optimizers:
        scaler.update()
    return [not found.get(id(verbs.optimizer.optimizer), 0) for verbs in all_verbs]


def _has_gradients(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def discard_step(all_verbs: Sequence[StepVerbs]) -> None:
    """Drop a rejected step's gradients (the non-finite guard's verdict) on every optimizer of the step. Under fp16
    the gradient norm has unscaled them already, which leaves the scaler mid-step: one `update` closes it (its inf
    finding backs the scale off), or the next step's unscale would be refused ("unscale_() has already been
    called")."""
    for verbs in all_verbs:
        verbs.zero_grad()
    scaler = all_verbs[0].accelerator.scaler
    if scaler is not None and scaler._per_optimizer_states:  # something was unscaled: the step is open
        scaler.update()


def _one_foreach_group(parameters: Sequence[torch.Tensor]) -> bool:
    """Whether the parameters are plain tensors of one dtype on one device that has foreach kernels."""
    kinds = {(parameter.device, parameter.dtype) for parameter in parameters}
    plain = all(type(parameter) in (torch.Tensor, torch.nn.Parameter) for parameter in parameters)
    return len(kinds) == 1 and plain and _device_has_foreach_support(parameters[0].device)


@torch.no_grad()
def clip_one_group(parameters: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_(parameters, max_norm)` for one device and dtype, bit for bit; with max_norm
    inf, `get_total_norm` (the gradients untouched)."""
    grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
    if not grads:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)  # its zero norm, on its device
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    if max_norm != float("inf"):  # no clipping asked: nothing to scale
        torch._foreach_mul_(grads, torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
    return total
