"""Everything one run trains with, built once: model, data, optimizers, the states the checkpointer saves, the
stepper and the evaluator.

`prepare_run` builds them in the order that keeps runs identical on every layout (the seed before the model,
the per-process seed after `accelerator.prepare`) and hands the loop a `Run` (engine/run.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DynamoBackend, set_seed

from accel_trainer.checkpoint.checkpointer import Checkpointer
from accel_trainer.checkpoint.generations import Generations
from accel_trainer.checkpoint.tokenizer import tokenizer_fingerprint
from accel_trainer.checkpoint.train_state import TrainState
from accel_trainer.checkpoint.trained import RunIdentity, Trained
from accel_trainer.config.train_config import TrainConfig
from accel_trainer.data.run_data import RunData
from accel_trainer.engine.benchmarks import TrainingBenchmarks, sharded_by
from accel_trainer.engine.build import model_and_sets, model_items_passed, prepared_for_layout, uses_mesh
from accel_trainer.engine.evaluator import Evaluator
from accel_trainer.engine.model_calls import ModelCalls
from accel_trainer.engine.run import Run
from accel_trainer.engine.stepper import Stepper
from accel_trainer.errors import RecipeError
from accel_trainer.observe.flops import peak_for_mfu
from accel_trainer.observe.window import ItemsSeen
from accel_trainer.optim.ema import WeightAverage
from accel_trainer.optim.optimizers import Optimizers, check_layout_for_several
from accel_trainer.parallel.compiling import allow_recompiles_per_region
from accel_trainer.parallel.context_parallel import SequenceSlicing
from accel_trainer.parallel.mesh import data_ranks
from accel_trainer.parallel.pipeline.stages import Pipeline
from accel_trainer.recipe import Recipe
from accel_trainer.stopping.early import EarlyStopping
from accel_trainer.stopping.nonfinite import NonfiniteGuard


def prepare_run(recipe: Recipe, identity: RunIdentity, accelerator: Accelerator, run_dir: Path) -> Run:
    """Build everything the run trains with, in the order that keeps it identical on every layout."""
    cfg, layout = identity.cfg, identity.layout
    set_seed(cfg.seed)  # the same initial weights on every process and layout
    ranks = data_ranks(accelerator)
    check_layout_for_several(recipe.alternate_optimizers, cfg, uses_mesh=uses_mesh(accelerator, layout))
    cfg, plan, model, frozen, num_parameters, summary, train_set, eval_set = model_and_sets(
        recipe, cfg, layout, accelerator, ranks, fit=not identity.micro_batch_size_given
    )
    accelerator.gradient_accumulation_steps = plan.accumulation_steps
    model, optimizers, pipeline, run_data = prepared_for_layout(
        recipe, cfg, layout, accelerator, ranks, plan, model, train_set, eval_set
    )
    set_seed(cfg.seed + ranks.rank)  # independent dropout per data-parallel rank, shared by its TP ranks
    ema = WeightAverage(model, cfg.ema_decay, frozen.names if frozen else frozenset()) if cfg.ema_decay else None
    guard = NonfiniteGuard(cfg, accelerator, model) if cfg.skip_nonfinite_steps else None
    whole, tokenizer = pipeline.model if pipeline is not None else None, tokenizer_fingerprint(recipe.tokenizer)
    generations = Generations(*recipe.rollout_schedule(), plan.accumulation_steps) if recipe.rolls_out() else None
    trained = Trained(
        model, optimizers, whole=whole, ema=ema, frozen=frozen, tokenizer=tokenizer, generations=generations
    )
    progress, early, items = TrainState(), EarlyStopping(), ItemsSeen(accelerator)
    states = (*((guard,) if guard is not None else ()), early, items, run_data)  # the items before the position
    states += (generations,) if generations is not None else ()
    checkpointer = Checkpointer(
        accelerator, run_dir, trained, identity, has_eval=eval_set is not None, progress=progress, states=states
    )
    compiled = _compiled(accelerator, model)
    stepper = _stepper(recipe, cfg, accelerator, model, optimizers, run_data, progress, checkpointer, pipeline, guard)
    evaluator = _evaluator(recipe, cfg, accelerator, model, run_data, checkpointer, pipeline)
    return Run(
        recipe=recipe,
        cfg=cfg,
        accelerator=accelerator,
        run_dir=run_dir,
        data=run_data,
        progress=progress,
        checkpointer=checkpointer,
        stepper=stepper,
        evaluator=evaluator,
        early=early,
        items=items,
        num_parameters=num_parameters,
        model_summary=summary,
        peak_tflops=peak_for_mfu(accelerator, layout),
        compiled=compiled,
    )


def _stepper(
    recipe: Recipe,
    cfg: TrainConfig,
    accelerator: Accelerator,
    model: Any,
    optimizers: Optimizers,
    data: RunData,
    progress: TrainState,
    checkpointer: Checkpointer,
    pipeline: Pipeline | None,
    guard: NonfiniteGuard | None,
) -> Stepper:
    """The step's owner, given the recipe's loss and its sequence dimensions rather than the recipe."""
    return Stepper(
        accelerator=accelerator,
        compute_loss=recipe.compute_loss,
        rollout=_rollout(recipe, pipeline, optimizers),
        slicing=SequenceSlicing.of(recipe, data.ranks.context_parallel),
        model=model,
        optimizers=optimizers,
        plan=data.plan,
        ranks=data.ranks,
        progress=progress,
        global_batch_size=cfg.global_batch_size,
        max_grad_norm=cfg.max_grad_norm,
        before_update=checkpointer.before_update,  # a background save's copy of the weights must be done first
        pipeline=pipeline,
        guard=guard,
        ema=checkpointer.trained.ema,
        model_items=model_items_passed(accelerator, model, data.plan, data.ranks, pipeline),
        model_calls=ModelCalls(model) if pipeline is None else None,
        generations=checkpointer.trained.generations,
    )


def _rollout(recipe: Recipe, pipeline: Pipeline | None, optimizers: Optimizers) -> Any:
    """The recipe's rollout, where it defines one; refused in one line where a step cannot run it first."""
    if not type(recipe).rolls_out():
        return None
    name = type(recipe).__name__
    if pipeline is not None:
        raise RecipeError(f"{name} defines rollout, which a pipeline layout cannot run: use cpu_ddp, cpu_fsdp, ...")
    if optimizers.alternate:
        raise RecipeError(f"{name} defines rollout and alternates optimizers: a step has one rollout; step one")
    return recipe.rollout


def _compiled(accelerator: Accelerator, model: Any) -> bool:
    """Whether the layout compiles the model (torch.compile regions, whose graphs the observer counts); each region
    may then recompile as often as its shapes need."""
    compiled = accelerator.state.dynamo_plugin.backend != DynamoBackend.NO
    if compiled:
        allow_recompiles_per_region(model)
    return compiled


def _evaluator(
    recipe: Recipe,
    cfg: TrainConfig,
    accelerator: Accelerator,
    model: Any,
    data: RunData,
    checkpointer: Checkpointer,
    pipeline: Pipeline | None,
) -> Evaluator:
    """The evaluations' owner, given the recipe's eval_metrics (on a pipeline layout, the stages', whose last runs
    the recipe's) and the benchmarks of eval_tasks rather than the recipe."""
    benchmarks = None
    if cfg.eval_tasks:  # refused here, before any training, where the harness cannot score the model
        sharded = sharded_by(accelerator, model, pipelined=pipeline is not None)
        benchmarks = TrainingBenchmarks.of(cfg.eval_tasks, accelerator, model, recipe.tokenizer, sharded)
    return Evaluator(
        accelerator=accelerator,
        eval_metrics=recipe.eval_metrics if pipeline is None else pipeline.eval_metrics,
        model=model,
        data=data,
        cfg=cfg,
        checkpointer=checkpointer,
        ema=checkpointer.trained.ema,
        benchmarks=benchmarks,
    )
