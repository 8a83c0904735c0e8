"""What a checkpoint is made of and who wrote it: the prepared objects whose state it holds (`Trained`) and the
run's identity it records and checks on resume (`RunIdentity`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from accel_trainer.checkpoint.frozen import FrozenWeights
from accel_trainer.checkpoint.generations import Generations
from accel_trainer.checkpoint.pipeline_state import whole_model_state
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import TrainConfig
from accel_trainer.optim.ema import WeightAverage
from accel_trainer.optim.optimizers import Optimizers
from accel_trainer.parallel.sharding import tied_names


@dataclass(frozen=True)
class Trained:
    """The prepared objects whose state a checkpoint holds."""

    model: torch.nn.Module
    optimizers: Optimizers  # each with its schedule
    whole: torch.nn.Module | None = None  # on a pipeline layout, the model whose stages `model` holds a part of
    ema: WeightAverage | None = None  # the EMA of the weights, with ema_decay
    frozen: FrozenWeights | None = None  # the parameters build_model froze, which checkpoints leave out
    tokenizer: str | None = None  # the fingerprint of the recipe's tokenizer (checkpoint/tokenizer.py)
    generations: Generations | None = None  # a rollout recipe's micro-batches, kept between the steps they feed

    def shapes_and_ties(self, model_state: dict[str, Any]) -> tuple[dict[str, Any], list[list[str]]]:
        """The state whose shapes a checkpoint records and checks, and the groups of tied names: the whole
        model's on a pipeline layout (each process's own state holds only its stages)."""
        return (model_state, tied_names(model_state)) if self.whole is None else whole_model_state(self.whole)


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint records about the run that wrote it, and checks on resume."""

    recipe_name: str
    cfg: TrainConfig
    layout: LayoutSettings
    recipe_file: str | None = None  # the file defining the recipe, for `evaluate` from another folder
    micro_batch_size_given: bool = True  # False: cfg's is the recipe's default, which follows the layout
