"""The device mesh of a run, built in one place: pipeline x data parallel (replicated x sharded) x tensor.

A layout splits its processes over the dimensions `(pp, dp_replicate, dp_shard, tp)`, pp outermost, the
rest in accelerate's order:
- `pp`: pipeline stages, each process running its part of the model's blocks (parallel/pipeline/stages.py); a pipeline
  combines with FSDP (each stage sharded over dp_shard processes, parallel/pipeline/sharding.py), not yet with TP or
  HSDP;
- `tp`: tensor parallelism, the recipe's `tp_plan` splitting each layer's weights (parallel/tensor_parallel.py);
- `dp_shard`: FSDP2 sharding of parameters, gradients and optimizer state;
- `dp_replicate`: replicas of the sharded model (HSDP: shard within a group, all-reduce between groups);
- `cp`: context parallelism (GPU only), each process of a cp group taking a slice of every sequence
  (parallel/context_parallel.py); FSDP shards over dp_shard x cp.
Processes that differ only in `pp` or `tp` form one data-parallel rank: they see the same batches. The batch plan,
the data sharding, evaluation and the item counts use `data_parallel_size` and `data_parallel_rank`, never
the process count.

The sizes come from the accelerate config's `parallelism_config` section (`parallelism_config_tp_size`,
`..._dp_replicate_size`, `..._dp_shard_size`), which accelerate's launcher accepts for FSDP layouts only, or
from the layout setting `tp_size` (any layout, e.g. `accelerate_configs/cpu_tp.settings.yaml`). Without FSDP,
every process is one tensor-parallel rank (world size = tp_size): DDP across tensor-parallel groups does not
train (torch's `replicate` over a TP mesh, measured), so data parallelism beside TP takes an FSDP layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelerate import Accelerator

from accel_trainer.config.layout import LayoutSettings
from accel_trainer.errors import LayoutError
from accel_trainer.parallel import launch_fixes


@dataclass(frozen=True)
class MeshShape:
    """How many processes each dimension spans; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks: groups of processes that see different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def needs_mesh(self) -> bool:
        """Whether the layout goes beyond what accelerate builds by itself (DDP, or FSDP over all processes)."""
        return self.tp > 1 or self.dp_replicate > 1 or self.pp > 1 or self.cp > 1


CONTEXT_PARALLEL_DEVICES = {"cuda"}  # torch's ring attention has kernels for these (none for the CPU)


def mesh_shape(layout: LayoutSettings, world_size: int, is_fsdp: bool, device_type: str = "cpu") -> MeshShape:
    """The mesh this launch asks for, or a one-line error naming what does not fit.

    Raises:
        LayoutError: sizes that do not divide the world, TP and the accelerate config disagreeing, data
            parallelism beside TP without FSDP.
    """
    launcher = launch_fixes.launcher_parallelism_sizes()
    cp = launcher.pop("cp", 1)
    if cp > 1:
        _check_context_parallel(layout, cp, is_fsdp, device_type)
    if layout.pp_size != 1:
        return _pipeline_shape(layout, world_size, is_fsdp, launcher)
    tp = layout.tp_size
    if tp < 1:
        raise LayoutError(f"tp_size={tp}: must be at least 1")
    if launcher.get("tp", 1) > 1 and tp > 1 and launcher["tp"] != tp:
        raise LayoutError(
            f"tp_size={tp} disagrees with parallelism_config_tp_size={launcher['tp']} of the accelerate config:"
            " set it in one place"
        )
    tp = max(tp, launcher.get("tp", 1))
    dp_replicate = launcher.get("dp_replicate", 1)
    if world_size % (tp * dp_replicate * cp):
        raise LayoutError(
            f"{world_size} process(es) cannot be split into tp_size={tp} x dp_replicate_size={dp_replicate} x"
            f" cp_size={cp} groups: launch a multiple of their product"
        )
    data_parallel = world_size // (tp * cp)
    if data_parallel > 1 and tp > 1 and not is_fsdp:
        raise LayoutError(
            f"tensor parallelism over {tp} of {world_size} processes needs FSDP for the data-parallel dimension"
            " (DDP across tensor-parallel groups does not train): launch an FSDP layout such as"
            " accelerate_configs/cpu_fsdp_tp.yaml, or as many processes as tp_size"
        )
    dp_shard = data_parallel // dp_replicate
    if is_fsdp and dp_shard * cp == 1 and world_size > 1:
        raise LayoutError(
            f"this FSDP layout leaves FSDP nothing to shard over (tp {tp} x dp_replicate {dp_replicate} ="
            f" {world_size} processes): launch more processes, or a layout without FSDP (cpu_tp.yaml)"
        )
    expected_shard = launcher.get("dp_shard", 1)
    if expected_shard > 1 and expected_shard != dp_shard:
        raise LayoutError(
            f"parallelism_config_dp_shard_size={expected_shard} of the accelerate config, but {world_size}"
            f" process(es) / (tp {tp} x dp_replicate {dp_replicate}) leaves {dp_shard}: fix num_processes or"
            " the sizes"
        )
    return MeshShape(dp_replicate, dp_shard, tp, cp=cp)


def _check_context_parallel(layout: LayoutSettings, cp: int, is_fsdp: bool, device_type: str) -> None:
    if device_type not in CONTEXT_PARALLEL_DEVICES:
        raise LayoutError(
            f"parallelism_config_cp_size={cp} on {device_type}: context parallelism needs CUDA GPUs (torch's ring"
            " attention has no CPU kernel); launch a GPU layout such as accelerate_configs/8gpu_fsdp_cp.yaml"
        )
    if not is_fsdp or layout.tp_size > 1 or layout.pp_size > 1:
        raise LayoutError(
            f"parallelism_config_cp_size={cp}: context parallelism runs on FSDP2 layouts, without tensor or"
            " pipeline parallelism for now (accelerate_configs/8gpu_fsdp_cp.yaml)"
        )


def _pipeline_shape(layout: LayoutSettings, world_size: int, is_fsdp: bool, launcher: dict[str, int]) -> MeshShape:
    pp = layout.pp_size
    if pp < 1:
        raise LayoutError(f"pp_size={pp}: must be at least 1")
    if layout.tp_size > 1 or any(size > 1 for name, size in launcher.items() if name != "dp_shard"):
        raise LayoutError(
            f"pp_size={pp} with tensor parallelism or HSDP: a pipeline combines with FSDP only for now; launch"
            " accelerate_configs/cpu_pp_fsdp.yaml or cpu_pp.yaml, or drop pp_size"
        )
    if not is_fsdp:
        if world_size != pp:
            raise LayoutError(
                f"pp_size={pp} but {world_size} process(es) were launched: a pipeline layout without FSDP runs one"
                f" process per stage, so launch {pp} (or an FSDP layout, such as cpu_pp_fsdp.yaml, for more)"
            )
        return MeshShape(pp=pp)
    if world_size % pp or world_size == pp:
        raise LayoutError(
            f"pp_size={pp} on an FSDP layout of {world_size} process(es): FSDP shards each stage over"
            f" {world_size}/{pp} processes, so launch a multiple of pp_size above it ({2 * pp}, ...)"
        )
    dp_shard = world_size // pp
    expected = launcher.get("dp_shard", 1)
    if expected > 1 and expected != dp_shard:
        raise LayoutError(
            f"parallelism_config_dp_shard_size={expected} of the accelerate config, but {world_size} process(es)"
            f" / pp_size {pp} leaves {dp_shard}: fix num_processes or the sizes"
        )
    return MeshShape(dp_shard=dp_shard, pp=pp)


@dataclass(frozen=True)
class DataRanks:
    """This process's data-parallel rank and the number of them: what the data path and the counts use."""

    rank: int
    size: int
    replicas: int  # processes per data-parallel rank that count the same items (tensor or pipeline ranks)
    context_parallel: int = 1  # processes per data-parallel rank that each take a slice of every sequence


def data_ranks(accelerator: Accelerator) -> DataRanks:
    """This process's place in the data-parallel dimension of the run's mesh (every process without a mesh)."""
    config = accelerator.parallelism_config
    tp = config.tp_size if config is not None else 1
    cp = config.cp_size if config is not None else 1
    pp = getattr(config, "pp_size", 1)
    per_stage = accelerator.num_processes // pp  # pp outermost, then dp, cp, tp innermost (accelerate's order)
    rank = accelerator.process_index % per_stage // (cp * tp)
    return DataRanks(rank, per_stage // (cp * tp), tp * pp, cp)


def tensor_parallel_size(accelerator: Accelerator) -> int:
    """The run's tp size, wherever it was set (the layout setting or the accelerate config)."""
    config = accelerator.parallelism_config
    return config.tp_size if config is not None else 1


def describe_mesh(accelerator: Accelerator) -> str:
    """The mesh in words, like "dp_shard 2 x tp 2"; empty without one."""
    config = accelerator.parallelism_config
    if config is None:
        return ""
    sizes = {
        "pp": getattr(config, "pp_size", 1),
        "dp_replicate": config.dp_replicate_size,
        "dp_shard": config.dp_shard_size,
        "cp": config.cp_size,
        "tp": config.tp_size,
    }
    return " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1)


def set_up_mesh(accelerator: Accelerator, layout: LayoutSettings) -> MeshShape:
    """Decide the run's mesh and, where it needs one, give it to accelerate (launch_fixes.attach_mesh)."""
    shape = mesh_shape(layout, accelerator.num_processes, accelerator.is_fsdp2, accelerator.device.type)
    if shape.pp > 1:
        launch_fixes.attach_pipeline(accelerator, shape.pp, shape.dp_shard)
    elif shape.needs_mesh:
        launch_fixes.attach_mesh(accelerator, shape.dp_replicate, shape.dp_shard, shape.tp, shape.cp)
    return shape
