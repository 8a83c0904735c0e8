"""An exponential moving average of the weights (`ema_decay`), kept beside the model on every layout.

The average starts as the initial weights and after every optimizer step taken moves towards the new ones
(torch's `get_ema_multi_avg_fn`: one foreach lerp, on the device, no host sync). It covers every floating-point
entry of the model's state dict, parameters and running statistics alike (like timm's ModelEma), but the frozen
weights (a LoRA run's base never moves: the average is the adapter's, and so is its size in a checkpoint), each
kept in fp32 and shaped like its entry: under FSDP or tensor parallelism an entry is a DTensor shard, so its average is
a shard with the same placement and the EMA costs one fp32 copy of this process's part of the model.

Checkpoints hold it beside the model (checkpoint/save.py: `ema.safetensors`, or `ema/` keys of the sharded files), so it
resumes bitwise and reshards across layouts like the weights. `evaluate_ema=true` evaluates it at every
evaluation (`eval_ema/<metric>`); the run ends by exporting it to `final/ema/model.safetensors`. Both swap the
average into the model's own tensors and back, so the eval and export code is the model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.swa_utils import get_ema_multi_avg_fn

from accel_trainer.parallel.sharding import local_part


class WeightAverage:
    """The EMA of a prepared model's floating-point state, keyed like its checkpoint entries."""

    def __init__(self, model: torch.nn.Module, decay: float, frozen: frozenset[str] = frozenset()) -> None:
        self.model = model
        state: dict[str, Any] = get_model_state_dict(model)  # the names checkpoints use, whatever wraps the model
        self.average: dict[str, torch.Tensor] = {
            name: tensor.detach().to(torch.float32, copy=True)
            for name, tensor in state.items()
            if tensor.is_floating_point() and name not in frozen  # a frozen weight is its own average
        }
        self._update = get_ema_multi_avg_fn(decay)
        self.decay = decay
        self._weight: torch.Tensor | None = None  # torch's lerp weight, 1 - decay, as a float32 on the device
        self._live: list[torch.Tensor] | None = None

    def update(self, taken: torch.Tensor | None = None) -> None:
        """Move the average towards the current weights (after an optimizer step); `taken`, a device bool, for a
        step whose non-finite verdict is read later (stopping/nonfinite.py): false leaves the average as it was."""
        if self._live is None:  # after the first forward: FSDP2 settles its sharded storage in its lazy init
            self._live = self._live_tensors()
        live = [tensor if tensor.dtype == torch.float32 else tensor.float() for tensor in self._live]
        targets = [local_part(tensor) for tensor in self.average.values()]
        if taken is None:
            self._update(targets, live, None)
            return
        # torch's update with its weight on the device: the same float32 (1 - decay) when taken, else 0, whose
        # lerp leaves each entry as it was (the weights and statistics of a skipped step are those of the last).
        if self._weight is None:  # made on the device: a copy from the host would wait for it
            self._weight = torch.full((), 1 - self.decay, dtype=torch.float32, device=taken.device)
        torch._foreach_lerp_(targets, live, [self._weight * taken] * len(targets))

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the averaged weights inside the block, its own again after it."""
        live = self._live_tensors()
        kept = [tensor.clone() for tensor in live]
        with torch.no_grad():
            torch._foreach_copy_(live, [local_part(tensor) for tensor in self.average.values()])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(live, kept)

    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take whole tensors (an unsharded checkpoint's) into the average, sharding them like the model's."""
        for name, target in self.average.items():
            whole = tensors[name].to(target.device, torch.float32)
            if isinstance(target, DTensor):  # a collective: every process takes its part
                whole = distribute_tensor(whole, target.device_mesh, target.placements).to_local()
            local_part(target).copy_(whole)

    def restart_from_weights(self) -> None:
        """Set the average to the current weights (resuming a checkpoint that had none)."""
        with torch.no_grad():
            torch._foreach_copy_([local_part(tensor) for tensor in self.average.values()], self._live_tensors())

    def _live_tensors(self) -> list[torch.Tensor]:
        """This process's tensors of the model's entries (views of its own storage), in the average's order."""
        state: dict[str, Any] = get_model_state_dict(self.model)
        return [local_part(state[name]) for name in self.average]
