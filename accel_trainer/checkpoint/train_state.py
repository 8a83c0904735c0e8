"""The progress of a run that a checkpoint carries, typed.

Saved in each checkpoint's `train_state.json` (beside the format, recipe, config and shapes that
checkpoint/save.py records) and read back on resume. The RNG states are per process and live in their own files
(`rng_rank<r>.safetensors`); the data position of a map-style set is derived from `step`, a stream's is
`data_position`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    """Where a run is: what a resume needs beyond the weights, optimizer, schedule and RNG states."""

    step: int = 0
    """Optimizer steps taken (skipped fp16 steps included: they consumed their data)."""
    epoch: int = 0
    """Epochs started, counting from 1 once training began (0 before the first step)."""
    samples_seen: int = 0
    """Training samples consumed, over all processes."""
    items_seen: float = 0.0
    """Loss items (tokens for a token loss, samples otherwise) of the steps taken, over all processes (a step
    skipped as non-finite is not counted)."""
    data_position: list[int] | dict[str, Any] | None = None
    """A stream's position (data/streams.py; each process's when it is split: data/stream_split.py); None for a
    map-style set, whose position follows from `step`."""
    skipped_steps: int = 0
    """Optimizer steps the fp16 gradient scaler skipped (inf/NaN gradients)."""
    nonfinite_steps: int = 0
    """Steps skipped because their loss or gradient norm was NaN or Inf (stopping/nonfinite.py)."""
    nonfinite_in_a_row: int = 0
    """The latest of those in a row, up to this step (0: this step was finite)."""
    best_metric: float | None = None
    """The best value of `keep_best_metric` so far."""
    best_checkpoint: str | None = None
    """The folder name of the checkpoint that holds it."""
    early_stop_best: float | None = None
    """The best value of `early_stop_metric` so far, and the step of that evaluation."""
    early_stop_best_step: int = 0
    early_stop_waited: int = 0
    """Evaluations since the best without an improvement of more than early_stop_min_delta."""
    stopped_early: bool = False
    """The run ended on early stopping: resume=auto has nothing left to train."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The latest training record and evaluation: what a finished run reports."""
    tracker_ids: dict[str, str] = field(default_factory=dict)
    """Run ids of the experiment trackers that can reopen a run on resume (W&B, MLflow)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> TrainState:
        """The state saved in a checkpoint; keys it lacks (an older checkpoint) keep their defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in saved.items() if key in names})
