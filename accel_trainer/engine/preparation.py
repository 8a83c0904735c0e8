"""Everything one run trains with, built once: model, data, optimizer, schedule, step verbs, checkpointer.

`prepare_run` builds them in the order that keeps runs identical on every layout (the seed before the model,
the per-process seed after `accelerator.prepare`) and hands the loop a `Run`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DynamoBackend, set_seed

from accel_trainer.checkpoint.checkpointer import Checkpointer
from accel_trainer.checkpoint.final_weights import save_final
from accel_trainer.checkpoint.frozen import FrozenWeights, frozen_count
from accel_trainer.checkpoint.tokenizer import tokenizer_fingerprint
from accel_trainer.checkpoint.train_state import TrainState
from accel_trainer.checkpoint.trained import RunIdentity, Trained
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import TrainConfig, config_to_yaml, layout_to_yaml
from accel_trainer.data import loaders as data
from accel_trainer.data.auto_batch import check_auto_layout, choose_micro_batch_size
from accel_trainer.data.batching import BatchPlan, plan_batches, planned_micro_batch_size
from accel_trainer.data.run_data import RunData, build_loaders
from accel_trainer.engine.hf_loss import ModelItems, model_items
from accel_trainer.engine.model_calls import ModelCalls
from accel_trainer.observe.flops import flops_per_sample, peak_for_mfu
from accel_trainer.observe.header import header, model_summary, parameters_held, write_run_info
from accel_trainer.observe.metrics import drop_records_after, format_metric
from accel_trainer.observe.observer import Observer
from accel_trainer.observe.window import Speed
from accel_trainer.optim.ema import WeightAverage
from accel_trainer.optim.optimizers import Optimizers, check_layout_for_several, read_optimizers
from accel_trainer.optim.schedules import recipe_scheduler
from accel_trainer.parallel import fsdp_loading
from accel_trainer.parallel.accelerator import prepare_for_training, settings_note
from accel_trainer.parallel.compiling import allow_recompiles_per_region
from accel_trainer.parallel.mesh import DataRanks, data_ranks, mesh_shape, tensor_parallel_size
from accel_trainer.parallel.pipeline.build import build_pipeline
from accel_trainer.parallel.pipeline.stages import Pipeline
from accel_trainer.parallel.verbs import StepVerbs
from accel_trainer.parallel.wrapping import split_and_wrap
from accel_trainer.recipe import Recipe
from accel_trainer.stopping.nonfinite import NonfiniteGuard


@dataclass(frozen=True)
class Run:
    """The prepared objects of one run, as the step loop needs them: built once by `prepare_run`, never changed.

    What changes while it trains lives in its owners: the progress in the checkpointer's `TrainState`, the
    data position in `RunData`, the records in the loop's `Observer`.
    """

    recipe: Recipe
    cfg: TrainConfig
    accelerator: Accelerator
    run_dir: Path
    data: RunData
    model: Any
    optimizers: Optimizers  # one phase per optimizer (optimizers.py), each with its schedule and step verbs
    checkpointer: Checkpointer
    num_parameters: int
    model_summary: str
    peak_tflops: float | None  # per device, for MFU; None: not known
    compiled: bool  # torch.compile regions: the observer counts their graphs
    pipeline: Pipeline | None = None  # a pipeline layout's stages: they run forward and backward
    guard: NonfiniteGuard | None = None  # skips non-finite steps (None: skip_nonfinite_steps=false)
    ema: WeightAverage | None = None  # the EMA of the weights (None: ema_decay=0)
    model_items: ModelItems | None = None  # passes a transformers model the step's item count (hf_loss.py)
    model_calls: ModelCalls | None = None  # whether compute_loss called the model itself (model_calls.py)

    @property
    def plan(self) -> BatchPlan:
        return self.data.plan

    @property
    def ranks(self) -> DataRanks:
        return self.data.ranks

    @property
    def evaluator(self) -> Any:
        """What computes the eval metrics of a batch: the recipe, or on a pipeline layout its stages."""
        return self.pipeline if self.pipeline is not None else self.recipe

    def restore(self) -> TrainState:
        """Load the checkpoint `resume` names, if any (Checkpointer.restore), and return the run's state; a run
        the non-finite guard stopped gets a new allowance. A data position this run's data cannot continue from
        (a stream split over another number of processes) is refused before anything is loaded or said."""
        state = self.checkpointer.restore(self.data.check_position)
        if self.guard is not None:
            self.guard.resume(state)
        return state

    def micro_batches(self) -> Any:
        """This process's training micro-batches from the restored state on (RunData.micro_batches)."""
        state = self.checkpointer.state
        return self.data.micro_batches(state.step, state.data_position, self.accelerator, self.checkpointer.resume_rng)

    def write_start_files(self, cfg: TrainConfig, layout: LayoutSettings, recipe_name: str) -> None:
        """config.yaml, layout.yaml, model_summary.txt and run_info.json, once the checkpoint (if any) is accepted,
        and the header on the console; records after the resumed step go (a later run rewrites them)."""
        accelerator, run_dir, state = self.accelerator, self.run_dir, self.checkpointer.state
        held = parameters_held(self.model, accelerator)  # a collective: on every process
        if not accelerator.is_main_process:
            return
        ran = replace(layout, tp_size=tensor_parallel_size(accelerator))  # also when the accelerate config set it
        (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
        (run_dir / "layout.yaml").write_text(layout_to_yaml(ran))
        (run_dir / "model_summary.txt").write_text(self.model_summary)
        write_run_info(run_dir, accelerator, ran, state.step, held)
        drop_records_after(run_dir, state.step)
        data_path = self.data.describe(self.recipe)
        frozen = frozen_count(self.checkpointer.trained.frozen)
        facts = (self.num_parameters, held, self.plan, data_path, run_dir, settings_note(), frozen)
        print(header(accelerator, recipe_name, *facts), flush=True)

    def observer(self, cfg: TrainConfig, setup_started: float) -> Observer:
        """The run's observer, once its state is restored; `cfg` as asked (micro_batch_size=auto stays auto)."""
        phases = tuple(p.name for p in self.optimizers.phases) if self.optimizers.alternate else (None,)

        def count_flops(first_batch: Any) -> tuple[float, str]:
            frozen_parameters = frozen_count(self.checkpointer.trained.frozen)
            return flops_per_sample(self.recipe, self.cfg, first_batch, self.num_parameters, phases, frozen_parameters)

        return Observer(
            accelerator=self.accelerator,
            cfg=cfg,
            run_dir=self.run_dir,
            state=self.checkpointer.state,
            setup_started=setup_started,
            speed=Speed(peak_tflops=self.peak_tflops),
            compiled=self.compiled,
            count_flops=count_flops,
        )

    def already_trained(self) -> dict[str, Any]:
        """Say that a resumed run has nothing left to train; write its final weights if they are missing."""
        state, max_steps = self.checkpointer.state, self.cfg.max_steps
        if self.accelerator.is_main_process:
            summary = " | ".join(format_metric(key, value) for key, value in state.metrics.items())
            reached = "stopped early at" if state.stopped_early else "already reached"
            print(
                f"{self.run_dir} {reached} step {state.step} of max_steps={max_steps}: nothing to train;"
                f" its final metrics: {summary}",
                flush=True,
            )
        if not (self.run_dir / "final").is_dir():  # stopped between its last checkpoint and its final weights
            self.final_weights()
        return state.metrics

    def final_weights(self) -> None:
        """final/model.safetensors and the recipe's artifacts, and final/ema/model.safetensors with an EMA."""
        eval_set = self.data.eval_set
        save_final(self.accelerator, self.recipe, self.cfg, self.model, eval_set, self.run_dir)
        if self.ema is not None:
            with self.ema.swapped_in():
                save_final(self.accelerator, self.recipe, self.cfg, self.model, eval_set, self.run_dir, ema=True)


def prepare_run(recipe: Recipe, identity: RunIdentity, accelerator: Accelerator, run_dir: Path) -> Run:
    """Build everything the run trains with, in the order that keeps it identical on every layout."""
    cfg, layout = identity.cfg, identity.layout
    set_seed(cfg.seed)  # the same initial weights on every process and layout
    ranks = data_ranks(accelerator)
    check_layout_for_several(recipe.alternate_optimizers, cfg, uses_mesh=_uses_mesh(accelerator, layout))
    cfg, plan, model, frozen, num_parameters, summary, train_set, eval_set = _model_and_sets(
        recipe, cfg, layout, accelerator, ranks
    )
    accelerator.gradient_accumulation_steps = plan.accumulation_steps
    model, optimizers, pipeline, run_data = _prepared(
        recipe, cfg, layout, accelerator, ranks, plan, model, train_set, eval_set
    )
    set_seed(cfg.seed + ranks.rank)  # independent dropout per data-parallel rank, shared by its TP ranks
    ema = WeightAverage(model, cfg.ema_decay, frozen.names if frozen else frozenset()) if cfg.ema_decay else None
    guard = NonfiniteGuard(cfg, accelerator, model) if cfg.skip_nonfinite_steps else None
    whole = pipeline.model if pipeline is not None else None
    tokenizer = tokenizer_fingerprint(recipe.tokenizer)
    trained = Trained(model, optimizers, whole=whole, ema=ema, frozen=frozen, tokenizer=tokenizer)
    checkpointer = Checkpointer(accelerator, run_dir, trained, identity, has_eval=eval_set is not None)
    compiled = accelerator.state.dynamo_plugin.backend != DynamoBackend.NO
    if compiled:
        allow_recompiles_per_region(model)
    return Run(
        recipe=recipe,
        cfg=cfg,
        accelerator=accelerator,
        run_dir=run_dir,
        data=run_data,
        model=model,
        optimizers=optimizers,
        checkpointer=checkpointer,
        num_parameters=num_parameters,
        model_summary=summary,
        peak_tflops=peak_for_mfu(accelerator, layout),
        compiled=compiled,
        pipeline=pipeline,
        guard=guard,
        ema=ema,
        model_items=_model_items(accelerator, model, plan, ranks, pipeline),
        model_calls=ModelCalls(model) if pipeline is None else None,
    )


def _prepared(
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
        first_examples = functools.partial(data.first_examples, train_set, plan.micro_batch_size)
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
    )
    return model, optimizers, pipeline, run_data


def _model_and_sets(
    recipe: Recipe, cfg: TrainConfig, layout: LayoutSettings, accelerator: Accelerator, ranks: DataRanks
) -> tuple[TrainConfig, BatchPlan, Any, FrozenWeights | None, int, str, Any, Any]:
    """The batch plan (checked before any work); the recipe's model, its frozen weights (fingerprinted as built),
    its size and summary, split and wrapped for the layout; the recipe's checked training and eval sets. With
    micro_batch_size=auto, the config and plan of the largest micro-batch that fits (the run's cfg holds it,
    its identity says auto)."""
    if cfg.micro_batch_size == "auto":
        check_auto_layout(accelerator, layout, ranks)
    plan = plan_batches(cfg.global_batch_size, planned_micro_batch_size(cfg.micro_batch_size), ranks.size)
    recipe.tokenizer = recipe.build_tokenizer(cfg)
    model = fsdp_loading.build_model(recipe, cfg, accelerator)
    frozen = FrozenWeights.agreed(model)
    num_parameters, summary = sum(parameter.numel() for parameter in model.parameters()), model_summary(model)
    model = split_and_wrap(model, recipe, layout, accelerator)
    with accelerator.main_process_first():  # a datasets cache (tokenized, mapped) written once, then read
        train_set, eval_set = recipe.build_datasets(cfg)
    data.check_dataset(train_set, "training")
    if eval_set is not None:
        data.check_dataset(eval_set, "eval")
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
    optimizers = read_optimizers(recipe.build_optimizer(cfg, model), recipe, model, lambda opt: schedule(opt))
    check_layout_for_several(optimizers.several, cfg, uses_mesh=_uses_mesh(accelerator, layout))
    if optimizers.alternate and accelerator.ddp_handler is not None:  # a phase may leave parameters out
        accelerator.ddp_handler.find_unused_parameters = True
    return optimizers


def _uses_mesh(accelerator: Accelerator, layout: LayoutSettings) -> bool:
    return mesh_shape(layout, accelerator.num_processes, accelerator.is_fsdp2, accelerator.device.type).needs_mesh


def _model_items(accelerator: Accelerator, model: Any, plan: BatchPlan, ranks: DataRanks, pipeline: Any) -> Any:
    """Passing a transformers model the step's item count, where it computes its own loss (hf_loss.py)."""
    countable = pipeline is None and ranks.context_parallel == 1
    several = plan.accumulation_steps > 1 or ranks.size > 1
    return model_items(accelerator.unwrap_model(model), countable, warn=several and accelerator.is_main_process)
