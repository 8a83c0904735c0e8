"""Frozen weights (a pretrained base under LoRA, a frozen encoder): checkpoints hold what trains, not them.

A parameter the recipe's `build_model` leaves with `requires_grad=False` never changes, and every run of the
recipe gets it back from `build_model` (`from_pretrained` of its base, a seeded init). Writing it into every
checkpoint made a LoRA checkpoint of a small GPT-2 3,548 KB beside its 3,276 KB base. So a checkpoint holds the
trainable parameters, the buffers and the optimizer state, and records the frozen parameters' count, a SHA-256
of their names, dtypes, shapes and contents, and the folder they came from (`base`); a resume, `evaluate` or
`export` rebuilds the model, checks the fingerprint and refuses, in one line, a base that differs.

The fingerprint is taken of the model as `build_model` returns it, before any wrapping or sharding, so it is the
same on every layout.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.state import PartialState
from accelerate.utils import broadcast_object_list

from accel_trainer.checkpoint.files import CheckpointError
from accel_trainer.contract.pretrained import base_source, weights_digest
from accel_trainer.contract.quantization import is_quantized

RECORD_KEY = "frozen"  # train_state.json's entry
_TAKEN: weakref.WeakKeyDictionary[torch.nn.Module, FrozenWeights | None] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class FrozenWeights:
    """The frozen parameters of a freshly built model: their names (as torch's state-dict API names them) and
    fingerprint, and the base they were loaded from, if the model says."""

    names: frozenset[str]
    fingerprint: str
    source: str | None
    numel: int  # how many numbers they hold
    four_bit: int = 0  # how many of them are 4-bit weights (a QLoRA base)

    @classmethod
    def of(cls, model: torch.nn.Module) -> FrozenWeights | None:
        """The frozen weights of `model` (unwrapped, as built), or None when every parameter trains. Taken once
        per model object (evaluate checks the model it built, then prepares it)."""
        if model not in _TAKEN:
            _TAKEN[model] = cls._take(model)
        return _TAKEN[model]

    @classmethod
    def _take(cls, model: torch.nn.Module) -> FrozenWeights | None:
        frozen = {name: p for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        if not frozen:
            return None
        numel = sum(p.numel() for p in dict((id(p), p) for p in frozen.values()).values())
        four_bit = sum(is_quantized(p) for p in frozen.values())
        return cls(frozenset(frozen), weights_digest(frozen), base_source(model), numel, four_bit)

    @classmethod
    def agreed(cls, model: torch.nn.Module) -> FrozenWeights | None:
        """`of(model)` as the main process finds it, given to every process (a collective): only the main process
        is sure to hold the weights (FSDP's RAM-efficient loading builds the others' on the meta device), and a
        base is hashed once per launch."""
        state = PartialState()
        found = [cls.of(model) if state.is_main_process else None]
        if state.num_processes > 1:
            broadcast_object_list(found)
        return found[0]

    def trainable_part(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` (a model state dict) without the frozen parameters."""
        return {name: tensor for name, tensor in state.items() if name not in self.names}

    def record(self) -> dict[str, Any]:
        record = {"parameters": len(self.names), "sha256": self.fingerprint, "base": self.source}
        return {**record, "four_bit_parameters": self.four_bit} if self.four_bit else record


def frozen_count(frozen: FrozenWeights | None) -> int:
    """How many numbers the frozen weights hold (0 without any)."""
    return frozen.numel if frozen is not None else 0


def check_frozen(folder: Path, recorded: dict[str, Any], frozen: FrozenWeights | None) -> None:
    """Refuse to load a checkpoint whose frozen weights are not this model's (a checkpoint that holds every
    weight, written before this format or by a run without frozen weights, loads into any model).

    Raises:
        CheckpointError: the checkpoint leaves out frozen weights that this model does not freeze, or that
            differ from this model's.
    """
    saved = recorded.get(RECORD_KEY)
    if saved is None:
        return
    where = f" (base {saved['base']})" if saved.get("base") else ""
    if frozen is None:
        raise CheckpointError(
            f"checkpoint {folder} holds only the trainable weights of a model with {saved['parameters']} frozen"
            f" parameters{where}, and this run's model freezes none: build the model as that run did"
        )
    if saved.get("four_bit_parameters", 0) != frozen.four_bit:
        said = {True: "in 4 bits (quantize_base=nf4)", False: "in full precision (quantize_base=none)"}
        raise CheckpointError(
            f"checkpoint {folder} was trained on its base{where} {said[bool(saved.get('four_bit_parameters'))]},"
            f" and this run's is {said[bool(frozen.four_bit)]}: set quantize_base as that run did"
        )
    if saved["sha256"] != frozen.fingerprint or saved["parameters"] != len(frozen.names):
        here = f" (base {frozen.source})" if frozen.source else ""
        if where and where == here:  # the same folder: its files changed
            what = f"the frozen weights in base {frozen.source} changed since it was trained:"
        else:
            what = f"it was trained on other frozen weights{where} than this run's model{here}:"
        raise CheckpointError(
            f"checkpoint {folder}: {what} {saved['parameters']} frozen parameters, sha256 {saved['sha256'][:12]},"
            f" here {len(frozen.names)}, {frozen.fingerprint[:12]}; use the base it was trained from"
        )
