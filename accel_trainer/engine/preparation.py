"""Everything one run trains with, built once: model, data, optimizer, schedule, step verbs, checkpointer.

`prepare_run` builds them in the order that keeps runs identical on every layout (the seed before the model,
the per-process seed after `accelerator.prepare`) and hands the loop a `Run`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DynamoBackend, set_seed

from accel_trainer.checkpoint.checkpointer import Checkpointer
from accel_trainer.checkpoint.final_weights import save_final
from accel_trainer.checkpoint.frozen import frozen_count
from accel_trainer.checkpoint.tokenizer import tokenizer_fingerprint
from accel_trainer.checkpoint.train_state import TrainState
from accel_trainer.checkpoint.trained import RunIdentity, Trained
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import TrainConfig, config_to_yaml, layout_to_yaml
from accel_trainer.data.run_data import RunData
from accel_trainer.engine.build import model_and_sets, model_items_passed, prepared_for_layout, uses_mesh
from accel_trainer.engine.evaluator import Evaluator
from accel_trainer.engine.model_calls import ModelCalls
from accel_trainer.engine.stepper import Stepper
from accel_trainer.observe.flops import flops_per_sample, peak_for_mfu
from accel_trainer.observe.header import header, parameters_held, write_run_info
from accel_trainer.observe.metrics import drop_records_after, format_metric
from accel_trainer.observe.observer import Observer
from accel_trainer.observe.window import ItemsSeen, Speed
from accel_trainer.optim.ema import WeightAverage
from accel_trainer.optim.optimizers import Optimizers, check_layout_for_several
from accel_trainer.parallel.accelerator import settings_note
from accel_trainer.parallel.compiling import allow_recompiles_per_region
from accel_trainer.parallel.context_parallel import SequenceSlicing
from accel_trainer.parallel.mesh import data_ranks, tensor_parallel_size
from accel_trainer.parallel.pipeline.stages import Pipeline
from accel_trainer.recipe import Recipe
from accel_trainer.stopping.early import EarlyStopping
from accel_trainer.stopping.nonfinite import NonfiniteGuard


@dataclass(frozen=True)
class Run:
    """The prepared parts of one run, as the loop needs them: built once by `prepare_run`, never changed.

    The loop is the only function that takes it whole; each part takes only its own values. What changes while
    it trains lives in its owners, each registered once with the checkpointer: the progress (`TrainState`, which
    the stepper advances), the non-finite guard's counts, early stopping's state, the items seen (which the
    observer counts) and the data position (`RunData`).
    """

    recipe: Recipe
    cfg: TrainConfig
    accelerator: Accelerator
    run_dir: Path
    data: RunData
    progress: TrainState
    checkpointer: Checkpointer
    stepper: Stepper  # one optimizer step: forward, loss, backward, clip, step, schedule
    evaluator: Evaluator  # evaluations and their cadence
    early: EarlyStopping
    items: ItemsSeen
    num_parameters: int
    model_summary: str
    peak_tflops: float | None  # per device, for MFU; None: not known
    compiled: bool  # torch.compile regions: the observer counts their graphs

    def micro_batches(self) -> Any:
        """This process's training micro-batches from the restored progress on (RunData.micro_batches)."""
        return self.data.micro_batches(self.progress.step, self.accelerator, self.checkpointer.resume_rng)

    def write_start_files(self, cfg: TrainConfig, layout: LayoutSettings, recipe_name: str) -> None:
        """config.yaml, layout.yaml, model_summary.txt and run_info.json, once the checkpoint (if any) is accepted,
        and the header on the console; records after the resumed step go (a later run rewrites them)."""
        accelerator, run_dir = self.accelerator, self.run_dir
        held = parameters_held(self.stepper.model, accelerator)  # a collective: on every process
        if not accelerator.is_main_process:
            return
        ran = replace(layout, tp_size=tensor_parallel_size(accelerator))  # also when the accelerate config set it
        (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
        (run_dir / "layout.yaml").write_text(layout_to_yaml(ran))
        (run_dir / "model_summary.txt").write_text(self.model_summary)
        write_run_info(run_dir, accelerator, ran, self.progress.step, held)
        drop_records_after(run_dir, self.progress.step)
        data_path = self.data.describe(self.recipe)
        frozen = frozen_count(self.checkpointer.trained.frozen)
        facts = (self.num_parameters, held, self.data.plan, data_path, run_dir, settings_note(), frozen)
        print(header(accelerator, recipe_name, *facts), flush=True)

    def observer(self, cfg: TrainConfig, setup_started: float) -> Observer:
        """The run's observer, once its state is restored; `cfg` as asked (micro_batch_size=auto stays auto)."""
        optimizers = self.stepper.optimizers
        phases = tuple(p.name for p in optimizers.phases) if optimizers.alternate else (None,)
        guard = self.stepper.guard

        def count_flops(first_batch: Any) -> tuple[float, str]:
            frozen_parameters = frozen_count(self.checkpointer.trained.frozen)
            return flops_per_sample(self.recipe, self.cfg, first_batch, self.num_parameters, phases, frozen_parameters)

        return Observer(
            accelerator=self.accelerator,
            cfg=cfg,
            run_dir=self.run_dir,
            state=self.progress,
            setup_started=setup_started,
            speed=Speed(peak_tflops=self.peak_tflops),
            compiled=self.compiled,
            count_flops=count_flops,
            items=self.items,
            nonfinite_steps=lambda: guard.counts.nonfinite_steps if guard is not None else 0,
        )

    def already_trained(self) -> dict[str, Any]:
        """Say that a resumed run has nothing left to train; write its final weights if they are missing."""
        progress, max_steps = self.progress, self.cfg.max_steps
        if self.accelerator.is_main_process:
            summary = " | ".join(format_metric(key, value) for key, value in progress.metrics.items())
            reached = "stopped early at" if self.early.stopped_early else "already reached"
            print(
                f"{self.run_dir} {reached} step {progress.step} of max_steps={max_steps}: nothing to train;"
                f" its final metrics: {summary}",
                flush=True,
            )
        if not (self.run_dir / "final").is_dir():  # stopped between its last checkpoint and its final weights
            self.final_weights()
        return progress.metrics

    def final_weights(self) -> None:
        """final/model.safetensors and the recipe's artifacts, and final/ema/model.safetensors with an EMA."""
        eval_set, model, ema = self.data.eval_set, self.stepper.model, self.stepper.ema
        save_final(self.accelerator, self.recipe, self.cfg, model, eval_set, self.run_dir)
        if ema is not None:
            with ema.swapped_in():
                save_final(self.accelerator, self.recipe, self.cfg, model, eval_set, self.run_dir, ema=True)


def prepare_run(recipe: Recipe, identity: RunIdentity, accelerator: Accelerator, run_dir: Path) -> Run:
    """Build everything the run trains with, in the order that keeps it identical on every layout."""
    cfg, layout = identity.cfg, identity.layout
    set_seed(cfg.seed)  # the same initial weights on every process and layout
    ranks = data_ranks(accelerator)
    check_layout_for_several(recipe.alternate_optimizers, cfg, uses_mesh=uses_mesh(accelerator, layout))
    cfg, plan, model, frozen, num_parameters, summary, train_set, eval_set = model_and_sets(
        recipe, cfg, layout, accelerator, ranks
    )
    accelerator.gradient_accumulation_steps = plan.accumulation_steps
    model, optimizers, pipeline, run_data = prepared_for_layout(
        recipe, cfg, layout, accelerator, ranks, plan, model, train_set, eval_set
    )
    set_seed(cfg.seed + ranks.rank)  # independent dropout per data-parallel rank, shared by its TP ranks
    ema = WeightAverage(model, cfg.ema_decay, frozen.names if frozen else frozenset()) if cfg.ema_decay else None
    guard = NonfiniteGuard(cfg, accelerator, model) if cfg.skip_nonfinite_steps else None
    whole, tokenizer = pipeline.model if pipeline is not None else None, tokenizer_fingerprint(recipe.tokenizer)
    trained = Trained(model, optimizers, whole=whole, ema=ema, frozen=frozen, tokenizer=tokenizer)
    progress, early, items = TrainState(), EarlyStopping(), ItemsSeen(accelerator)
    states = (*((guard,) if guard is not None else ()), early, items, run_data)  # the items before the position
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
    )


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
    the recipe's) rather than the recipe."""
    return Evaluator(
        accelerator=accelerator,
        eval_metrics=recipe.eval_metrics if pipeline is None else pipeline.eval_metrics,
        model=model,
        data=data,
        cfg=cfg,
        checkpointer=checkpointer,
        ema=checkpointer.trained.ema,
    )
