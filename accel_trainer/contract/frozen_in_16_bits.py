"""QLoRA's frozen embedding and output head held in bfloat16: `hold_in_16_bits`, called by `quantize_base`.

A QLoRA base quantizes its linear layers to 4 bits; transformers with bitsandbytes, torchtune and Unsloth hold what
stays unquantized (the embedding, the output head) in 16 bits. Here those stayed float32: SmolLM2-135M's tied
49,152 x 576 embedding and head, 113 MiB, the largest part of a 4-bit base (its 210 quantized weights hold 52 MiB).
In bfloat16 they hold 57 MiB, frozen as the 4-bit weights are, and the computation stays float32:

- the embedding's output is cast to float32 (a forward hook): the hidden states are float32 values of bf16-rounded
  embeddings;
- the head is a `SixteenBitHead`: its scores are float32 products of its bf16 values, the weight cast a slice of
  the vocabulary at a time, in the forward and again in the backward (`sliced_scores`), never whole: torch's
  chunked `F.linear_cross_entropy` casts the whole weight to float32 for the call off CUDA, 113 MiB at the moment
  of QLoRA's peak (held in bf16 with torch's loss, the run below peaked higher: 908 MiB against 871);
- its loss (`sliced_cross_entropy`, from contract/lm_loss.py) is each row's logsumexp minus its target's score, a
  chunk of rows at a time under activation checkpointing (the backward recomputes a chunk's scores rather than
  keeping them), equal to the float32 computation of the same values within 1e-6 (tests/unit/test_frozen_in_16_bits.py).

SmolLM2-135M, sft_chat with LoRA r=8, micro-batch 2, activation checkpointing, on tcmalloc (docs/memory.md): QLoRA's
whole process peaked at 860 MiB with them in float32, 804 MiB now, against LoRA's 1,197 (0.72x -> 0.67x); steps
as fast. final/ keeps the embedding in its bf16 values, with the config's float32 (`from_pretrained` loads it so:
the values are exact in float32); `quantization.dequantize` gives the weights their float32 back.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

SIXTEEN_BITS = torch.bfloat16
HELD_FROM = "_accel_trainer_held_from"
"""The attribute of a module whose weight is held in 16 bits: the dtype the weight was in, and its computation is
(on the module, not the parameter: FSDP2 replaces the parameters by sharded ones, and keeps the module's own)."""
VOCABULARY_SLICE = 4096
"""Rows of the head cast to float32 at once: 9 MiB of a 576-wide head."""
ROW_CHUNK = 32
"""Rows whose scores are held at once in the loss: 6 MiB of float32 scores of 49,152 words. With 64 rows and slices
of 8,192 the QLoRA run below peaked at 841 MiB, with these at 804 (its set-up alone: 790)."""


class SixteenBitHead(nn.Linear):
    """An output head whose frozen weight is held in 16 bits and whose scores are float32 (`sliced_scores`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sliced_scores(x, self.weight, self.bias)


def hold_in_16_bits(embedding: Any, head: Any) -> None:
    """Hold a float32 `embedding` and `head` (tied or not; either may be None) in bfloat16, in place, frozen, their
    computation kept in float32. Weights on the meta device, or not in float32, stay as they are."""
    modules = [m for m in (embedding, head) if m is not None and _float32_values(m.weight)]
    for weight in {id(m.weight): m.weight for m in modules}.values():  # a tied weight is cast once
        weight.data = weight.data.to(SIXTEEN_BITS)
    _computing_in_float32(embedding if embedding in modules else None, head if head in modules else None)


def held_again(model: nn.Module, names: Any) -> None:
    """`model`'s embedding and head computing in float32 again where `names` (of `held_in_16_bits`) says the model
    that trained held them in 16 bits and `model` was handed those 16 bits (final/'s copy: `model_holding`)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
    ours = {id(module): name for name, module in model.named_modules()}
    held = [m if m is not None and f"{ours.get(id(m), '')}.weight" in names else None for m in (embedding, head)]
    _computing_in_float32(*(m if m is not None and m.weight.dtype == SIXTEEN_BITS else None for m in held))


def _computing_in_float32(embedding: Any, head: Any) -> None:
    for module in (m for m in (embedding, head) if m is not None):
        module.weight.requires_grad_(False)
        setattr(module, HELD_FROM, torch.float32)
    if embedding is not None:
        embedding.register_forward_hook(_in_float32)
    if head is not None and type(head) is nn.Linear:
        head.__class__ = SixteenBitHead


def held_in_16_bits(model: nn.Module) -> dict[str, torch.dtype]:
    """The names of `model`'s parameters held in 16 bits (`hold_in_16_bits`), with the dtype they were in."""
    return {
        f"{name}.weight" if name else "weight": getattr(module, HELD_FROM)
        for name, module in model.named_modules(remove_duplicate=False)
        if hasattr(module, HELD_FROM)
    }


def computation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype `model` computes in: transformers' `model.dtype` is its first parameter's, the embedding's, which
    may be held in 16 bits while the model computes in float32."""
    held = held_in_16_bits(model)
    if held:
        return next(iter(held.values()))
    return getattr(model, "dtype", None) or next(p.dtype for p in model.parameters() if p.is_floating_point())


def restore_dtype(model: nn.Module) -> None:
    """Undo `hold_in_16_bits` in place: the held weights in their own dtype again (exact), the head a plain
    `nn.Linear`, the embedding's output as it comes."""
    for module in model.modules():
        held_from = module.__dict__.pop(HELD_FROM, None)
        if held_from is not None and module.weight.dtype != held_from:  # a tied weight is cast once
            module.weight.data = module.weight.data.to(held_from)
        if type(module) is SixteenBitHead:
            module.__class__ = nn.Linear  # type: ignore[assignment]


def sliced_scores(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`rows @ weight.T + bias` in float32 for a frozen 16-bit `weight`, cast a slice of the vocabulary at a time,
    in the forward and again in the backward (`_SlicedScores`): autograd through `F.linear` would keep each slice's
    float32 cast for the backward, the whole weight in float32 again."""
    return _SlicedScores.apply(rows, weight, bias)  # type: ignore[no-any-return]


class _SlicedScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        biases = itertools.repeat(None) if bias is None else bias.float().split(VOCABULARY_SLICE)
        slices = zip(weight.split(VOCABULARY_SLICE), biases, strict=False)
        return torch.cat([F.linear(rows.float(), w.float(), b) for w, b in slices], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        grad_rows = grad.new_zeros(*grad.shape[:-1], weight.shape[1])
        for w, g in zip(weight.split(VOCABULARY_SLICE), grad.split(VOCABULARY_SLICE, dim=-1), strict=True):
            grad_rows.add_(g @ w.float())
        return grad_rows, None, None  # the weight and bias are frozen


def sliced_cross_entropy(rows: torch.Tensor, head: nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    """Each row's cross-entropy of its label (all counted) through a 16-bit `head`, float32, a chunk of rows at a
    time, each chunk's scores recomputed in the backward rather than kept."""
    return torch.cat(
        [
            checkpoint(_row_losses, chunk, head.weight, head.bias, chunk_labels, use_reentrant=False)
            for chunk, chunk_labels in zip(rows.split(ROW_CHUNK), labels.split(ROW_CHUNK), strict=True)
        ]
    )


def _row_losses(rows: torch.Tensor, weight: torch.Tensor, bias: Any, labels: torch.Tensor) -> torch.Tensor:
    scores = sliced_scores(rows, weight, bias)
    return scores.logsumexp(dim=-1) - scores.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _float32_values(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and not weight.is_meta


def _in_float32(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return output.to(getattr(module, HELD_FROM, output.dtype))
