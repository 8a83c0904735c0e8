"""The run: its prepared parts, as the loop needs them, and the files it writes at its start and end.

`engine/preparation.py` builds it; the loop is the only function that takes it whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from accel_trainer.checkpoint.checkpointer import Checkpointer
from accel_trainer.checkpoint.final_weights import save_final
from accel_trainer.checkpoint.frozen import frozen_count
from accel_trainer.checkpoint.train_state import TrainState
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.config.train_config import TrainConfig, config_to_yaml, layout_to_yaml
from accel_trainer.data.run_data import RunData
from accel_trainer.engine.evaluator import Evaluator
from accel_trainer.engine.stepper import Stepper
from accel_trainer.observe.flops import flops_per_sample
from accel_trainer.observe.header import four_bit_base, header, parameters_held, write_run_info
from accel_trainer.observe.metrics import console_line, drop_records_after
from accel_trainer.observe.observer import Observer
from accel_trainer.observe.window import ItemsSeen, Speed
from accel_trainer.parallel.accelerator import settings_note
from accel_trainer.parallel.mesh import tensor_parallel_size
from accel_trainer.recipe import Recipe
from accel_trainer.stopping.early import EarlyStopping


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
        """This process's training micro-batches from the restored progress on (RunData.micro_batches): a rollout
        that feeds several steps has read whole generations' data (checkpoint/generations.py)."""
        generations, step, resume_rng = self.stepper.generations, self.progress.step, self.checkpointer.resume_rng
        if generations is None:
            return self.data.micro_batches(step, self.accelerator, resume_rng)
        if resume_rng is not None and generations.inside(step):  # its steps run before the data path reads
            resume_rng()
            resume_rng = generations.rng_before_read
        return self.data.micro_batches(generations.data_steps(step), self.accelerator, resume_rng)

    def write_start_files(self, cfg: TrainConfig, layout: LayoutSettings, recipe_name: str) -> None:
        """config.yaml, layout.yaml, model_summary.txt and run_info.json, once the checkpoint (if any) is accepted,
        and the header on the console; records after the resumed step go (a later run rewrites them)."""
        accelerator, run_dir = self.accelerator, self.run_dir
        held = parameters_held(self.stepper.model, accelerator)  # a collective: on every process
        four_bits = four_bit_base(self.stepper.model, accelerator)  # one too, on a 4-bit base
        if not accelerator.is_main_process:
            return
        ran = replace(layout, tp_size=tensor_parallel_size(accelerator))  # also when the accelerate config set it
        (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
        (run_dir / "layout.yaml").write_text(layout_to_yaml(ran))
        (run_dir / "model_summary.txt").write_text(self.model_summary)
        write_run_info(run_dir, accelerator, ran, self.progress.step, held, self.data.plan)
        drop_records_after(run_dir, self.progress.step)
        data_path = self.data.describe(self.recipe)
        frozen = frozen_count(self.checkpointer.trained.frozen)
        facts = (self.num_parameters, held, self.data.plan, data_path, run_dir, settings_note(), frozen, four_bits)
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
            tracker_project=cfg.tracker_project or self.checkpointer.identity.recipe_name,
        )

    def already_trained(self) -> dict[str, Any]:
        """Say that a resumed run has nothing left to train; write its final weights if they are missing."""
        progress, max_steps = self.progress, self.cfg.max_steps
        if self.accelerator.is_main_process:
            summary = console_line({key: value for key, value in progress.metrics.items() if key != "eta_s"})
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
