"""The run's model, data and optimizers, built for its layout in the order that keeps every layout on one
trajectory: the batch plan (checked before any work), the recipe's model and sets, its optimizers and loaders,
all through `accelerator.prepare` (engine/preparation.py puts them together into the run's parts).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import replace
from typing import Any

from accelerate import Accelerator

from accel_trainer.checkpoint.frozen import FrozenWeights
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import TrainConfig
from accel_trainer.contract.optimizers import MUON_SHARDED
from accel_trainer.data import loaders
from accel_trainer.data.auto_batch import check_auto_layout, choose_micro_batch_size
from accel_trainer.data.batching import BatchPlan, plan_batches, planned_micro_batch_size
from accel_trainer.data.run_data import RunData, build_loaders
from accel_trainer.engine.hf_loss import ModelItems, model_items
from accel_trainer.errors import ConfigError
from accel_trainer.observe.header import model_summary
from accel_trainer.optim.optimizers import Optimizers, check_layout_for_several, read_optimizers
from accel_trainer.optim.schedules import recipe_scheduler
from accel_trainer.parallel import fsdp_loading
from accel_trainer.parallel.accelerator import prepare_for_training
from accel_trainer.parallel.mesh import DataRanks, mesh_shape
from accel_trainer.parallel.pipeline.build import build_pipeline
from accel_trainer.parallel.pipeline.stages import Pipeline
from accel_trainer.parallel.verbs import StepVerbs
from accel_trainer.parallel.wrapping import split_and_wrap
from accel_trainer.recipe import Recipe


def prepared_for_layout(
    recipe: Recipe,
    cfg: TrainConfig,
    layout: LayoutSettings,
    accelerator: Accelerator,
    ranks: DataRanks,
    plan: BatchPlan,
    model: Any,
    train_set: Any,
    eval_set: Any,
) -> tuple[Any, Optimizers, Pipeline | None, RunData]:
    """The model (or this process's pipeline stages), optimizers and loaders through `accelerator.prepare`."""
    pipeline = None
    if layout.pp_size > 1:  # the stages of this process; the optimizer and checkpoints see only their weights
        first_examples = functools.partial(loaders.first_examples, train_set, plan.micro_batch_size)
        stages = model.to(accelerator.device)
        pipeline = build_pipeline(recipe, stages, first_examples, plan.accumulation_steps, layout, accelerator)
        model = pipeline.view
    optimizers = _optimizers(recipe, cfg, model, accelerator, layout)  # their schedules are not prepared
    train_loader, eval_loader = build_loaders(recipe, cfg, train_set, eval_set, plan, ranks, accelerator)
    model, *prepared, train_loader, eval_loader = prepare_for_training(
        accelerator, pipeline, ranks, model, *(p.optimizer for p in optimizers.phases), train_loader, eval_loader
    )
    optimizers = optimizers.with_verbs(functools.partial(StepVerbs, accelerator), prepared, model)
    run_data = RunData(
        collate=recipe.collate,
        plan=plan,
        ranks=ranks,
        train_set=train_set,
        train_loader=train_loader,
        eval_set=eval_set,
        eval_loader=eval_loader,
        steps_per_epoch=None if train_loader is None else plan.steps_per_epoch(len(train_set)),
        num_prefetch_batches=cfg.num_prefetch_batches,
        stream_split=cfg.stream_split,
        fingerprints=dict(recipe.data_fingerprints),
    )
    return model, optimizers, pipeline, run_data


def model_and_sets(
    recipe: Recipe, cfg: TrainConfig, layout: LayoutSettings, accelerator: Accelerator, ranks: DataRanks, fit: bool
) -> tuple[TrainConfig, BatchPlan, Any, FrozenWeights | None, int, str, Any, Any]:
    """The batch plan (checked before any work); the recipe's model, its frozen weights (fingerprinted as built),
    its size and summary, split and wrapped for the layout; the recipe's checked training and eval sets. With
    micro_batch_size=auto, the config and plan of the largest micro-batch that fits (the run's cfg holds it,
    its identity says auto); `fit`: the recipe's default micro-batch follows the layout (data/batching.py), the
    run's cfg holding the size taken."""
    if cfg.micro_batch_size == "auto":
        check_auto_layout(accelerator, layout, ranks)
    plan = plan_batches(cfg.global_batch_size, planned_micro_batch_size(cfg.micro_batch_size), ranks.size, fit=fit)
    if plan.fitted_from:
        cfg = recipe.cfg = replace(cfg, micro_batch_size=plan.micro_batch_size)
    recipe.tokenizer = recipe.build_tokenizer(cfg)
    model = fsdp_loading.build_model(recipe, cfg, accelerator)
    frozen = FrozenWeights.agreed(model)
    num_parameters, summary = sum(parameter.numel() for parameter in model.parameters()), model_summary(model)
    model = split_and_wrap(model, recipe, layout, accelerator)
    with accelerator.main_process_first():  # a datasets cache (tokenized, mapped) written once, then read
        train_set, eval_set = recipe.build_datasets(cfg)
    loaders.check_dataset(train_set, "training")
    if eval_set is not None:
        loaders.check_dataset(eval_set, "eval")
    if cfg.micro_batch_size == "auto":
        micro_batch_size = choose_micro_batch_size(recipe, cfg.global_batch_size, model, train_set, accelerator, ranks)
        cfg = recipe.cfg = replace(cfg, micro_batch_size=micro_batch_size)
        plan = plan_batches(cfg.global_batch_size, micro_batch_size, ranks.size)
    return cfg, plan, model, frozen, num_parameters, summary, train_set, eval_set


def _optimizers(
    recipe: Recipe, cfg: TrainConfig, model: Any, accelerator: Accelerator, layout: LayoutSettings
) -> Optimizers:
    """The recipe's optimizer(s), each with its schedule (optimizers.py), or a one-line refusal."""
    schedule = functools.partial(recipe_scheduler, recipe, cfg, warn=accelerator.is_main_process)
    own = check_optimizer_for_layout(recipe, cfg, accelerator, layout)
    if own and accelerator.is_main_process and (cfg.optimizer, cfg.momentum) != ("adamw", 0.9):
        warnings.warn(
            f"accel-trainer: optimizer={cfg.optimizer} momentum={cfg.momentum} have no effect: the recipe's"
            " build_optimizer builds its own",
            stacklevel=2,
        )
    optimizers = read_optimizers(recipe.build_optimizer(cfg, model), recipe, model, lambda opt: schedule(opt))
    check_layout_for_several(optimizers.several, cfg, uses_mesh=uses_mesh(accelerator, layout))
    if optimizers.alternate and accelerator.ddp_handler is not None:  # a phase may leave parameters out
        accelerator.ddp_handler.find_unused_parameters = True
    return optimizers


def check_optimizer_for_layout(
    recipe: Recipe, cfg: TrainConfig, accelerator: Accelerator, layout: LayoutSettings
) -> bool:
    """Refuse `optimizer=muon` over sharded parameters in one line (a run and `estimate` alike); returns whether the
    recipe builds its own optimizer (optimizer= is then moot)."""
    own = inspect.unwrap(type(recipe).build_optimizer) is not Recipe.build_optimizer  # a wrapper of the default: not
    if not own and cfg.optimizer == "muon" and (accelerator.is_fsdp2 or uses_mesh(accelerator, layout)):
        raise ConfigError(MUON_SHARDED)
    return own


def uses_mesh(accelerator: Accelerator, layout: LayoutSettings) -> bool:
    return mesh_shape(layout, accelerator.num_processes, accelerator.is_fsdp2, accelerator.device.type).needs_mesh


def model_items_passed(
    accelerator: Accelerator, model: Any, plan: BatchPlan, ranks: DataRanks, pipeline: Pipeline | None
) -> ModelItems | None:
    """Passing a transformers model the step's item count, where it computes its own loss (hf_loss.py)."""
    countable = pipeline is None and ranks.context_parallel == 1
    several = plan.accumulation_steps > 1 or ranks.size > 1
    return model_items(accelerator.unwrap_model(model), countable, warn=several and accelerator.is_main_process)
