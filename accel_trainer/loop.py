"""The training loop: one function, read top to bottom, speaking Accelerator verbs.

Step order, once per optimizer step:
    accumulation_steps x (forward, loss, backward under `accumulate`)  ->  normalise  ->  clip
    ->  optimizer step  ->  LR schedule  ->  zero grad  ->  log  ->  evaluate

Nothing here reads a tensor back to the host except on logging and evaluation steps, so the device never
waits on Python between them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.distributed.tensor import DTensor

from . import accelerate_fixes, data
from .batching import BatchPlan, plan_batches
from .config import TrainConfig
from .metrics import MetricsLog
from .recipe import Recipe
from .schedules import build_scheduler
from .wrapping import prepare_blocks


@dataclass
class Window:
    """Device-side sums over the optimizer steps since the last log, read back only when logging."""

    loss_sum: torch.Tensor
    num_items: torch.Tensor
    num_steps: int = 0
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def empty(cls, device: torch.device) -> Window:
        return cls(torch.zeros((), device=device), torch.zeros((), device=device))


def train_loop(recipe: Recipe, cfg: TrainConfig, accelerator: Accelerator, run_dir: Path) -> dict[str, Any]:
    """Train `recipe` for `cfg.max_steps` optimizer steps and return the final metrics."""
    set_seed(cfg.seed)  # the same initial weights on every process and layout
    plan = plan_batches(cfg.global_batch_size, cfg.micro_batch_size, accelerator.num_processes)
    accelerator.gradient_accumulation_steps = plan.accumulation_steps
    model = recipe.build_model(cfg)
    prepare_blocks(model, recipe, cfg, is_main_process=accelerator.is_main_process)
    train_set, eval_set = recipe.build_datasets(cfg)
    optimizer = recipe.build_optimizer(cfg, model)
    scheduler = build_scheduler(optimizer, cfg)  # deliberately not prepared: see schedules.py
    train_loader = data.train_loader(recipe, train_set, plan, cfg.num_dataloader_workers)
    eval_loader = data.eval_loader(recipe, eval_set, plan, cfg.num_dataloader_workers) if eval_set else None
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    set_seed(cfg.seed, device_specific=True)  # independent dropout streams per process

    steps_per_epoch = plan.steps_per_epoch(len(train_set))
    batches = data.micro_batches(train_loader, plan, steps_per_epoch)
    log = MetricsLog(
        run_dir,
        enabled=accelerator.is_main_process,
        total_steps=cfg.max_steps,
        show_progress_bar=cfg.show_progress_bar,
    )
    window = Window.empty(accelerator.device)
    skipped_steps = 0  # fp16 steps the gradient scaler skipped for inf/NaN gradients
    final: dict[str, Any] = {}
    if eval_loader is not None and cfg.eval_every_steps > 0:
        log.write({"step": 0, **evaluate(accelerator, recipe, model, eval_loader)})  # the untrained baseline
    model.train()
    for step in range(1, cfg.max_steps + 1):
        epoch = _accumulate_gradients(accelerator, recipe, model, batches, plan, window)
        is_log_step = step == cfg.max_steps or (cfg.log_every_steps > 0 and step % cfg.log_every_steps == 0)
        grad_norm = None
        if cfg.max_grad_norm > 0 or is_log_step:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
        lr = optimizer.param_groups[0]["lr"]
        accelerate_fixes.optimizer_step(optimizer)
        if optimizer.step_was_skipped:
            skipped_steps += 1
        else:
            scheduler.step()  # the schedule follows the optimizer steps actually taken
        accelerate_fixes.optimizer_zero_grad(optimizer)
        log.advance()

        if is_log_step:
            record = _log_record(accelerator, cfg, window, step, epoch + 1, lr, grad_norm)
            record["skipped_steps"] = skipped_steps
            log.write(record)
            final.update(record)
            window = Window.empty(accelerator.device)
        is_eval_step = step == cfg.max_steps or (cfg.eval_every_steps > 0 and step % cfg.eval_every_steps == 0)
        if eval_loader is not None and is_eval_step:
            scores = evaluate(accelerator, recipe, model, eval_loader)
            log.write({"step": step, **scores})
            final.update(scores)
    log.close()
    _save_final(accelerator, recipe, cfg, model, eval_set, run_dir)
    return final


def _accumulate_gradients(
    accelerator: Accelerator, recipe: Recipe, model: torch.nn.Module, batches: Any, plan: BatchPlan, window: Window
) -> int:
    """Run the micro-batches of one optimizer step; gradients are synchronised on the last one only.

    A recipe returning `(loss_sum, num_items)` is back-propagated as a sum and its gradients are divided by
    the item count of the whole step over all micro-batches and processes, which makes a token loss exact on
    any layout (the gradient-accumulation bug class of transformers #34191). Returns the epoch.
    """
    step_items: torch.Tensor | None = None
    for _ in range(plan.accumulation_steps):
        epoch, batch = next(batches)
        with accelerator.accumulate(model):
            output = recipe.compute_loss(model, batch)
            if isinstance(output, tuple):
                loss_sum, num_items = output
                num_items = torch.as_tensor(num_items, device=accelerator.device, dtype=torch.float32)
                step_items = num_items if step_items is None else step_items + num_items
                accelerator.backward(loss_sum)
            else:
                num_items = len(next(iter(batch.values())))
                loss_sum = output.detach() * num_items
                accelerator.backward(output)  # accelerate divides by accumulation_steps
        window.loss_sum += loss_sum.detach().float()
        window.num_items += num_items
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
    accelerator: Accelerator, cfg: TrainConfig, window: Window, step: int, epoch: int, lr: float, grad_norm: Any
) -> dict[str, Any]:
    """Read the window back (the only host synchronisation of a training step) and build a log record."""
    totals = accelerator.reduce(torch.stack([window.loss_sum, window.num_items.float()]), reduction="sum")
    loss_sum, num_items = totals.tolist()
    elapsed = time.perf_counter() - window.started
    return {
        "step": step,
        "epoch": epoch,
        "loss": loss_sum / num_items,
        "lr": lr,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "samples_per_s": window.num_steps * cfg.global_batch_size / elapsed,
        "step_time_s": elapsed / window.num_steps,
        "world_size": accelerator.num_processes,
    }


def evaluate(accelerator: Accelerator, recipe: Recipe, model: torch.nn.Module, loader: Any) -> dict[str, float]:
    """Means of the recipe's per-sample eval metrics over the whole eval set, each sample counted once.

    Metrics are divided by the number of samples, or by the total of a `num_items` entry when the recipe
    returns one (per-sample sums over tokens, giving a token-weighted mean).
    """
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for batch in loader:
            metrics = recipe.eval_metrics(model, batch)
            if "num_items" not in metrics:
                metrics = {**metrics, "num_items": torch.ones(len(next(iter(metrics.values()))))}
            gathered = accelerator.gather_for_metrics({k: v.float().to(accelerator.device) for k, v in metrics.items()})
            for name, values in gathered.items():
                sums[name] = sums.get(name, 0) + values.sum()
    model.train()
    num_items = sums.pop("num_items")
    return {f"eval/{name}": (total / num_items).item() for name, total in sums.items()}


def _save_final(
    accelerator: Accelerator, recipe: Recipe, cfg: TrainConfig, model: torch.nn.Module, eval_set: Any, run_dir: Path
) -> None:
    """Write `final/model.safetensors` (consolidated, unwrapped weights) and the recipe's artifacts.

    The weights are loaded into a freshly built CPU model, which works the same whether the trained model is
    plain, DDP-wrapped or sharded, and which safetensors can save with tied weights.
    """
    from safetensors.torch import save_model

    from .config import config_to_yaml

    state = accelerator.get_state_dict(model)  # a collective under FSDP: every process takes part
    if accelerator.is_main_process:
        final_dir = run_dir / "final"
        final_dir.mkdir(parents=True, exist_ok=True)
        exported = recipe.build_model(cfg)
        exported.load_state_dict({k: v.detach().cpu() for k, v in state.items()})
        save_model(exported, str(final_dir / "model.safetensors"))
        (final_dir / "config.yaml").write_text(config_to_yaml(cfg))
        recipe.write_artifacts(exported.eval(), eval_set, run_dir)
    accelerator.wait_for_everyone()
