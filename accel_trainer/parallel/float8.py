"""float8 training, `mixed_precision=fp8`: accelerate's fp8 with its torchao backend, where it can run.

With `mixed_precision: fp8` (the layout setting, or the accelerate config with `fp8_config: {backend: AO}`),
accelerate's `prepare` turns the model's linear layers into torchao's `Float8Linear` (its `AORecipeKwargs`: the
first and last linear layers and those whose sizes are not multiples of 16 stay as they are, inner dimensions
padded, FSDP2 gathering the weights in float8): their matrix products run in float8 on the tensor cores
(`torch._scaled_mm`), everything else as without fp8.

Where that cannot run, accelerate does not say so: on the CPU a run with `mixed_precision: fp8` trained in fp32
while its header said fp8, and a GPU without float8 tensor cores (compute capability below 8.9: A100, V100)
fails inside the first step. `check_float8` refuses both in one line, with the reason, before anything is
built; the other backends accelerate knows (Transformer Engine, MS-AMP) and the combination accelerate refuses
(torchao under FSDP2 with RAM-efficient loading) likewise. Canary for the accelerate config fields this reads:
tests/unit/parallel/test_float8.py.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from accel_trainer.config.layout import LayoutSettings
from accel_trainer.errors import LayoutError

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with float8 tensor cores (Ada: L4, L40, RTX 40xx; Hopper: H100)."""


def wants_float8(layout: LayoutSettings) -> bool:
    """Whether the run asks for fp8: the layout setting, else the launcher's (the accelerate config's)."""
    asked = layout.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return str(asked).lower() == "fp8"


def check_float8(layout: LayoutSettings, fsdp_plugin: Any = None) -> None:
    """Refuse fp8 where it cannot train as asked (see the module's docstring).

    Raises:
        LayoutError: naming what is missing, and what to use instead.
    """
    if not wants_float8(layout):
        return
    if not torch.cuda.is_available():
        raise LayoutError(
            "mixed_precision=fp8 runs float8 matrix products on CUDA GPUs of compute capability 8.9 or newer"
            " (H100, H200, L4, L40, RTX 40xx), and this machine has no CUDA GPU: use mixed_precision=bf16 or no"
        )
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise LayoutError(
            f"mixed_precision=fp8 needs float8 tensor cores (CUDA compute capability 8.9 or newer), and"
            f" {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}: use mixed_precision=bf16"
        )
    backend = os.environ.get("ACCELERATE_FP8_BACKEND", "AO").upper()
    if backend not in ("AO", "NO"):
        raise LayoutError(
            f"fp8_config backend {backend}: accel-trainer trains fp8 through torchao; set `fp8_config: {{backend:"
            " AO}` in the accelerate config"
        )
    if importlib.util.find_spec("torchao") is None:
        raise LayoutError("mixed_precision=fp8 needs torchao: pip install 'accel-trainer[quantize]'")
    if fsdp_plugin is not None and fsdp_plugin.cpu_ram_efficient_loading:
        raise LayoutError(
            "mixed_precision=fp8 under FSDP2 cannot load RAM-efficiently (accelerate refuses torchao with it): set"
            " fsdp_cpu_ram_efficient_loading: false in the accelerate config"
        )


def float8_handlers(layout: LayoutSettings, fsdp_plugin: Any = None) -> list[Any]:
    """accelerate's torchao fp8 recipe for an fp8 run (it reads the config's `fp8_config` itself), else none.

    float8 all-gather only under FSDP2. accelerate turns it on by default, and then torchao wraps every converted
    weight in a new Parameter: without FSDP2 (whose preparation maps the optimizer to the new parameters by
    storage) the optimizer, built before `prepare`, steps the old ones, and the converted layers never train
    (found on an H100-class GPU: the final save failed on parameters the model no longer had). Canary:
    tests/unit/parallel/test_float8.py.
    """
    if not wants_float8(layout):
        return []
    from accelerate.utils import AORecipeKwargs

    return [AORecipeKwargs(enable_fsdp_float8_all_gather=fsdp_plugin is not None)]


def check_optimizers_hold_the_model(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """After `prepare` under fp8: every parameter an optimizer steps is one of the model's (see float8_handlers).

    Raises:
        LayoutError: naming a parameter the model no longer holds, rather than training without it.
    """
    held = {id(parameter) for parameter in model.parameters()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if id(parameter) not in held:
                    raise LayoutError(
                        f"mixed_precision=fp8: the optimizer steps a {tuple(parameter.shape)} parameter that the"
                        " float8 model no longer holds (torchao replaced it); report this with your accelerate"
                        " and torchao versions, and use mixed_precision=bf16 meanwhile"
                    )
