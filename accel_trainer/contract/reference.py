"""The reference model of preference tuning, in the two forms that need no second machinery.

- A LoRA policy (peft): the reference is the base with the adapter disabled, `peft`'s `disable_adapter()`, as
  TRL's DPOTrainer does: no second copy of anything.
- A full fine-tune: `PolicyAndReference(policy)`, one module holding the policy and a frozen copy of it. Being
  one model, it goes wherever the framework takes a model: FSDP shards both copies' blocks alike (they are of the
  same classes), DDP leaves the frozen copy out of its gradients, checkpoints leave it out and fingerprint it as
  any frozen weights (checkpoint/frozen.py: a resume on another base is refused), and `final/` is the policy
  alone (checkpoint/final_weights.py). Its one forward runs both, so an FSDP root unit is gathered once.

`policy_and_reference(model, **inputs)` returns both outputs for either form, whatever wraps the model (DDP,
FSDP2, torch.compile). The reference runs under `torch.no_grad()` and in eval mode (no dropout).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel

from accel_trainer.errors import RecipeError


class PolicyAndReference(torch.nn.Module):
    """A policy and a frozen copy of it as it is now (its reference), run together by `forward`."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.reference = copy.deepcopy(policy).requires_grad_(False).eval()
        self._no_split_modules = getattr(policy, "_no_split_modules", None)  # FSDP's units: the blocks of both
        self.supports_gradient_checkpointing = getattr(policy, "supports_gradient_checkpointing", False)

    def train(self, mode: bool = True) -> PolicyAndReference:
        """The policy in `mode`, the reference always in eval mode."""
        super().train(mode)
        self.reference.eval()
        return self

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        """The policy's own activation checkpointing (the reference runs without gradients), without its cache."""
        self.policy.gradient_checkpointing_enable(**kwargs)  # type: ignore[operator]
        self.policy.config.use_cache = False  # type: ignore[union-attr]

    def forward(self, **inputs: Any) -> tuple[Any, Any]:
        with torch.no_grad():
            reference = self.reference(**inputs)
        return self.policy(**inputs), reference


def policy_and_reference(model: torch.nn.Module, **inputs: Any) -> tuple[Any, Any]:
    """The outputs of the policy and of its reference on `inputs`: a `PolicyAndReference`'s forward, or a peft
    model's with its adapter and without (under no_grad).

    Raises:
        RecipeError: the model has no reference (neither form).
    """
    inner = extract_model_from_parallel(model)
    if isinstance(inner, PolicyAndReference):
        return model(**inputs)  # type: ignore[no-any-return]
    if getattr(inner, "peft_config", None) and hasattr(inner, "disable_adapter"):
        with torch.no_grad(), inner.disable_adapter():
            reference = model(**inputs)
        return model(**inputs), reference
    raise RecipeError(
        f"{type(inner).__name__} has no reference model: build a LoRA adapter (peft) or wrap the model in"
        " at.PolicyAndReference(model), or precompute the reference's log-probabilities"
    )


def policy_of(model: torch.nn.Module) -> torch.nn.Module:
    """The model a run exports: a `PolicyAndReference`'s policy, else the model itself."""
    return model.policy if isinstance(model, PolicyAndReference) else model  # type: ignore[return-value]
