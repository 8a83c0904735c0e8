"""A pretrained base read one tensor at a time, and a QLoRA base quantized as it is read.

`load_base_model` (contract/pretrained.py) reads a base with transformers' `from_pretrained`, which builds the
model on the meta device and then loads each of its tensors in turn. This module gives that loading what it
needs so that a QLoRA base never holds more than one of its linear weights in full precision at once, and a GGUF
file is never dequantized whole before its tensors are loaded:

- `nf4_while_loading(skeleton)`: transformers' own torchao quantizer (`TorchAoConfig`), told which weights to
  quantize and how (`FqnToConfig`: the layers `quantize_base` quantizes, each with its scale block), so each
  linear weight goes to 4 bits as soon as it is read, through `quantization.quantize_layer` (the same 4 bits as
  quantizing the whole base afterwards). transformers loads such a model one tensor after another.
- `pread_files()`: transformers maps a safetensors file into memory, and a mapped page once read counts in the
  process's resident memory until the mapping goes, which a weight kept in full precision (the embedding) holds
  for the whole run: a quantized 135M base read that way held its whole 538 MB file. Inside this block the file
  is read with `pread` (safetensors' own backend, transformers' choice on Windows and MPS), so a weight read and
  quantized leaves nothing behind. Canary: tests/unit/test_base_loading.py.
- `gguf_stream(path, skeleton)`: transformers dequantizes a whole GGUF file into one dict of float32 tensors before
  loading any of it (its legacy GGUF path, which Llama takes); here each tensor is dequantized when transformers
  loads it (`from_pretrained(None, state_dict=...)`), by the same steps (gguf's `dequantize`, then the
  architecture's own `TensorProcessor`), for the architectures whose processor turns each GGUF tensor into one
  model tensor of its own. Canary: tests/unit/test_base_loading.py (the same tensors as transformers' read).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from accel_trainer.contract.quantization import (
    BLOCK,
    linear_layers,
    nf4_constructor,
    quantizable,
    quantize_layer,
    scaler_block_size,
)

ONE_TO_ONE = (
    "TensorProcessor", "LlamaTensorProcessor", "BloomTensorProcessor", "T5TensorProcessor", "MambaTensorProcessor",
    "NemotronTensorProcessor", "Gemma2TensorProcessor", "Lfm2TensorProcessor",
)  # fmt: skip
"""transformers' GGUF tensor processors that give each GGUF tensor back under its own name (the others merge
experts or move the output head, which only their whole-file read does)."""


def nf4_while_loading(skeleton: torch.nn.Module) -> Any:
    """transformers' `TorchAoConfig` that quantizes, as it is read, each weight `quantize_base` would quantize in
    the model `skeleton` is (its copy on the meta device)."""
    from torchao.quantization import FqnToConfig
    from transformers import TorchAoConfig

    nf4_constructor()  # torchao installed, or the one-line error
    names = {id(module): name for name, module in skeleton.named_modules()}
    weights = {
        f"{names[id(module)]}.weight": _nf4_config()(scaler_block_size(module.weight.numel() // BLOCK))
        for module in linear_layers(skeleton)
        if module.weight.numel() % BLOCK == 0
    }
    return TorchAoConfig(quant_type=FqnToConfig(weights))


@functools.cache
def _nf4_config() -> type:
    """torchao's configuration of one weight's NF4 form (its scale block), registered with `quantize_`, which
    transformers' torchao quantizer calls on each layer as its weight is read."""
    from dataclasses import dataclass

    from torchao.core.config import AOBaseConfig
    from torchao.quantization.transform_module import register_quantize_module_handler

    @dataclass
    class NF4Weight(AOBaseConfig):  # type: ignore[misc]
        scaler_block_size: int

    @register_quantize_module_handler(NF4Weight)  # type: ignore[misc]
    def _quantize(module: torch.nn.Module, config: NF4Weight) -> torch.nn.Module:
        if quantizable(module.weight):  # type: ignore[arg-type]
            quantize_layer(module)
        return module

    return NF4Weight


@contextlib.contextmanager
def pread_files() -> Iterator[None]:
    """transformers' safetensors files read with `pread` instead of mapped into memory, inside this block."""
    from transformers import modeling_utils

    original = modeling_utils.safe_open
    modeling_utils.safe_open = lambda *args, **kwargs: original(*args, **{**kwargs, "backend": "pread"})  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        modeling_utils.safe_open = original  # type: ignore[assignment,misc]


def gguf_stream(path: str, skeleton: torch.nn.Module) -> dict[str, Any] | None:
    """The tensors of a GGUF file by the names of the model `skeleton` is (its copy on the meta device), each
    dequantized when it is read (`tensor[...]`, as transformers reads a safetensors slice); None for an
    architecture whose tensors are not one-to-one (`ONE_TO_ONE`)."""
    from gguf import GGUFReader
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    reader = GGUFReader(path)
    architecture = gguf_utils.read_field(reader, "general.architecture")[0]
    processor_class = gguf_utils.TENSOR_PROCESSORS.get(architecture, gguf_utils.TensorProcessor)
    if processor_class.__name__ not in ONE_TO_ONE:
        return None
    processor = processor_class(config=_parsed_config(path))
    names = gguf_utils.get_gguf_hf_weights_map(skeleton, processor)
    return {names[tensor.name]: _GgufTensor(tensor, processor) for tensor in reader.tensors if tensor.name in names}


def _parsed_config(path: str) -> dict[str, Any]:
    """The GGUF metadata transformers hands its tensor processor (`load_gguf_checkpoint`'s "config"), read once
    per process."""
    stat = Path(path).stat()
    return dict(_gguf_metadata(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4)
def _gguf_metadata(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return load_gguf_checkpoint(path)["config"]  # type: ignore[no-any-return]


class _GgufTensor:
    """One GGUF tensor, dequantized and processed when it is read, as transformers' whole-file read does it."""

    def __init__(self, tensor: Any, processor: Any) -> None:
        self._tensor, self._processor = tensor, processor

    def __getitem__(self, index: Any) -> torch.Tensor:
        import numpy as np
        from gguf import dequantize

        weights = dequantize(self._tensor.data, self._tensor.tensor_type)
        result = self._processor.process(weights=weights, name=self._tensor.name, parsed_parameters={"tensors": {}})
        if result.name != self._tensor.name:  # ONE_TO_ONE's processors keep names: transformers changed one
            raise RuntimeError(f"transformers' GGUF processor renamed {self._tensor.name} to {result.name}")
        return torch.from_numpy(np.copy(result.weights))[index]
