"""Workarounds for measured accelerate 1.15 problems, all in this one module; docs/accelerate-traps.md tells each
trap in full, with its canary test (test_launch_fixes.py, test_multiprocess.py, test_layout_equivalence.py,
test_killed_workers.py).

- CPU launches: `--cpu --num_processes N` (or a MULTI_CPU config) starts one process without mpirun, and
  `--multi_gpu` without a GPU starts N worlds of 1. torchrun's launch with `cpu=True` in the workers gives
  MULTI_CPU over gloo: `wants_cpu` supplies that `cpu=True`; `check_launched_world` refuses the rest.
- FSDP on CPU: refused, or silently dropped to DDP under MULTI_CPU. torch's FSDP2 works on a gloo CPU mesh once
  both states say FSDP and the plugin is put back: `enable_fsdp_on_cpu`.
- Elastic restarts: restarted workers often read the dead attempt's addresses (pytorch#167288);
  `init_process_group_per_attempt` keys each attempt's rendezvous under its restart count.
- Meshes (TP, HSDP): accelerate refuses them under MULTI_CPU and its TP preparation is for transformers
  models, so the launcher's sizes are hidden during construction (`launcher_parallelism_sizes`,
  `parallelism_config_hidden`) and the mesh attached after it (`attach_mesh`, `_FsdpMesh`); TP itself is
  parallel/tensor_parallel.py's, applied before `prepare`.
- FSDP2's `cpu_ram_efficient_loading` re-ties tied weights only through `tie_weights()`, so a plain model's
  LM head and embedding silently train apart, fails on buffers in the state dict (BatchNorm) and on a plain
  module's top-level parameters: parallel/fsdp_loading.py keeps it only for a pretrained transformers model that
  `broadcastable` says it keeps whole, and turns it off for every other model.
- Pipelines: accelerate has no pipeline dimension and would give each stage different data: `attach_pipeline`
  records the stage count, `prepare_loader_for_data_ranks` prepares loaders for the data ranks.

The per-step speed shortcuts are not here: they are the loop's step verbs (parallel/verbs.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig, find_tied_parameters
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

from accel_trainer.errors import LayoutError

_LAUNCHER_WORLD_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def wants_cpu() -> bool:
    """Whether the workers must ask accelerate for the CPU: no CUDA device, or the launcher said so."""
    return not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("true", "1")


def launched_world_size() -> int | None:
    """The number of processes the launcher started, from its environment; None when not launched."""
    for name in _LAUNCHER_WORLD_VARIABLES:
        if os.environ.get(name):
            return int(os.environ[name])
    return None


def forget_accelerate_state() -> None:
    """Forget accelerate's process-wide singletons, so that the next Accelerator is built from its own settings.

    `AcceleratorState` is a singleton: a second `Accelerator(mixed_precision=...)` with another value in the
    same process raises "restart your runtime", which made a second `at.train` in a notebook or a sweep fail.
    Called when no process group is up (one process), where there is nothing else to keep, and after a run
    that keeps the launcher's group for the next one (`train(keep_process_group=True)`): the group itself stays.
    """
    from accelerate.state import GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def refuse_single_process_cpu_launch() -> None:
    """Stop an `accelerate launch --cpu --num_processes N` that silently started a single process.

    accelerate's simple launcher sets MASTER_ADDR only when it was asked for several processes or machines,
    yet starts one process and no launcher world size; that combination is the silent single-process run.
    Only the simple launcher sets ACCELERATE_USE_CPU, to "False" for a `distributed_type: MULTI_CPU` config
    with `use_cpu: false`, which started one process just the same (found by `accel-trainer doctor`).
    """
    simple_launch = "ACCELERATE_USE_CPU" in os.environ
    if simple_launch and os.environ.get("MASTER_ADDR") and launched_world_size() is None:
        raise LayoutError(
            "`accelerate launch --cpu` (or a MULTI_CPU config) with several processes starts only one process"
            " without mpirun; launch with --config_file accelerate_configs/cpu_ddp.yaml or with torchrun"
        )


def check_launched_world(num_processes: int) -> None:
    """Refuse a run whose processes do not form the world the launcher started."""
    launched = launched_world_size()
    if launched is not None and launched != num_processes:
        raise LayoutError(
            f"the launcher started {launched} processes but each sees a world of {num_processes}:"
            " they would train independently; on a machine without GPUs use accelerate_configs/cpu_ddp.yaml"
            " or torchrun"
        )


def fsdp_plugin_from_launcher() -> FullyShardedDataParallelPlugin | None:
    """The FSDP plugin the launcher asked for (its FSDP_* environment), or None without FSDP."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() != "true":
        return None
    return FullyShardedDataParallelPlugin()


def enable_fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin | None) -> None:
    """Turn a CPU run that asked for FSDP back into FSDP instead of the DDP accelerate silently falls back to."""
    if plugin is None or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    if plugin.fsdp_version != 2:
        raise LayoutError("FSDP on the CPU needs FSDP2: set fsdp_version: 2 in the accelerate config")
    state = AcceleratorState()
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP


def broadcastable(model: torch.nn.Module) -> bool:
    """Whether accelerate's RAM-efficient FSDP2 loading keeps `model` whole. It does not when the model ties
    weights and has no `tie_weights()` to tie them again (they come back untied and train apart), nor when its
    state dict holds buffers (a BatchNorm's statistics): the broadcast takes every entry for a sharded parameter
    (AttributeError: 'Tensor' object has no attribute 'device_mesh'). It also looks each entry up with
    transformers' `get_parameter_or_buffer`, which a plain module lacks (its fallback fails on a top-level
    parameter): parallel/fsdp_loading.py uses it for transformers models only. Canaries: test_launch_fixes.py."""
    ties_kept = hasattr(model, "tie_weights") or not find_tied_parameters(model)
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return ties_kept and set(model.state_dict()) <= parameters


def init_process_group_per_attempt(timeout_s: float) -> None:
    """Initialise the default process group on a store prefixed with the elastic restart attempt."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if attempt is None or world_size < 2 or dist.is_initialized():
        return
    rank = int(os.environ["RANK"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timeout,
    )
    dist.init_process_group(
        backend="gloo" if wants_cpu() else "nccl",
        store=dist.PrefixStore(f"accel_trainer/attempt_{attempt}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


_PARALLELISM_VARIABLES = {
    "dp_replicate": "DP_REPLICATE_SIZE",
    "dp_shard": "DP_SHARD_SIZE",
    "tp": "TP_SIZE",
    "cp": "CP_SIZE",
    "sp": "SP_SIZE",
}


def launcher_parallelism_sizes() -> dict[str, int]:
    """The sizes of the accelerate config's `parallelism_config` section, as the launcher passed them on.

    Raises:
        LayoutError: sequence parallelism of DeepSpeed's kind (Ulysses), which accel-trainer does not drive.
    """
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() != "true":
        return {}
    sizes = {
        name: int(os.environ.get(f"PARALLELISM_CONFIG_{variable}") or 1)
        for name, variable in _PARALLELISM_VARIABLES.items()
    }
    if sizes.pop("sp") > 1:
        raise LayoutError(
            "parallelism_config_sp_size > 1 in the accelerate config: accel-trainer drives data, tensor, context"
            " and FSDP parallelism; set parallelism_config_sp_size: 1 (tensor parallelism's sequence parallel"
            " comes with tp_size)"
        )
    return sizes


@contextlib.contextmanager
def parallelism_config_hidden() -> Iterator[None]:
    """Keep accelerate from building (and, on a CPU FSDP launch, refusing) the mesh inside `Accelerator()`."""
    value = os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    try:
        yield
    finally:
        if value is not None:
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = value


class _FsdpMesh(ParallelismConfig):
    """The run's sizes and mesh for an FSDP2 layout whose tensor parallelism (parallel/tensor_parallel.py) applied.

    `tp_enabled` is False so that `prepare` skips accelerate's transformers-only TP step and goes straight to
    `fully_shard` over the data-parallel dimensions. The mesh is built by an ordinary `ParallelismConfig`
    (whose `tp_enabled` puts the `tp` dimension into it) and handed to this one.
    """

    @property
    def tp_enabled(self) -> bool:
        return False


def attach_mesh(accelerator: Accelerator, dp_replicate: int, dp_shard: int, tp: int, cp: int = 1) -> None:
    """Give accelerate the run's `ParallelismConfig` and device mesh now that the Accelerator exists (with a
    cp dimension, accelerate's `prepare` then sets up its context-parallel context: parallel/context_parallel.py)."""
    sizes = {"dp_replicate_size": dp_replicate, "dp_shard_size": dp_shard, "tp_size": tp, "cp_size": cp}
    config = ParallelismConfig(**sizes)
    mesh = config.get_device_mesh(accelerator.device.type)  # built by the honest config: with its tp dimension
    if accelerator.is_fsdp2:
        config = _FsdpMesh(**sizes)
        config.device_mesh = mesh
    state = AcceleratorState()
    state.parallelism_config = config
    state.device_mesh = mesh


@dataclass
class PipelineParallelism(ParallelismConfig):
    """The run's sizes on a pipeline layout: accelerate's config has no pipeline dimension, so this one carries
    it for mesh.data_ranks. accelerate's `prepare` never sees the model (engine/preparation.py). Without FSDP no
    device mesh is attached (the stages' sends use the world group); with FSDP the mesh is `(pp, dp_shard)`,
    pp outermost, and each stage is sharded over its `dp_shard` slice (parallel/pipeline/sharding.py)."""

    pp_size: int = 1


def attach_pipeline(accelerator: Accelerator, pp: int, dp_shard: int = 1) -> None:
    state = AcceleratorState()
    state.parallelism_config = PipelineParallelism(pp_size=pp, dp_shard_size=dp_shard)
    if dp_shard > 1:
        state.device_mesh = init_device_mesh(accelerator.device.type, (pp, dp_shard), mesh_dim_names=("pp", "dp_shard"))


def prepare_loader_for_data_ranks(accelerator: Accelerator, loader: DataLoader, rank: int, size: int) -> Any:
    """`accelerator.prepare_data_loader` for the data-parallel ranks of a pipeline layout.

    accelerate shards a loader over all processes, or over its mesh's data dimensions when the mesh has tp
    or cp ones; it knows no pipeline stages, which must all see the same batches. This passes the data rank
    and count explicitly, with the Accelerator's own loader settings (canary: test_pipeline.py).
    """
    prepared = prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=size,
        process_index=rank,
        split_batches=accelerator.split_batches,
        put_on_device=accelerator.device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=accelerator.dispatch_batches,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
    accelerator._dataloaders.append(prepared)  # as accelerator.prepare_data_loader does
    return prepared
