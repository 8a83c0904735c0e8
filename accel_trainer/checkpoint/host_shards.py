"""A sharded save's copy of this process's shards in host memory, made in one pass into buffers kept between saves.

torch's `DefaultStager` (what `dcp.async_save` stages with) deep-copies the state dict tensor by tensor: for a
DTensor it allocates an empty DTensor through DTensor's dispatcher, then copies its storage, and DCP's logger
builds a record for every element. On a 51M-parameter GPT under FSDP (1,041 tensors a process) that Python work
cost more than the copy itself: 0.25 s of blocked training against 0.05 s of memory copying (measured on the
2-core CPU box, 2026-11-27). Here the host twins (a buffer per tensor, wrapped once as a DTensor with the same
mesh, placements and global shape) are built at the first save and reused; a save is one `copy_` a tensor into
them, and the writer's thread writes them with `dcp.save`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class _Twin:
    buffer: torch.Tensor  # this process's part, in host memory
    value: Any  # what DCP writes: the buffer, or a DTensor of it shaped like the source
    source: tuple  # what the source looked like when the twin was made


class HostShards:
    """Host-memory copies of a state dict of (DTensor or plain) tensors, in buffers reused from one save to the next."""

    def __init__(self) -> None:
        self._twins: dict[str, _Twin] = {}

    @torch.no_grad()
    def copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """`tensors` copied into their host twins (made where a name is new or its layout changed); the staged
        state dict, whose tensors are contiguous and share no storage, as the files need."""
        staged = {}
        for name, tensor in tensors.items():
            twin, layout = self._twins.get(name), _layout(tensor)
            if twin is None or twin.source != layout:
                twin = self._twins[name] = _twin_of(tensor, layout)
            twin.buffer.copy_(tensor.to_local() if isinstance(tensor, DTensor) else tensor)
            staged[name] = twin.value
        for name in set(self._twins) - set(tensors):
            del self._twins[name]
        return staged


def _layout(tensor: torch.Tensor) -> tuple:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # no autograd work under no_grad
    spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()) if isinstance(tensor, DTensor) else ()
    return (local.shape, local.dtype, *spec)


@torch.no_grad()
def _twin_of(tensor: torch.Tensor, layout: tuple) -> _Twin:
    if not isinstance(tensor, DTensor):
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        return _Twin(buffer, buffer, layout)
    local = tensor.to_local()
    buffer = torch.empty(local.shape, dtype=local.dtype, device="cpu")
    value = DTensor.from_local(
        buffer, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )
    return _Twin(buffer, value, layout)
