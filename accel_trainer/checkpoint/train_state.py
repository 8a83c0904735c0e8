"""What a checkpoint carries beyond the tensors: the states the checkpointer is given when it is built.

Each part of a run that must survive a resume owns its state and registers it with the `Checkpointer` once
(as torchtitan's checkpointer takes its `states`): the progress (`TrainState`, below), the non-finite guard's
counts, early stopping's best, the items seen, the data position. At every save the checkpointer asks each for
its `state_dict()` (on every process: a stream's position and the items still on the device are collectives),
and writes them as one flat `train_state.json` beside the format, recipe, config and shapes that
checkpoint/save.py records; each owner's keys are its own. On resume each owner loads its keys in place
(`load_state_dict`); keys an older checkpoint lacks keep their defaults. The RNG states are per process and live
in their own files (`rng_rank<r>.safetensors`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol


class Stateful(Protocol):
    """A state the checkpointer saves and restores: its keys in train_state.json, read and loaded in place."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, saved: dict[str, Any]) -> None: ...


class SavedFields:
    """A dataclass whose fields are its saved state, each under its own name."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for name in (f.name for f in dataclasses.fields(self)):  # type: ignore[arg-type]
            if name in saved:
                setattr(self, name, copy.deepcopy(saved[name]))


@dataclass
class TrainState(SavedFields):
    """How far a run is: written by the step (its counts) and the observer (the latest records)."""

    step: int = 0
    """Optimizer steps taken (skipped fp16 steps included: they consumed their data)."""
    epoch: int = 0
    """Epochs started, counting from 1 once training began (0 before the first step)."""
    samples_seen: int = 0
    """Training samples consumed, over all processes."""
    skipped_steps: int = 0
    """Optimizer steps the fp16 gradient scaler skipped (inf/NaN gradients)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The latest training record and evaluation: what a finished run reports."""
    tracker_ids: dict[str, str] = field(default_factory=dict)
    """Run ids of the experiment trackers that can reopen a run on resume (W&B, MLflow)."""


def saved_states(states: tuple[Stateful, ...]) -> dict[str, Any]:
    """The registered states as train_state.json holds them: one flat dict, in registration order."""
    recorded: dict[str, Any] = {}
    for state in states:
        recorded.update(state.state_dict())
    return recorded
