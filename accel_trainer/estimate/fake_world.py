"""One process of a layout's world, played in this process: a fake process group and fake tensors.

`accel-trainer estimate` plans an 8-GPU layout on a laptop the way torchtitan's memory estimator does: each rank
is played in turn with torch's fake process group (`init_process_group("fake")`: collectives return at once)
and under a `FakeTensorMode`, in which every tensor has its shape, dtype and device but no memory, so a model
of any size is built, sharded and stepped in seconds. Everything between is the training code itself: the
launcher's variables of the layout (parallel/layout_file.py), `build_accelerator`, the recipe's model and
optimizer, `split_and_wrap` and `accelerator.prepare`.

Where torch refuses fake tensors or counts them wrong, this module works around it for the estimate alone, each in
one function (canaries and regressions: tests/unit/estimate/test_estimate.py):
- `Module.to(device)` swaps every fake parameter (`torch.utils.swap_tensors`), which fails on the weak
  reference the fake mode keeps: a move to the device the fake tensors are already on is skipped.
- A `DeviceMesh` reads its rank coordinates from a tensor (`.tolist()`, `nonzero`), which a fake tensor has no
  data for: meshes (FSDP's default one, TP's slices, FSDP x TP's flattened one) are built outside the mode.
- DDP's constructor checks and broadcasts the parameters' data in C++: a stand-in module takes its place,
  and DDP's gradient buckets (a second copy of the gradients unless `ddp_gradient_as_bucket_view`) are
  counted by `ddp_bucket_bytes`.
- DTensor plans each op's output shapes on global-shaped fake tensors in the active fake mode, whose tracker
  then counts them: its planning gets a fake mode of its own.
- Context parallelism's ring attention exists for CUDA's attention ops only: the CPU's is run as the
  memory-efficient one, whose ring version works on fake tensors.
Each rank is played in a process of its own (estimate/command.py): DTensor caches sharding plans by mesh, and two
ranks' meshes compare equal.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from accelerate.utils import patch_environment
from torch._subclasses import FakeTensorMode
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from accel_trainer.parallel import mesh
from accel_trainer.parallel.launch_fixes import forget_accelerate_state
from accel_trainer.parallel.layout_file import Layout, layout_environment

FAKE_DEVICE = torch.device("cpu")  # fake tensors live here; a CUDA layout's sizes are the same


@contextlib.contextmanager
def played_rank(layout: Layout, rank: int) -> Iterator[None]:
    """Be process `rank` of `layout` until the block ends: its launcher's variables, and a fake process group
    of the layout's world size (none for a one-process layout, as a real one has none)."""
    world = layout.num_processes
    per_machine = world // layout.num_machines
    launched = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % per_machine),
        "LOCAL_WORLD_SIZE": str(per_machine),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    eager = {"ACCELERATE_DYNAMO_BACKEND": "NO"}  # compiled regions use no more memory than eager: an upper bound
    if layout.environment.get("ACCELERATE_MIXED_PRECISION") == "fp16":  # fp32 on a CPU; bf16 has fp16's sizes
        eager["ACCELERATE_MIXED_PRECISION"] = "bf16"
    ring = mock.patch.object(mesh, "CONTEXT_PARALLEL_DEVICES", {*mesh.CONTEXT_PARALLEL_DEVICES, FAKE_DEVICE.type})
    with layout_environment(layout), patch_environment(**(launched if world > 1 else {}), **eager), ring:
        if world > 1:
            from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            yield
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            forget_accelerate_state()


def on_the_fake_device(accelerator: Any) -> None:
    """Give the Accelerator the device the fake tensors are on. On a gloo world accelerate names the CPU `cpu:0`,
    which real CPU tensors ignore and fake ones keep, then refuse to mix with `cpu` (a pipeline stage's buffers)."""
    if accelerator.device.type == FAKE_DEVICE.type:
        accelerator.state.device = FAKE_DEVICE


@contextlib.contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """Fake tensors for everything built in the block, with the three workarounds of the module's docstring."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the data's real batches go in as they are
    with _moves_in_place(), _meshes_outside(), _ddp_stand_in(), _sharding_plans_apart(), _ring_attention(), mode:
        yield mode


@contextlib.contextmanager
def _sharding_plans_apart() -> Iterator[None]:
    """DTensor works out each op's output shapes by running it on global-shaped fake tensors, in the fake mode it
    finds active: ours, whose tracker then counts them as the step's memory (an FSDP model's optimizer step
    counted 4 whole models more than the real one). In a fake mode of their own they are not counted, as in a
    real run."""
    from torch.distributed.tensor import _sharding_prop

    with mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args: None):
        yield


@contextlib.contextmanager
def _moves_in_place() -> Iterator[None]:
    original = torch.nn.Module.to

    def to(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        target = kwargs.get("device", args[0] if args else None)
        device = torch.device(target) if isinstance(target, (str, torch.device)) else None
        dtype = kwargs.get("dtype", args[1] if len(args) > 1 else None)
        tensors = [*module.parameters(), *module.buffers()]
        no_cast = dtype is None or all(tensor.dtype == dtype for tensor in tensors)
        if len(args) + len(kwargs) <= 2 and device is not None and device.type == FAKE_DEVICE.type and no_cast:
            return module  # a move to where the fake tensors are, with no cast (peft's of each adapter layer)
        return original(module, *args, **kwargs)

    torch.nn.Module.to = to  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.to = original  # type: ignore[method-assign]


_MESH_METHODS = ("__init__", "__getitem__", "_create_sub_mesh", "_flatten", "_unflatten")
_MESH_BUILDERS = (
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.fsdp._fully_shard._fsdp_init",
)


@contextlib.contextmanager
def _meshes_outside() -> Iterator[None]:
    """Every way torch builds a mesh (a new one, a slice, a flattened or concatenated one) runs with real tensors."""

    def real(function: Any) -> Any:
        @functools.wraps(function)
        def outside(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return function(*args, **kwargs)

        return outside

    with contextlib.ExitStack() as patches:
        for name in _MESH_METHODS:
            if hasattr(DeviceMesh, name):
                patches.enter_context(mock.patch.object(DeviceMesh, name, real(getattr(DeviceMesh, name))))
        if hasattr(DeviceMesh, "_concatenate"):
            concatenate = staticmethod(real(DeviceMesh._concatenate))
            patches.enter_context(mock.patch.object(DeviceMesh, "_concatenate", concatenate))
        for module_name in _MESH_BUILDERS:
            module = importlib.import_module(module_name)
            patches.enter_context(mock.patch.object(module, "init_device_mesh", real(module.init_device_mesh)))
        yield


class DataParallelStandIn(torch.nn.Module):
    """Where DDP would wrap the model: the model itself, run as DDP runs it, with DDP's options kept."""

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.gradient_as_bucket_view = bool(kwargs.get("gradient_as_bucket_view", False))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def register_comm_hook(self, *args: Any, **kwargs: Any) -> None:
        """A hook compresses what is sent, not what is held."""


@contextlib.contextmanager
def _ddp_stand_in() -> Iterator[None]:
    original = torch.nn.parallel.DistributedDataParallel
    torch.nn.parallel.DistributedDataParallel = DataParallelStandIn  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torch.nn.parallel.DistributedDataParallel = original  # type: ignore[misc]


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """The bytes of DDP's gradient buckets beside the gradients: all trainable parameters' bytes, or 0 where the
    gradients are views into the buckets (or the model is not data-parallel)."""
    if not isinstance(model, (DataParallelStandIn, torch.nn.parallel.DistributedDataParallel)):
        return 0
    if model.gradient_as_bucket_view:
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


_ATEN = torch.ops.aten


@contextlib.contextmanager
def _ring_attention() -> Iterator[None]:
    """Context parallelism's ring attention for the CPU's attention op. torch's ring attention (which a
    context-parallel layout makes of `F.scaled_dot_product_attention`, on CUDA) is registered for the flash,
    memory-efficient and cuDNN ops; a fake CPU tensor's attention is `_scaled_dot_product_flash_attention_for_cpu`,
    which DTensor then has no rule for. Here it, and its backward, become the memory-efficient op, whose ring
    version runs on the fake tensors (its shapes: each process's slice of the sequence, and the slices received
    from the ring). The context-parallel layout check lets the CPU through for the estimate (`played_rank`)."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    added = {
        _ATEN._scaled_dot_product_flash_attention_for_cpu.default: _efficient_attention,
        _ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default: _efficient_attention_backward,
    }
    handlers.update(added)
    try:
        yield
    finally:
        for op in added:
            handlers.pop(op, None)


def _efficient_attention(op: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    query, key, value, *rest = args
    dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    output, logsumexp, _, _ = _ATEN._scaled_dot_product_efficient_attention.default(
        query, key, value, kwargs.get("attn_mask"), True, dropout_p, is_causal, scale=kwargs.get("scale")
    )
    return output, logsumexp


def _efficient_attention_backward(op: Any, args: tuple, kwargs: dict) -> tuple[Any, ...]:
    grad_output, query, key, value, output, logsumexp, *rest = args
    dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    seed = offset = torch.zeros((), dtype=torch.int64)  # dropout's random state: no values to keep in an estimate
    gradients = _ATEN._scaled_dot_product_efficient_attention_backward.default(
        grad_output,
        query,
        key,
        value,
        None,
        output,
        logsumexp,
        seed,
        offset,
        dropout_p,
        [True, True, True, False],
        is_causal,
        scale=kwargs.get("scale"),
    )
    return tuple(gradients[:3])
