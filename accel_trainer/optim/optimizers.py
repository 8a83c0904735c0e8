"""The run's optimizers: one (the default), or several, each with its own parameters, learning rates and
schedule, stepped together or in alternating phases.

A recipe's `build_optimizer` returns one torch optimizer, or a mapping of names to optimizers over disjoint
parameter sets (a GAN's):

    def build_optimizer(self, cfg, model):
        return {"discriminator": Adam(model.discriminator.parameters(), lr=2e-4),
                "generator": Adam(model.generator.parameters(), lr=2e-4)}

With the class attribute `alternate_optimizers = True`, each training step is one phase per optimizer, in the
mapping's order: the loop drops every gradient, runs the step's micro-batches (the same ones in every phase)
through `compute_loss(model, batch, phase=name)`, back-propagates, clips and steps that optimizer alone, so
no phase's gradients reach another's step. Without it, one loss's gradients step every optimizer together
(parameters that need different optimizer classes). `build_scheduler(cfg, optimizer)` is called for each
optimizer; every optimizer and schedule is checkpointed and restored.

Alternating phases log `<name>/loss` and `<name>/<term>` for each phase, `loss` being their sum, and
`lr/<name>` and `grad_norm/<name>`. They run on 1 process, DDP and FSDP; DDP gets find_unused_parameters,
since a phase may leave the other's parameters out of its graph (a detached fake). Pipeline,
tensor-parallel, HSDP and context-parallel layouts, micro_batch_size=auto and a phase loss with num_items
are refused in one line: none of them knows phases yet. The non-finite guard checks each phase: a non-finite
phase is not stepped, and the step counts as non-finite.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from accel_trainer.contract.losses import FRAMEWORK_KEYS
from accel_trainer.errors import ConfigError, RecipeError
from accel_trainer.parallel.verbs import StepVerbs


@dataclass(frozen=True)
class Phase:
    """One optimizer of the run with its schedule and step verbs; `name` is None for a single optimizer."""

    name: str | None
    optimizer: Any  # accelerate's AcceleratedOptimizer once prepared
    scheduler: Any
    verbs: StepVerbs | None = None

    def lrs(self) -> dict[str, float]:
        """Its groups' LRs by log key: lr, lr/1, ... for a single optimizer; lr/<name>, lr/<name>/1, ... else."""
        base = "lr" if self.name is None else f"lr/{self.name}"
        return {base if i == 0 else f"{base}/{i}": group["lr"] for i, group in enumerate(self.optimizer.param_groups)}


@dataclass(frozen=True)
class Optimizers:
    """The run's phases: one, or one per optimizer; `alternate` when each has its own forward and backward."""

    phases: tuple[Phase, ...]
    alternate: bool = False

    @property
    def several(self) -> bool:
        return self.phases[0].name is not None

    def torch_optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The torch optimizers, for torch.distributed.checkpoint (which takes several and splits them back)."""
        return tuple(getattr(phase.optimizer, "optimizer", phase.optimizer) for phase in self.phases)

    def scheduler_states(self) -> dict[str, Any]:
        """What a checkpoint stores of the schedules: `scheduler` alone, `schedulers` by name for several."""
        if not self.several:
            return {"scheduler": self.phases[0].scheduler.state_dict()}
        return {"schedulers": {phase.name: phase.scheduler.state_dict() for phase in self.phases}}

    def load_scheduler_states(self, stored: dict[str, Any]) -> None:
        """Restore the schedules `scheduler_states` stored (a KeyError when the checkpoint has another set)."""
        if not self.several:
            self.phases[0].scheduler.load_state_dict(stored["scheduler"])
            _lr_of_the_next_step(self.phases[0].scheduler)
            return
        schedules = stored.get("schedulers") or {}
        for phase in self.phases:
            if phase.name not in schedules:
                raise KeyError(f"no schedule for optimizer {phase.name!r} (it has: {', '.join(schedules) or 'one'})")
            phase.scheduler.load_state_dict(schedules[phase.name])
            _lr_of_the_next_step(phase.scheduler)

    def current_lrs(self) -> dict[str, float]:
        """Every group's LR of every optimizer, by log key; `lr` is always there (the first group's)."""
        lrs = {key: lr for phase in self.phases for key, lr in phase.lrs().items()}
        return {"lr": next(iter(lrs.values())), **lrs}

    def with_verbs(self, make_verbs: Any, prepared: list[Any], model: torch.nn.Module) -> Optimizers:
        """The same phases holding their prepared optimizers and step verbs (`make_verbs(optimizer, parameters)`):
        an alternating phase clips and measures its own optimizer's parameters, anything else every parameter."""
        phases = []
        for phase, optimizer in zip(self.phases, prepared, strict=True):
            verbs = make_verbs(optimizer, _parameters(optimizer, model, self.alternate))
            phases.append(Phase(phase.name, optimizer, phase.scheduler, verbs))
        return Optimizers(tuple(phases), self.alternate)


def read_optimizers(built: Any, recipe: Any, model: torch.nn.Module, build_schedule: Any) -> Optimizers:
    """Check what `build_optimizer` returned and pair each optimizer with its schedule (`build_schedule(opt)`).

    Raises:
        RecipeError: not an optimizer or a non-empty mapping of names to optimizers; two optimizers sharing a
            parameter; several optimizers stepped in alternation from a single one, or the other way round.
    """
    alternate = bool(getattr(recipe, "alternate_optimizers", False))
    if isinstance(built, torch.optim.Optimizer):
        if alternate:
            raise RecipeError(
                "alternate_optimizers=True needs build_optimizer to return several optimizers by name, e.g."
                " {'discriminator': ..., 'generator': ...}"
            )
        return Optimizers((Phase(None, built, build_schedule(built)),))
    if not isinstance(built, Mapping) or not built:
        raise RecipeError(
            f"build_optimizer returned {type(built).__name__}; return a torch.optim.Optimizer, or several by name"
            " ({'discriminator': Adam(...), 'generator': Adam(...)})"
        )
    for name, optimizer in built.items():
        _check_name(name)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise RecipeError(f"build_optimizer's {name!r} is a {type(optimizer).__name__}, not a torch optimizer")
    _check_disjoint(built, model)
    return Optimizers(tuple(Phase(name, opt, build_schedule(opt)) for name, opt in built.items()), alternate)


def check_layout_for_several(several: bool, cfg: Any, uses_mesh: bool) -> None:
    """Refuse, in one line, what several optimizers cannot run with yet (see the module doc); `uses_mesh`: the
    layout has a pipeline, tensor-parallel, HSDP or context-parallel dimension. Checked before any work for a
    recipe that alternates (a class attribute), and once `build_optimizer` has returned for the others."""
    if not several:
        return
    refused = {
        "a pipeline, tensor-parallel, HSDP or context-parallel layout": uses_mesh,
        "micro_batch_size=auto (set it)": cfg.micro_batch_size == "auto",
    }
    for what, applies in refused.items():
        if applies:
            raise ConfigError(
                f"several optimizers cannot run with {what} yet: use 1 process, DDP or FSDP, or one optimizer"
            )


def _parameters(optimizer: Any, model: torch.nn.Module, own: bool) -> list[torch.Tensor]:
    if not own:
        return list(model.parameters())
    return [parameter for group in optimizer.param_groups for parameter in group["params"]]


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name or "/" in name or name in FRAMEWORK_KEYS or name.startswith("eval"):
        raise RecipeError(
            f"build_optimizer named an optimizer {name!r}: use a plain name such as 'generator' (no '/', not a"
            " logged key)"
        )


def _check_disjoint(built: Mapping[str, torch.optim.Optimizer], model: torch.nn.Module) -> None:
    owner: dict[int, str] = {}
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    for name, optimizer in built.items():
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if id(parameter) in owner and owner[id(parameter)] != name:
                    raise RecipeError(
                        f"optimizers {owner[id(parameter)]!r} and {name!r} both hold parameter"
                        f" {names.get(id(parameter), '?')}: give each parameter to one optimizer"
                    )
                owner[id(parameter)] = name


def _lr_of_the_next_step(scheduler: Any) -> None:
    """Each group's LR for the step after the restored one, from a `LambdaLR`'s own function (the built-in schedule's).

    The optimizer's state restores each group's LR as the checkpoint's schedule left it, and torch's scheduler sets
    a new one only after the next step: a run extended to a larger max_steps trained its first step at the old
    schedule's end (0 under cosine decay), then jumped to the new schedule. Unchanged, the value is the same float.
    """
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    step, pairs = scheduler.last_epoch, zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    lrs = [base * schedule(step) for base, schedule in pairs]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() answers, and the run logs
