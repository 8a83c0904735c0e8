"""FLOPs per training sample and the device's peak: what MFU (model FLOPs utilisation) is made of.

FLOPs are counted once, on the recipe's own model and loss, with torch's `FlopCounterMode` on the meta
device (no memory, no data, no device work): forward and backward of one micro-batch of the shapes the run
trains on, divided by its samples. The model is built afresh with `build_model` and no activation
checkpointing, so recomputation is not counted (MFU counts the model's FLOPs, not the hardware's). Per
sample rather than per token: padding and ignored positions cost compute as well. The source of the figure
is logged: counted, the recipe's own `flops_per_sample`, or the 6N estimate when counting fails.

Peaks are dense (no sparsity) per-device datasheet figures keyed by device name and compute dtype. An
unknown GPU gives no MFU and one warning; the `peak_tflops` layout setting overrides the table (so a CPU run
can log MFU too). A CPU has no standard peak, so without `peak_tflops` it logs no MFU and says nothing.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from accelerate import Accelerator, init_empty_weights
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import TrainConfig
from accel_trainer.contract.losses import read_loss_output
from accel_trainer.data.rng import rng_untouched
from accel_trainer.parallel.fsdp_loading import weights_unread
from accel_trainer.recipe import Recipe

# (name fragment, first match wins) -> dense TFLOP/s per device by compute dtype (vendor datasheets).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"fp8": 1671.0, "bf16": 835.5, "fp16": 835.5, "tf32": 417.8, "fp32": 60.0}),
    ("H100", {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H200", {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L4", {"fp8": 242.5, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
]


def compute_dtype(mixed_precision: str, device: torch.device) -> str:
    """The dtype the matrix units run in: the autocast precision (fp8: the float8 peak, the one its linear layers'
    products run at), else tf32 where CUDA allows it, else fp32."""
    if mixed_precision in ("bf16", "fp16", "fp8"):
        return mixed_precision
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def table_peak_tflops(device: torch.device, dtype: str) -> float | None:
    """The datasheet peak of this device in `dtype`, or None for a CPU or a device not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in PEAK_TFLOPS:
        if fragment in name:
            return peaks.get(dtype)
    return None


def flops_per_sample(
    recipe: Recipe,
    cfg: TrainConfig,
    batch: Any,
    num_parameters: int,
    phases: tuple[str | None, ...] = (None,),
    frozen_parameters: int = 0,
) -> tuple[float, str]:
    """Model FLOPs of one training sample (forward + backward) and where the figure comes from.

    `batch` is a micro-batch, or its meta-device copy: only shapes and dtypes are read. `phases`: the
    alternating optimizers' phases, each a forward and backward of its own (None: one loss, the usual case).
    Counting runs the backward, which computes no gradient for a frozen weight; the estimate without it, 6N
    (2N forward, 2N for the inputs' gradients, 2N for the weights'), leaves out 2 per frozen weight.
    """
    declared = getattr(recipe, "flops_per_sample", None)
    if declared:
        return float(declared), "declared by the recipe's flops_per_sample"
    samples = _batch_size(batch) or int(cfg.micro_batch_size)  # the run's config: auto is resolved
    try:
        with rng_untouched():
            total = _count_on_meta(recipe, cfg, batch, phases)
    except Exception as error:  # noqa: BLE001 - a model that cannot be built or run on meta
        reason = (str(error).strip().splitlines() or [""])[0][:120]
        return _estimate(num_parameters, frozen_parameters, f"counting failed with {type(error).__name__}: {reason}")
    if total <= 0:
        return _estimate(num_parameters, frozen_parameters, "counting found no FLOPs")
    return total / samples, "counted by FlopCounterMode, forward + backward"


def _estimate(num_parameters: int, frozen_parameters: int, why: str) -> tuple[float, str]:
    if frozen_parameters:
        estimate = 6.0 * num_parameters - 2.0 * frozen_parameters
        return estimate, f"a 6N estimate less 2 per frozen weight ({frozen_parameters:,} frozen): {why}"
    return 6.0 * num_parameters, f"a 6N estimate: {why}"


def to_meta(batch: Any) -> Any:
    """A copy of a batch's tensors on the meta device: shapes and dtypes, no data."""
    return tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t, batch)


def _count_on_meta(recipe: Recipe, cfg: TrainConfig, batch: Any, phases: tuple[str | None, ...]) -> int:
    model = model_on_meta(recipe, cfg)
    model.train()
    with FlopCounterMode(display=False) as counter, _MetaScalarsAreOne():
        for phase in phases:  # a step of alternating optimizers is a forward and backward per phase
            extra = {} if phase is None else {"phase": phase}
            output = read_loss_output(recipe.compute_loss(model, to_meta(batch), **extra))
            output.loss.backward()
    return counter.get_total_flops()


class _MetaScalarsAreOne(TorchDispatchMode):
    """A value read off a meta tensor (`.item()`, `bool(mask.all())`) is 1, or True, where torch refuses it:
    transformers reads such values to choose a path (whether a padding mask holds padding, whether position ids
    are packed), and a count needs the shapes alone (the path chosen then is the one without padding)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
        return func(*args, **(kwargs or {}))


def model_on_meta(recipe: Recipe, cfg: TrainConfig) -> torch.nn.Module:
    """The recipe's model with its parameters on the meta device. transformers' `from_pretrained` (a pretrained
    base) refuses a meta default device, but builds under accelerate's `init_empty_weights`, which puts each
    parameter on meta as it is registered (the buffers stay real), with `weights_unread` so that transformers
    reads nothing of the base's weights file but its header."""
    try:
        with torch.device("meta"):
            model = recipe.build_model(cfg)
    except RuntimeError as error:
        if "from_pretrained" not in str(error):
            raise
        with weights_unread(), init_empty_weights(include_buffers=False):  # the base's file: its header alone
            model = recipe.build_model(cfg)
    # transformers reads token values to warn about padding (`.item()`, which meta tensors refuse): this copy
    # only counts, so it forgets its pad token, in every model it holds (a policy and its reference, say)
    for config in {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}.values():
        if getattr(config, "pad_token_id", None) is not None:
            config.pad_token_id = None
    return model


def _batch_size(batch: Any) -> int | None:
    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    return leaves[0].shape[0] if leaves else None


def peak_for_mfu(accelerator: Accelerator, layout: LayoutSettings) -> float | None:
    """The device's peak for MFU: the layout's peak_tflops, else the table; one warning for an unknown GPU."""
    if layout.peak_tflops > 0:
        return layout.peak_tflops
    dtype = compute_dtype(accelerator.mixed_precision, accelerator.device)
    peak = table_peak_tflops(accelerator.device, dtype)
    if peak is None and accelerator.device.type == "cuda" and accelerator.is_main_process:
        device = torch.cuda.get_device_name(accelerator.device)
        warnings.warn(
            f"accel-trainer: no {dtype} peak is known for {device}, so mfu is not logged; set"
            " peak_tflops=<TFLOP/s of one device> to log it",
            stacklevel=2,
        )
    return peak
