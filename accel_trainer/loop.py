"""The training loop: one module, read top to bottom, speaking Accelerator verbs.

`train_loop` prepares the run, resumes it if asked, and hands over to `_train_steps`, whose body is the step
order, once per optimizer step:
    accumulation_steps x (forward, loss, backward under `accumulate`)  ->  normalise  ->  clip
    ->  optimizer step  ->  LR schedule  ->  zero grad  ->  log  ->  evaluate  ->  checkpoint / stop

Nothing here reads a tensor back to the host except on logging and evaluation steps, so the device never
waits on Python between them.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from torch.distributed.tensor import DTensor

from . import checkpoint, checkpoint_files, data
from .batching import BatchPlan, plan_batches
from .batchnorm import average_running_stats, convert_to_sync_batchnorm
from .config import TrainConfig, config_to_yaml, layout_to_yaml
from .layout import LayoutSettings
from .losses import LossOutput, read_loss_output
from .metrics import MetricsLog, drop_records_after, format_metric
from .preemption import Preempted, PreemptionWatcher, note_where
from .recipe import Recipe
from .schedules import recipe_scheduler
from .step import StepVerbs
from .streams import TrainStream, eval_batches
from .wrapping import prepare_blocks


@dataclass
class Window:
    """Device-side sums over the optimizer steps since the last log, read back only when logging."""

    loss_sum: torch.Tensor
    num_items: torch.Tensor  # items counted on the device: recipes that return num_items
    num_host_items: int = 0  # items of mean-loss recipes, known on the host without a sync
    num_steps: int = 0
    term_sums: dict[str, torch.Tensor] = field(default_factory=dict)  # the recipe's extra terms, like loss_sum
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def empty(cls, device: torch.device) -> Window:
        return cls(torch.zeros((), device=device), torch.zeros((), device=device))

    def add(self, output: LossOutput, weight: float = 1.0) -> None:
        """Add a micro-batch's loss and terms, each multiplied by `weight` (the batch size for batch means)."""
        self.loss_sum.add_(output.loss.detach().float(), alpha=weight)
        for name, value in output.terms.items():
            if name not in self.term_sums:
                self.term_sums[name] = torch.zeros_like(self.loss_sum)
            self.term_sums[name].add_(value.float(), alpha=weight)


@dataclass
class Run:
    """The prepared objects of one run, as the step loop and checkpointing need them."""

    recipe: Recipe
    recipe_name: str
    cfg: TrainConfig
    layout: LayoutSettings
    accelerator: Accelerator
    run_dir: Path
    plan: BatchPlan
    model: Any
    optimizer: Any
    scheduler: Any
    train_set: Any
    train_loader: Any  # None for a stream (streams.py)
    eval_set: Any
    eval_loader: Any  # None for a stream, or without an eval set
    steps_per_epoch: int | None  # None for a stream: its epochs end where it does
    verbs: StepVerbs
    writer: checkpoint.BackgroundWriter | None = None
    stream: TrainStream | None = None

    def eval_batches(self) -> tuple[Any, bool]:
        """This process's eval micro-batches, and whether they still hold the loader's padding duplicates."""
        if self.eval_loader is not None:
            return self.eval_loader, True
        accelerator = self.accelerator
        batches = eval_batches(data.as_torch(self.eval_set), self.recipe.collate, self.plan.micro_batch_size,
                               accelerator.process_index, accelerator.num_processes)  # fmt: skip
        return batches, False


def train_loop(
    recipe: Recipe, cfg: TrainConfig, layout: LayoutSettings, accelerator: Accelerator, run_dir: Path,
    recipe_name: str,
) -> dict[str, Any]:  # fmt: skip
    """Train `recipe` up to `cfg.max_steps` optimizer steps, resuming if asked, and return the final metrics.

    Raises:
        Preempted: a signal stopped the run after it saved a checkpoint.
    """
    run = _prepare(recipe, cfg, layout, accelerator, run_dir, recipe_name)
    start_step, resume_rng, progress = _resume(run)
    if start_step >= cfg.max_steps:  # the run's files stay as they are: nothing is trained or written
        if accelerator.is_main_process:
            summary = " | ".join(format_metric(key, value) for key, value in progress["metrics"].items())
            print(f"{run_dir} already reached step {start_step} of max_steps={cfg.max_steps}: nothing to train;"
                  f" its final metrics: {summary}", flush=True)  # fmt: skip
        if not (run_dir / "final").is_dir():  # stopped between its last checkpoint and its final weights
            _save_final(accelerator, recipe, cfg, run.model, run.eval_set, run_dir)
        return progress["metrics"]
    if accelerator.is_main_process:  # only once the checkpoint (if any) has been accepted
        (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
        (run_dir / "layout.yaml").write_text(layout_to_yaml(layout))
        drop_records_after(run_dir, start_step)
    if run.train_loader is None:
        position = tuple(progress["data_position"] or (0, 0))
        run.stream = TrainStream(data.as_torch(run.train_set), recipe.collate, run.plan, accelerator.process_index,
                                 position)  # fmt: skip
        batches = run.stream.micro_batches(resume_rng)
    else:
        batches = data.micro_batches(
            run.train_loader, run.plan, run.steps_per_epoch or 0, start_step=start_step,
            skip_first_batches=accelerator.skip_first_batches, resume_rng=resume_rng,
        )  # fmt: skip
    log = MetricsLog(run_dir, enabled=accelerator.is_main_process, total_steps=cfg.max_steps,
                     show_progress_bar=cfg.show_progress_bar, initial=start_step)  # fmt: skip
    run.writer = checkpoint.BackgroundWriter() if cfg.async_save else None
    try:
        with PreemptionWatcher(accelerator.num_processes, layout.collective_timeout_s) as preemption:
            final = _train_steps(run, batches, log, preemption, start_step, progress)
    finally:
        log.close()
        if run.writer is not None:
            run.writer.wait()  # never leave with a checkpoint half written, preempted or not
    _save_final(accelerator, recipe, cfg, run.model, run.eval_set, run_dir)
    return final


def _prepare(
    recipe: Recipe, cfg: TrainConfig, layout: LayoutSettings, accelerator: Accelerator, run_dir: Path, recipe_name: str
) -> Run:
    set_seed(cfg.seed)  # the same initial weights on every process and layout
    plan = plan_batches(cfg.global_batch_size, cfg.micro_batch_size, accelerator.num_processes)
    accelerator.gradient_accumulation_steps = plan.accumulation_steps
    model = recipe.build_model(cfg)
    if layout.sync_batchnorm:
        model = convert_to_sync_batchnorm(model, accelerator, accelerator.is_main_process)
    prepare_blocks(model, recipe, layout.activation_checkpointing, is_main_process=accelerator.is_main_process)
    train_set, eval_set = recipe.build_datasets(cfg)
    data.check_dataset(train_set, "training")
    if eval_set is not None:
        data.check_dataset(eval_set, "eval")
    optimizer = recipe.build_optimizer(cfg, model)
    # deliberately not prepared: see schedules.py
    scheduler = recipe_scheduler(recipe, cfg, optimizer, warn=accelerator.is_main_process)
    workers = cfg.num_dataloader_workers
    if workers and data.is_stream(train_set) and accelerator.is_main_process:
        warnings.warn("accel-trainer: num_dataloader_workers has no effect on a stream: it is read in the training"
                      " process (streams.py)", stacklevel=2)  # fmt: skip
    train_loader = None if data.is_stream(train_set) else data.train_loader(recipe, train_set, plan, workers)
    eval_loader = None
    if eval_set is not None and not data.is_stream(eval_set):
        eval_loader = data.eval_loader(recipe, eval_set, plan, workers)
    # A None loader (a stream, or no eval set) passes through prepare unchanged.
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    set_seed(cfg.seed, device_specific=True)  # independent dropout streams per process
    steps_per_epoch = None if train_loader is None else plan.steps_per_epoch(len(train_set))
    return Run(recipe, recipe_name, cfg, layout, accelerator, run_dir, plan, model, optimizer, scheduler, train_set,
               train_loader, eval_set, eval_loader, steps_per_epoch, StepVerbs(accelerator, optimizer))  # fmt: skip


def _resume(run: Run) -> tuple[int, Callable[[], None] | None, dict[str, Any]]:
    """Restore the checkpoint `cfg.resume` points at; returns the step, an RNG restorer and the progress."""
    progress: dict[str, Any] = {"skipped_steps": 0, "best_metric": None, "best_checkpoint": None, "metrics": {},
                                "data_position": None}  # fmt: skip
    folder = checkpoint.resume_point(run.accelerator, run.cfg, run.run_dir)
    if folder is None:
        return 0, None, progress
    state, rng_states = checkpoint.restore(
        run.accelerator, folder, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
        recipe_name=run.recipe_name, cfg=run.cfg,
    )  # fmt: skip
    progress.update({key: state[key] for key in progress if key in state})
    if run.accelerator.is_main_process:
        print(f"resuming from {folder} at step {state['step']}", flush=True)
    restore_rng = functools.partial(checkpoint.apply_rng_states, rng_states) if rng_states else None
    return state["step"], restore_rng, progress


def _train_steps(
    run: Run, batches: Any, log: MetricsLog, preemption: PreemptionWatcher, start_step: int, progress: dict
) -> dict[str, Any]:
    """The step loop: accumulate, clip, step, schedule, log, evaluate, checkpoint, stop on a signal."""
    cfg, accelerator, model, optimizer = run.cfg, run.accelerator, run.model, run.optimizer
    window = Window.empty(accelerator.device)
    final: dict[str, Any] = progress["metrics"]  # the latest record and evaluation, saved in each checkpoint
    has_eval = run.eval_set is not None
    if has_eval and cfg.eval_every_steps > 0 and start_step == 0:
        log.write({"step": 0, **evaluate(accelerator, run.recipe, model, *run.eval_batches())})  # the baseline
    model.train()
    for step in range(start_step + 1, cfg.max_steps + 1):
        note_where(f"step {step}")
        epoch = _accumulate_gradients(run, batches, window)
        is_log_step = step == cfg.max_steps or (cfg.log_every_steps > 0 and step % cfg.log_every_steps == 0)
        grad_norm = None
        if cfg.max_grad_norm > 0 or is_log_step:
            grad_norm = run.verbs.clip_grad_norm(model.parameters(), cfg.max_grad_norm or float("inf"))
        lrs = [group["lr"] for group in optimizer.param_groups] if is_log_step else []  # the LRs of this step
        if run.verbs.optimizer_step():
            run.scheduler.step()  # the schedule follows the optimizer steps actually taken
        else:  # fp16: the gradient scaler found inf/NaN gradients
            progress["skipped_steps"] += 1
        run.verbs.zero_grad()
        log.advance()

        if is_log_step:
            record = _log_record(accelerator, cfg, window, step, epoch + 1, lrs, grad_norm)
            record["skipped_steps"] = progress["skipped_steps"]
            log.write(record)
            final.update(record)
            window = Window.empty(accelerator.device)
        scores = None
        if has_eval and (step == cfg.max_steps or (cfg.eval_every_steps > 0 and step % cfg.eval_every_steps == 0)):
            note_where(f"the evaluation after step {step}")
            scores = evaluate(accelerator, run.recipe, model, *run.eval_batches())
            log.write({"step": step, **scores})
            final.update(scores)
        stop = preemption.should_stop()
        if stop or step == cfg.max_steps or (cfg.save_every_steps > 0 and step % cfg.save_every_steps == 0):
            note_where(f"the save of step {step}")
            folder = _save_checkpoint(run, step, progress, scores)
            if stop:
                raise Preempted(preemption.signal_name, step, folder)
    return final


def _save_checkpoint(run: Run, step: int, progress: dict[str, Any], scores: dict[str, float] | None) -> Path:
    """Save, track the best checkpoint by `keep_best_metric`, and apply retention."""
    cfg = run.cfg
    average_running_stats(run.accelerator, run.model)  # the saved statistics are those evaluated
    if run.stream is not None:  # a map-style set's position is derived from the step
        progress["data_position"] = list(run.stream.position)
    value = (scores or {}).get(cfg.keep_best_metric) if cfg.keep_best_metric else None
    best = progress["best_metric"]
    if value is not None and (best is None or (value < best if cfg.keep_best_mode == "min" else value > best)):
        progress.update(best_metric=value, best_checkpoint=checkpoint_files.step_folder_name(step))
    best_folder = progress["best_checkpoint"]
    keep = checkpoint_files.checkpoints_dir(run.run_dir) / best_folder if best_folder else None
    return checkpoint.save(
        run.accelerator, run.run_dir, step, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
        recipe_name=run.recipe_name, cfg=cfg, extra=dict(progress), writer=run.writer,
        after_publish=functools.partial(checkpoint_files.apply_retention, run.run_dir, cfg.keep_last, keep),
    )  # fmt: skip


def _accumulate_gradients(run: Run, batches: Any, window: Window) -> int:
    """Run the micro-batches of one optimizer step; gradients are synchronised on the last one only.

    A loss returned with `num_items` is back-propagated as a sum and its gradients are divided by the item
    count of the whole step over all micro-batches and processes, which makes a token loss exact on any
    layout (the gradient-accumulation bug class of transformers #34191). Returns the epoch.
    """
    accelerator, model, plan = run.accelerator, run.model, run.plan
    step_items: torch.Tensor | None = None
    for _ in range(plan.accumulation_steps):
        epoch, batch = next(batches)
        # With one micro-batch per step there is nothing to accumulate and no synchronisation to skip.
        context = accelerator.accumulate(model) if plan.accumulation_steps > 1 else contextlib.nullcontext()
        with context:
            output = read_loss_output(run.recipe.compute_loss(model, batch))
            if output.num_items is not None:
                num_items = output.num_items.to(accelerator.device, torch.float32)
                step_items = num_items if step_items is None else step_items + num_items
                run.verbs.backward(output.loss)
                window.add(output)
                window.num_items += num_items
            else:
                # Training micro-batches are always full (the tail of an epoch is dropped), on every path.
                run.verbs.backward(output.loss)  # divided by the accumulation steps
                window.add(output, weight=plan.micro_batch_size)
                window.num_host_items += plan.micro_batch_size
    if step_items is not None:
        # accelerate scaled each sum by 1/accumulation_steps and the gradient all-reduce averaged over
        # processes; undo both and divide by the true item count of the step instead.
        total_items = accelerator.reduce(step_items, reduction="sum")
        scale = plan.accumulation_steps * plan.num_processes / total_items
        for parameter in model.parameters():
            if parameter.grad is not None:
                local = parameter.grad.to_local() if isinstance(parameter.grad, DTensor) else parameter.grad
                local.mul_(scale.to(local.dtype))  # an FSDP2 shard is scaled in place like a whole gradient
    window.num_steps += 1
    return epoch


def _log_record(
    accelerator: Accelerator,
    cfg: TrainConfig,
    window: Window,
    step: int,
    epoch: int,
    lrs: list[float],
    grad_norm: Any,
) -> dict[str, Any]:
    """Read the window back (the only host synchronisation of a training step) and build a log record."""
    names = sorted(window.term_sums)  # the same terms on every process: the reduce needs equal shapes
    sums = [window.loss_sum, window.num_items.float(), *(window.term_sums[name] for name in names)]
    totals = accelerator.reduce(torch.stack(sums), reduction="sum").tolist()
    loss_sum, num_items = totals[:2]
    num_items += window.num_host_items * accelerator.num_processes  # every process ran equal micro-batches
    elapsed = time.perf_counter() - window.started
    return {
        "step": step,
        "epoch": epoch,
        "loss": loss_sum / num_items,
        **{name: total / num_items for name, total in zip(names, totals[2:], strict=True)},
        "lr": lrs[0],
        **{f"lr/{index}": lr for index, lr in enumerate(lrs[1:], start=1)},
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "samples_per_s": window.num_steps * cfg.global_batch_size / elapsed,
        "step_time_s": elapsed / window.num_steps,
        "world_size": accelerator.num_processes,
    }


def evaluate(
    accelerator: Accelerator, recipe: Recipe, model: torch.nn.Module, batches: Any, padded: bool
) -> dict[str, float]:
    """Means of the recipe's per-sample eval metrics over the whole eval set, each sample counted once.

    Metrics are divided by the number of samples, or by the total of a `num_items` entry when the recipe
    returns one (per-sample sums over tokens, giving a token-weighted mean). A `padded` loader's batches are
    gathered with `gather_for_metrics`, which drops the duplicates that even out its last batch; a stream's
    (streams.eval_batches: disjoint, unequal per process) are summed here and the sums combined.
    """
    average_running_stats(accelerator, model)
    model.eval()
    sums: dict[str, Any] = {}
    with torch.no_grad():
        for batch in batches:
            metrics = recipe.eval_metrics(model, batch)
            if "num_items" not in metrics:
                metrics = {**metrics, "num_items": torch.ones(len(next(iter(metrics.values()))))}
            values = {k: v.float().to(accelerator.device) for k, v in metrics.items()}
            for name, value in (accelerator.gather_for_metrics(values) if padded else values).items():
                sums[name] = sums.get(name, 0) + value.sum()
    model.train()
    if not padded:  # a process may have had no eval batch at all: combine on the host, eval is rare
        totals: dict[str, float] = {}
        for part in gather_object([{name: float(total) for name, total in sums.items()}]):
            for name, total in part.items():
                totals[name] = totals.get(name, 0.0) + total
        sums = totals
    num_items = sums.pop("num_items")
    return {f"eval/{name}": float(total / num_items) for name, total in sums.items()}


def _save_final(
    accelerator: Accelerator, recipe: Recipe, cfg: TrainConfig, model: torch.nn.Module, eval_set: Any, run_dir: Path
) -> None:
    """Write `final/model.safetensors` (consolidated, unwrapped weights) and the recipe's artifacts.

    A transformers model is written with its own `save_pretrained` (model.safetensors and config.json), so
    `from_pretrained(run_dir / "final")` loads it.

    The weights are loaded into a freshly built CPU model, which works the same whether the trained model is
    plain, DDP-wrapped or sharded, and which safetensors can save with tied weights.
    """
    from safetensors.torch import save_model

    average_running_stats(accelerator, model)
    state = accelerator.get_state_dict(model)  # a collective under FSDP: every process takes part
    if accelerator.is_main_process:
        final_dir = run_dir / "final"
        final_dir.mkdir(parents=True, exist_ok=True)
        exported = recipe.build_model(cfg)
        exported.load_state_dict({k: v.detach().cpu() for k, v in state.items()})
        if hasattr(exported, "save_pretrained"):  # a transformers model: a folder from_pretrained loads
            exported.save_pretrained(final_dir)  # type: ignore[operator]
        else:
            save_model(exported, str(final_dir / "model.safetensors"))
        (final_dir / "config.yaml").write_text(config_to_yaml(cfg))
        checkpoint_files.follow_umask(*(path for path in final_dir.iterdir() if path.is_file()))
        recipe.write_artifacts(exported.eval(), eval_set, run_dir)
    accelerator.wait_for_everyone()
