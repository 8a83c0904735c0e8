"""A causal LM's loss without the whole vocabulary's logits: the output head and its cross-entropy in chunks of the
tokens that count.

    model = at.with_chunked_loss(model)                        # in build_model (a transformers causal LM)
    return at.lm_loss(model, {"input_ids": ids}, targets)      # in compute_loss: {"loss": sum, "num_items": n}
    losses = at.lm_token_losses(model, inputs, targets)        # each token's loss, 0 where ignored: (batch, length)
(`at.lm_loss` gives a model built without `with_chunked_loss` that forward on first use, in place.)

A plain `model(...).logits` holds (batch, length, vocabulary) scores, and the loss their float32 copy and
log-softmax: for SmolLM2-135M, 8 windows of 128 tokens, about 600 MiB at the step's peak. Here the forward runs the
backbone (`base_model`), drops the positions whose target is ignored before the head, and hands the rest to torch's
`F.linear_cross_entropy`: the head's product and its cross-entropy a chunk of rows at a time, gradients chunk by
chunk, never more than `CHUNK_BYTES` of scores at once; equal to the full computation within 1e-6 (relative;
tests/test_lm_loss.py, on every layout).

It runs inside the model's own forward (a forward that takes `head_loss=`), so whatever wraps the model (DDP,
FSDP2, peft, torch.compile, a `PolicyAndReference`) sees one forward, as for logits. TRL 1.16 computes its SFT loss
the same way (`trl.trainer.utils.add_fused_lm_head`, its own kernel).

Where the scores are not the head's product of the last hidden state, the chunks would compute another loss:
models whose config scales or caps the logits (`final_logit_softcapping`, `logit_scale`, `logits_scaling`, ... the
list TRL keeps), a head that is not a plain `nn.Linear` (a LoRA on it, a quantized one). Those keep the logits of
the counted tokens (`logits_to_keep`); `measure_chunked_loss` checks a model once, and a shipped recipe refuses in
one line a model it finds inexact.
"""

from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel
from torch import nn

from accel_trainer.contract.frozen_in_16_bits import SixteenBitHead, sliced_cross_entropy, sliced_scores
from accel_trainer.errors import RecipeError

CHUNK_BYTES = 32 * 2**20
"""Float32 scores per chunk at most (rows = CHUNK_BYTES / (4 x vocabulary), at least 128): 170 rows of 49,152 words.
On the CPU 128 rows and more run as fast as the full product, 64 and fewer slower (torch's `aspect_ratio`, 8 rows
here, took twice the time)."""
MIN_CHUNK_ROWS = 128
TORCH_CHUNKS = hasattr(torch.nn, "LinearCrossEntropyOptions")
"""torch's chunked `F.linear_cross_entropy` (torch 2.13 has it); an older torch keeps the logits of the counted
tokens alone (`_loss_of_kept_logits`)."""
SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
"""Config fields of architectures whose logits are not the head's product alone (TRL's list, add_fused_lm_head)."""


@dataclass(frozen=True)
class HeadLoss:
    """What a `with_chunked_loss` model's forward computes in place of its logits: the cross-entropy of `targets`
    (aligned with the inputs: targets[:, t] is the token predicted at position t), summed with the count of
    counted tokens, or per token (with `entropy`, a pair: the losses and the entropies)."""

    targets: torch.Tensor
    ignore_index: int = -100
    per_token: bool = False
    entropy: bool = False  # per token: also each position's entropy of the head's distribution, without gradients


def with_chunked_loss(model: nn.Module) -> nn.Module:
    """`model` (a transformers causal LM, before any wrapper; peft's or `PolicyAndReference`'s are looked into),
    its forward taking `head_loss=HeadLoss(...)`; without it the forward is the model's own. In place; idempotent.
    Raises RecipeError where `model` holds no transformers causal LM."""
    _with_forward(model)
    return model


def lm_loss(
    model: nn.Module, inputs: dict[str, Any] | torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> Any:
    """The summed cross-entropy of `targets` and their count, `{"loss": sum, "num_items": n}`, the form the loop
    makes exact over the whole step (as `at.token_cross_entropy` of the logits), from `model(**inputs)` (a tensor
    of token ids is `{"input_ids": inputs}`). Raises RecipeError where `model` holds no transformers causal LM."""
    _with_forward(model)
    return model(**_keywords(inputs), head_loss=HeadLoss(targets, ignore_index))


def lm_token_losses(
    model: nn.Module, inputs: dict[str, Any] | torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Each position's cross-entropy of its target in float32, 0 where the target is `ignore_index`, shaped as
    `targets`: per-sequence sums (preference tuning's log-probabilities, evaluation's per-sequence losses).
    Raises RecipeError where `model` holds no transformers causal LM."""
    _with_forward(model)
    return model(**_keywords(inputs), head_loss=HeadLoss(targets, ignore_index, per_token=True))  # type: ignore[no-any-return]


def lm_token_losses_and_entropies(
    model: nn.Module, inputs: dict[str, Any] | torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lm_token_losses` and each counted position's entropy of the model's next-token distribution (nats, float32,
    0 elsewhere, no gradients: a figure to log, as TRL's GRPO logs `entropy`) from one forward, the head's scores
    for the entropies a chunk at a time too. Raises RecipeError where `model` holds no transformers causal LM."""
    _with_forward(model)
    return model(**_keywords(inputs), head_loss=HeadLoss(targets, ignore_index, True, entropy=True))  # type: ignore[no-any-return]


def causal_lms(model: nn.Module) -> list[nn.Module]:
    """The transformers causal LMs in `model`: itself, or those inside a wrapper (DDP, compile, peft, a policy and
    its reference). transformers is imported wherever such a model exists."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return []
    return [
        module
        for module in extract_model_from_parallel(model).modules()
        if isinstance(module, transformers.PreTrainedModel)
        and module.base_model is not module
        and module.get_output_embeddings() is not None
    ]


def head_cross_entropy(hidden: torch.Tensor, head: nn.Linear, loss: HeadLoss) -> Any:
    """The loss `loss` asks for from the last hidden states (batch, length, width) through `head`, in chunks of
    the counted positions (all positions of a meta or fake tensor, whose values are unknown)."""
    targets = loss.targets.to(hidden.device)
    counted = targets != loss.ignore_index
    shapes_only = hidden.is_meta or _is_fake(hidden)
    rows, labels = (hidden.flatten(0, -2), targets.flatten()) if shapes_only else (hidden[counted], targets[counted])
    weight: torch.Tensor = head.weight
    bias: torch.Tensor | None = head.bias
    device_type = hidden.device.type if hidden.device.type in ("cuda", "cpu", "xpu") else "cpu"
    autocast = torch.is_autocast_enabled(device_type)
    sliced = type(head) is SixteenBitHead and not autocast and not shapes_only  # never its weight in float32 at once
    if autocast:  # the head's product of the autocast dtype's values, as nn.Linear's is; the scores in float32
        rows, weight, bias = _in_autocast_dtype(torch.get_autocast_dtype(device_type), rows, weight, bias)
    # The FLOP count (meta) takes the plain product and its cross-entropy: its FLOPs are the chunks' FLOPs.
    accumulate_in = torch.float32 if rows.dtype in (torch.bfloat16, torch.float16) else None
    options = None if hidden.is_meta else _options(weight.shape[0], accumulate_in)
    with torch.autocast(device_type, enabled=False):
        losses = sliced_cross_entropy(rows, head, labels) if sliced else F.linear_cross_entropy(
            rows, weight, labels, linear_bias=bias, reduction="none" if loss.per_token else "sum",
            ignore_index=loss.ignore_index, options=options,
        )  # fmt: skip
        if loss.entropy:
            rows_per_chunk = max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * weight.shape[0])) // 4  # a logged figure
            scores = functools.partial(sliced_scores if sliced else F.linear, weight=weight, bias=bias)
            entropies = torch.cat([_entropy(scores(chunk)) for chunk in rows.detach().split(rows_per_chunk)])
            return _reduced(losses, loss, counted, shapes_only), _reduced(entropies, loss, counted, shapes_only)
    return _reduced(losses, loss, counted, shapes_only)


def _in_autocast_dtype(dtype: torch.dtype, *tensors: torch.Tensor | None) -> list[Any]:
    """`tensors` rounded to the autocast dtype, and off CUDA back to float32: torch's chunks of 16-bit inputs return
    16-bit losses (a summed bf16 loss 0.35% off), and off CUDA cast the inputs to float32 anyway (on CUDA it
    multiplies them with float32 accumulation), so there the same products come with float32 losses. Canary:
    tests/test_lm_loss.py."""
    rounded = [tensor.to(dtype) if tensor is not None else None for tensor in tensors]
    if tensors[0] is not None and tensors[0].device.type == "cuda":
        return rounded
    return [tensor.float() if tensor is not None else None for tensor in rounded]


def measure_chunked_loss(model: nn.Module) -> bool | None:
    """Whether a `head_loss=` forward computes `model`'s own loss: each token's loss of a row of 6 tokens equals the
    cross-entropy of the model's own logits (eval mode, no gradient, the random state and modes left as they were).
    None where nothing can be measured (weights on meta or fake: the FLOP count's copy, `estimate`)."""
    from torch._subclasses.fake_tensor import is_fake

    parameters = list(model.parameters())
    if not parameters or any(p.is_meta or is_fake(p) for p in parameters):
        return None
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for lm in causal_lms(model):
                vocabulary = lm.get_input_embeddings().weight.shape[0]  # type: ignore[operator,union-attr]
                ids = torch.tensor([[5, 9, 3, 7, 11, 4]], device=parameters[0].device) % vocabulary
                targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
                logits = type(lm).forward(lm, input_ids=ids, use_cache=False).logits.float()
                own = F.cross_entropy(logits[0], targets[0], reduction="none")
                chunked = _loss_forward(lm, (), {"input_ids": ids}, HeadLoss(targets, per_token=True))[0]
                if not torch.allclose(chunked, own, rtol=1e-5, atol=1e-5):
                    return False
    finally:
        for module, training in modes.items():
            module.training = training
    return True


def _forward_taking_head_loss(cls: type[nn.Module]) -> Any:
    """`cls`'s forward, which also takes `head_loss=`: made per class, with its signature (generate() reads it)."""

    @functools.wraps(cls.forward)
    def forward(self: nn.Module, *args: Any, head_loss: HeadLoss | None = None, **kwargs: Any) -> Any:
        if head_loss is None:
            return type(self).forward(self, *args, **kwargs)
        return _loss_forward(self, args, kwargs, head_loss)

    forward.takes_head_loss = True  # type: ignore[attr-defined]
    return forward


def _loss_forward(lm: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss: HeadLoss) -> Any:
    """The backbone and the head's loss in chunks (`head_cross_entropy`), or the head's logits of the counted tokens
    where the chunks would not be exact (`_scales_logits`, a head that is not a plain linear layer)."""
    if kwargs.pop("labels", None) is not None:
        raise RecipeError("a forward with head_loss= computes the loss itself: give it no labels")
    kwargs.setdefault("use_cache", False)
    head = _head_of(lm)
    if head is None or _scales_logits(lm) or not TORCH_CHUNKS:
        return _loss_of_kept_logits(lm, args, kwargs, loss)
    hidden = lm.base_model(*args, **kwargs).last_hidden_state  # type: ignore[operator]
    return head_cross_entropy(hidden, head, loss)


def _loss_of_kept_logits(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss: HeadLoss) -> Any:
    """The model's own logits, of the counted positions only (transformers' boolean `logits_to_keep`), and their
    cross-entropy in float32: exact for any head, the vocabulary's scores of the counted tokens held once."""
    targets = loss.targets
    counted = targets != loss.ignore_index
    if targets.is_meta or _is_fake(targets):  # values unknown: every position's logits
        logits = type(model).forward(model, *args, **kwargs).logits.flatten(0, -2)
        every_position = True
        losses = F.cross_entropy(logits.float(), targets.flatten(), reduction="none")
    else:
        logits = type(model).forward(model, *args, logits_to_keep=counted, **kwargs).logits
        every_position = False
        losses = F.cross_entropy(logits.float(), targets[counted], reduction="none")
    reduced = _reduced(losses, loss, counted, every_position)
    return (reduced, _reduced(_entropy(logits), loss, counted, every_position)) if loss.entropy else reduced


def _entropy(scores: torch.Tensor) -> torch.Tensor:
    """Each row's softmax entropy (nats, float32, no gradients) as logsumexp(z) - sum(p z), p made in place."""
    with torch.no_grad():
        scores = scores.float()
        normaliser = scores.logsumexp(dim=-1, keepdim=True)
        probabilities = (scores - normaliser).exp_()
        return normaliser.squeeze(-1) - probabilities.mul_(scores).sum(dim=-1)


def _reduced(losses: torch.Tensor, loss: HeadLoss, counted: torch.Tensor, every_position: bool) -> Any:
    """The counted positions' losses as `loss` asks: summed with their count, or in place, 0 elsewhere."""
    losses = losses.float()
    if not loss.per_token:
        return {"loss": losses.sum(), "num_items": counted.sum()}
    if every_position:
        return losses.view(counted.shape) * counted
    return torch.zeros(counted.shape, dtype=losses.dtype, device=losses.device).masked_scatter(counted, losses)


def _head_of(lm: nn.Module) -> nn.Linear | None:
    """The model's output head where it is a plain linear layer (not a LoRA of it, not a quantized one). `estimate`'s
    fake weights are FakeTensors, not Parameters: planned as the real head runs."""
    head = lm.get_output_embeddings()  # type: ignore[operator]
    if type(head) not in (nn.Linear, SixteenBitHead) or not (
        type(head.weight) is nn.Parameter or _is_fake(head.weight)
    ):
        return None
    return head


def _scales_logits(lm: nn.Module) -> bool:
    config: Any = getattr(lm, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(getattr(text, name, None) not in (None, 1, 1.0) for name in SCALED_LOGITS)


def _options(vocabulary: int, accumulate_in: torch.dtype | None) -> torch.nn.LinearCrossEntropyOptions:
    rows = max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * vocabulary))
    return torch.nn.LinearCrossEntropyOptions(batch_chunk_size=rows, chunking_method=None, acc_dtype=accumulate_in)


def _is_patched(lm: nn.Module) -> bool:
    return getattr(getattr(lm.__dict__.get("forward"), "__func__", None), "takes_head_loss", False)


def _keywords(inputs: dict[str, Any] | torch.Tensor) -> dict[str, Any]:
    return {"input_ids": inputs} if isinstance(inputs, torch.Tensor) else inputs


def _with_forward(model: nn.Module) -> None:
    """Every causal LM in `model` given the forward taking `head_loss` (through DDP's or compile's wrapper, whose
    call looks the inner module's forward up at each call)."""
    lms = causal_lms(model)
    if not lms:
        raise RecipeError(
            f"at.lm_loss: {type(model).__name__} holds no transformers causal LM (a model with an output head and a"
            " base_model): compute the loss from its logits with at.token_cross_entropy"
        )
    for lm in lms:
        if not _is_patched(lm):
            lm.forward = types.MethodType(_forward_taking_head_loss(type(lm)), lm)  # type: ignore[method-assign]


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(tensor))
