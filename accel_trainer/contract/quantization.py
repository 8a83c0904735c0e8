"""A pretrained base held in 4 bits (QLoRA): `quantize_base(model, "nf4")` before the adapter is added.

QLoRA keeps the frozen base's linear weights in NF4 (4-bit NormalFloat, QLoRA's data type: blocks of 64 values,
each block's absolute maximum quantized again to 8 bits) and trains a LoRA adapter beside them in the run's
precision. The weights here are torchao's `NF4Tensor`: a tensor subclass that `F.linear` dequantizes block by
block at each use, that runs on the CPU as on a GPU, and that FSDP2 shards and gathers in its 4-bit form (its
`fsdp_pre_all_gather` hands FSDP the packed bytes and the scales, so a gathered weight is still NF4: the failure
seen with bitsandbytes' `Params4bit` under FSDP2, which FSDP unshards into plain tensors, cannot happen).

Why not bitsandbytes: its 4-bit weights are a `Parameter` subclass whose quantization state lives beside the
data, which FSDP2 drops (accelerate's and axolotl's trackers); torchao's is what torchtune trains QLoRA with
under FSDP2. On one CPU process bitsandbytes 0.50 was 11% faster a step and held 107 MiB more (SmolLM2-135M,
LoRA r=8, 4 x 65 tokens: 1.80 s and 1,903 MiB against 2.03 s and 1,796 MiB); its FSDP2 failure was not
reproduced here.

The quantization depends on the weight alone, never on the layout, so every layout trains on the same 4-bit base
(the exactness tests compare their adapters). torchao's second-level block (its `scaler_block_size`, 256 by
default) must divide the weight's count of 64-value blocks, which most real shapes do not (SmolLM2's 576 x 576
has 5,184 blocks): `scaler_block_size` picks the largest size up to 256 that divides it and leaves a count of
scale blocks that 8 processes (else 4, else 2) split evenly under FSDP2.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

from accel_trainer.console.import_noise import drop_known_import_noise
from accel_trainer.contract.frozen_in_16_bits import hold_in_16_bits, restore_dtype
from accel_trainer.errors import RecipeError
from accel_trainer.host.allocator import release_free_memory

SCHEMES: tuple[str, ...] = ("none", "nf4")
BLOCK = 64
"""Values per NF4 block, QLoRA's."""
MAX_SCALER_BLOCK = 256
"""Blocks per second-level (scale) block at most, torchao's default."""


def quantize_base(model: nn.Module, scheme: str) -> nn.Module:
    """`model` with every linear weight but the output head's replaced by its 4-bit NF4 form (frozen), in place, and
    the embedding and head held in bfloat16 (contract/frozen_in_16_bits.py):
    `nn.Linear`'s, and transformers' `Conv1D`'s (GPT-2's, the weight stored input-major) through `FourBitConv1D`.

    A weight whose size is not a multiple of 64 values stays as it is; `kept_in_full_precision` names them. A
    model on the meta device (the FLOP count's copy, a process that waits for FSDP's broadcast) stays as it is:
    there are no values to quantize, and a 4-bit weight's matrix product counts as the full one's. A weight in 4
    bits already (a base quantized while it was read: contract/loading.py) stays as it is.

    Raises:
        RecipeError: an unknown scheme, torchao not installed, or no linear weight to quantize.
    """
    if not check_scheme(scheme):
        return model
    linear = linear_layers(model)
    if not linear:
        raise RecipeError(f"quantize_base={scheme}: the base ({type(model).__name__}) has no linear layer to quantize")
    for module in linear:
        if quantizable(module.weight):
            quantize_layer(module)
    hold_in_16_bits(_layer(model, "get_input_embeddings"), output_head(model))  # frozen_in_16_bits.py says why
    return_freed_memory()
    return model


def check_scheme(scheme: str) -> bool:
    """Whether `scheme` quantizes (nf4: torchao is then importable), or not (none).

    Raises:
        RecipeError: an unknown scheme, or nf4 without torchao.
    """
    if scheme not in SCHEMES:
        raise RecipeError(f"quantize_base={scheme}: not a scheme accel-trainer knows; use one of {', '.join(SCHEMES)}")
    return scheme == "nf4" and nf4_constructor() is not None


def quantizable(weight: torch.Tensor) -> bool:
    """Whether a linear layer's weight is one `quantize_layer` takes: values (not meta), in full precision, a
    multiple of the 64-value block."""
    return not (weight.numel() % BLOCK or weight.is_meta or is_quantized(weight))


def quantize_layer(module: Any) -> None:
    """Replace a linear layer's weight by its NF4 form, frozen (a `Conv1D` becomes a `FourBitConv1D`): the one
    place a weight is quantized, whether the whole base is at hand (`quantize_base`) or the weight alone (read
    from the base's file: contract/loading.py), so both give the same 4 bits.

    The freed memory goes back to the system at once (`release_free_memory`): an allocator keeps the full-precision
    weight and the quantizing's temporaries (torchao's nearest-level search: over 64 bytes a value) for reuse,
    scattered between the 4-bit weights made since, so a process grew with each weight (on glibc, quantizing
    SmolLM2-135M after reading it grew a process by 1.4 GiB; read from a folder one weight at a time, its peak
    was 1,072 MiB against 627 MiB)."""
    weight = module.weight.detach()
    quantized = nf4_constructor()(weight.contiguous(), BLOCK, scaler_block_size(weight.numel() // BLOCK))
    if not isinstance(module, (nn.Linear, FourBitConv1D)):
        module.__class__ = _four_bit_class(type(module))
    module.weight = nn.Parameter(quantized, requires_grad=False)
    del weight, quantized
    release_free_memory()


def return_freed_memory() -> None:
    """Give the memory of the freed full-precision weights back to the system. glibc's allocator keeps freed
    blocks for reuse, so a process's memory did not shrink when its weights went to 4 bits: SmolLM2-135M held
    1,180 MiB right after quantizing (938 MiB before it, the quantizing's temporaries on top) and 571 MiB after
    `malloc_trim(0)`; tcmalloc and jemalloc are told the same (host/allocator.py)."""
    gc.collect()
    release_free_memory()


def linear_layers(model: nn.Module) -> list[Any]:
    """`model`'s linear layers but the output head: `nn.Linear`s and transformers' `Conv1D`s (4-bit or not)."""
    head = output_head(model)
    return [
        module
        for module in model.modules()
        if module is not head and (isinstance(module, (nn.Linear, FourBitConv1D)) or type(module).__name__ == "Conv1D")
    ]


def output_head(model: nn.Module) -> Any:
    """A transformers model's output layer (`get_output_embeddings`), which stays in full precision; else None."""
    return _layer(model, "get_output_embeddings")


def _layer(model: nn.Module, getter: str) -> Any:
    """The layer a transformers model's `getter` method returns (its embedding, its head); None for other models."""
    method = getattr(model, getter, None)
    return method() if callable(method) else None


class FourBitConv1D(nn.Module):
    """transformers' `Conv1D` (x @ W + b, W of shape (inputs, outputs)) with a 4-bit weight: the product takes
    the weight dequantized and keeps only its 4 bits for the backward (`_InputMajorFourBit`). A quantized
    `Conv1D` becomes an instance of a subclass of its class and of this one, and `dequantize` makes it a `Conv1D`
    again."""

    weight: Any
    bias: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.weight.shape[-1])
        out = _InputMajorFourBit.apply(x.reshape(-1, x.shape[-1]), self.weight)
        return (out + self.bias).view(shape)  # type: ignore[operator]


def _four_bit_class(conv1d: type) -> type:
    """The 4-bit subclass of a `Conv1D` class, one per class."""
    if conv1d not in _FOUR_BIT_CLASSES:
        _FOUR_BIT_CLASSES[conv1d] = type(f"NF4{conv1d.__name__}", (FourBitConv1D, conv1d), {})
    return _FOUR_BIT_CLASSES[conv1d]


_FOUR_BIT_CLASSES: dict[type, type] = {}


class _InputMajorFourBit(torch.autograd.Function):
    """x @ W for a 4-bit W of shape (inputs, outputs): torchao's `linear_nf4` for the transposed layout."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Any) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return x @ weight.get_original_weight().to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad @ weight.get_original_weight().to(grad.dtype).t(), None


def scaler_block_size(blocks: int) -> int:
    """The second-level block for a weight of `blocks` 64-value blocks: the largest size up to 256 that divides
    it, among those that leave a count of scale blocks divisible by 8 (else by 4, by 2, by 1)."""
    for shards in (8, 4, 2, 1):
        sizes = [size for size in range(1, MAX_SCALER_BLOCK + 1) if blocks % (size * shards) == 0]
        if sizes:
            return max(sizes)
    return 1


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (or the local part of a sharded one) is a 4-bit NF4 weight."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


def quantized_names(model: nn.Module) -> list[str]:
    """The names of `model`'s 4-bit parameters."""
    return [name for name, parameter in model.named_parameters() if is_quantized(parameter)]


def kept_in_full_precision(model: nn.Module) -> list[str]:
    """The frozen linear weights of a quantized `model` left in full precision (not the output head's, nor an
    adapter's, which trains): their size is not a multiple of NF4's 64-value block."""
    names = {id(module): name for name, module in model.named_modules()}
    return [
        f"{names[id(module)]}.weight"
        for module in linear_layers(model)
        if not module.weight.requires_grad and not is_quantized(module.weight)
    ]


def storage_bytes(tensor: torch.Tensor) -> int:
    """The bytes `tensor` holds: for a 4-bit weight, its packed values and scales, not numel x element size."""
    return sum(part.nbytes for part in stored_parts(tensor))


def stored_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors `tensor` is stored as: a 4-bit weight's packed values and scales (what its contents are
    digested from), else the tensor itself."""
    local: Any = getattr(tensor, "_local_tensor", tensor)
    if not is_quantized(local):
        return [tensor]
    names, _ = local.__tensor_flatten__()
    return [getattr(local, name) for name in names]


def kept_out_of_ddp(model: nn.Module) -> None:
    """Tell DDP to leave `model`'s 4-bit weights alone. DDP broadcasts every parameter, frozen ones too, from the
    first process when it wraps a model; its coalesced broadcast flattens them into plain values and copies them
    back, which quantizes the dequantized weight again: not the same 4 bits (a different block maximum), so the
    other processes trained on another base (their adapters differed from one process's by 1e-4 after 4 steps).
    Every process quantized the same base alike already. Canary: tests/unit/test_quantization.py."""
    names = quantized_names(model)
    if names:
        ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        model.__dict__["_ddp_params_and_buffers_to_ignore"] = sorted(ignored | set(names))  # as DDP's setter sets


def on_the_plain_tensors_device(model: nn.Module) -> None:
    """Give `model`'s 4-bit weights the device its plain tensors report. accelerate's device for one GPU is
    `cuda`, without an index; a plain tensor moved there reports `cuda:0`, while torchao's NF4Tensor keeps the
    device it was handed, `cuda`. torch's full-state-dict load refuses a model on two devices, so a QLoRA run on
    one GPU could not resume ("Multiple devices found"; found on an H200). Canary (CPU's `cpu:0` is the same
    case): tests/unit/test_quantization.py."""
    for parameter in model.parameters():
        if is_quantized(parameter) and not hasattr(parameter, "_local_tensor"):  # not sharded
            plain = torch.empty(0, device=parameter.device).device
            if plain != parameter.device:
                model.to(plain)  # the NF4 weights are rebuilt on `plain`; the others are there already
                return


def check_shardable(model: nn.Module, shards: int) -> None:
    """Refuse, in one line, a 4-bit weight FSDP2 cannot split over `shards` processes in its 4-bit form: it cuts
    the first dimension into equal parts, and each part must hold whole 64-value blocks and whole scale blocks.

    Raises:
        RecipeError: naming the first such weight, its shape and its counts of blocks.
    """
    parameter: Any
    for name, parameter in model.named_parameters():
        if shards > 1 and is_quantized(parameter):
            blocks = parameter.numel() // BLOCK
            scale_blocks = blocks // parameter.scaler_block_size
            if parameter.shape[0] % shards or scale_blocks % shards:
                raise RecipeError(
                    f"quantize_base=nf4 under FSDP2 on {shards} shards: {name} {tuple(parameter.shape)} holds"
                    f" {scale_blocks} scale blocks of {parameter.scaler_block_size} x 64 values, which do not split"
                    f" into {shards} equal parts: shard over a count that divides it, or use DDP"
                )


def dequantize(model: nn.Module) -> nn.Module:
    """`model` with each 4-bit weight replaced by the full-precision weight it stands for (its dequantized
    values, in the dtype it was quantized from), in place: the model that trained, as plain tensors."""
    restore_dtype(model)  # the embedding and head held in 16 bits
    for module in model.modules():
        weight: Any = module._parameters.get("weight")  # its own (a peft layer's `weight` is its base layer's)
        if weight is not None and is_quantized(weight):
            module.weight = nn.Parameter(weight.get_original_weight(), requires_grad=False)
        if isinstance(module, FourBitConv1D):
            module.__class__ = type(module).__bases__[1]  # the Conv1D it was
    return model


def nf4_constructor() -> Any:
    """torchao's `to_nf4`, or a one-line error saying how to install it."""
    drop_known_import_noise()  # for a script that calls this without an accel-trainer entry point
    try:
        from torchao.quantization import to_nf4
    except ImportError as error:
        raise RecipeError(f"quantize_base=nf4 needs torchao ({error}): pip install 'accel-trainer[quantize]'") from None
    return to_nf4
