"""How fast accel-trainer trains against a plain hand-written PyTorch loop (and plain accelerate), one CPU thread.

    make bench      # OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py; a few minutes on 2 cores

Three workloads (issue 11's targets; docs/benchmarks.md has the figures):
(a) defaults: a tiny MLP, batch 16, each side as a user would write it: the plain loop a `DataLoader` over the
    `datasets.Dataset` (rows stacked by `default_collate`), AdamW, no clipping or schedule; plain accelerate the
    same loop through `Accelerator.prepare` and `accelerator.backward`; accel-trainer its config defaults
    (clipping at 1.0, a cosine schedule, a log record every 10 steps). Target: accel-trainer >= 1.5x the plain
    loop's steps/s.
(b) same work: the tiny MLP, batch 32, with the same data path on both sides (a DataLoader over the columns
    held as tensors, one indexing per batch through `__getitems__`: accel-trainer's batched data path), the same
    clipping, schedule and logging. Target >= 0.97. The plain loop clips with `torch.nn.utils.clip_grad_norm_`;
    accel-trainer runs the same kernels without torch's per-call grouping (accel_trainer/parallel/verbs.py), so a third
    side, the plain loop with that clip, shows what the loop's own bookkeeping costs.
(c) compute-bound: a wide MLP whose steps are tens of milliseconds of matrix work, same work. Target >= 0.99.
(d) in (a), plain accelerate and, when installed (`pip install -e .[bench]`), Lightning at their defaults.
It asserts nothing: it is a measurement.

Method. Separate runs on a small shared machine vary by up to 2x, so the sides run in this one process and
alternate short chunks in rotating order; each round gives one ratio per side against the plain loop, and the
median over rounds is reported. A chunk is a fresh run: building the model, preparing and writing files stay
outside the timed region, and so do the first few steps. One clock, ticked by every side at the start of each
step's loss computation, times the same number of whole steps: data loading, forward, backward, clipping,
optimizer and schedule steps, and the loss read-back on logging steps. The figures are per second of the
process's CPU time, which a busy neighbour inflates less than wall time; the wall-clock ratio is printed beside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import math
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import accelerate
import datasets
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

import accel_trainer as at
from accel_trainer.data.columns import ColumnBatches, already_collated
from accel_trainer.parallel.verbs import clip_one_group

RECIPE_NAME = "benchmark-mlp"


@dataclass
class MLPConfig(at.TrainConfig):
    num_features: int = 64
    """Input features of the synthetic regression data."""
    width: int = 32
    """Width of each hidden layer."""
    num_hidden_layers: int = 2
    """Hidden layers (each Linear + ReLU) before the output layer."""
    num_samples: int = 8192
    """Training samples in the synthetic data set."""
    plain_optimizer: bool = True
    """The plain loop's AdamW (same work); false: accel-trainer's default optimizer (fused AdamW)."""


@dataclass(frozen=True)
class Workload:
    """One benchmark case: its config, the shape of one timed chunk, how many rounds, and the ratio to reach."""

    name: str
    overrides: dict[str, Any]
    num_untimed_steps: int
    """Steps at the start of each chunk left out of the timing (first batches, optimizer state, caches)."""
    num_timed_steps: int
    """A multiple of log_every_steps, so that every chunk times the same number of logging steps."""
    num_pairs: int
    target_ratio: float
    at_defaults: bool = False
    """Each side at its own defaults (plain: row-by-row DataLoader, no clipping or schedule; accel-trainer: its
    config defaults); otherwise every side does the same work, the plain loop on column tensors."""


# The same-work cases: AdamW without weight decay, clipping at norm 1, a cosine schedule without warmup, and
# no NaN/Inf check (a plain loop has none; at its defaults, case (a), accel-trainer pays for its own).
COMMON: dict[str, Any] = dict(
    seed=0, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, lr_schedule="cosine", warmup_steps=0,
    show_progress_bar=False, skip_nonfinite_steps=False,
)  # fmt: skip
WORKLOADS = (
    Workload(
        name="(a) tiny MLP 64-32-32-1, batch 16, each at its defaults",
        overrides=dict(
            num_features=64,
            width=32,
            num_hidden_layers=2,
            num_samples=8192,
            micro_batch_size=16,
            global_batch_size=16,
            log_every_steps=10,
        ),  # fmt: skip
        num_untimed_steps=20,
        num_timed_steps=100,
        num_pairs=60,
        target_ratio=1.5,
        at_defaults=True,
    ),
    Workload(
        name="(b) tiny MLP 64-32-32-1, batch 32, same work",
        overrides=dict(
            num_features=64,
            width=32,
            num_hidden_layers=2,
            num_samples=8192,
            micro_batch_size=32,
            global_batch_size=32,
            log_every_steps=100,
        ),  # fmt: skip
        num_untimed_steps=20,
        num_timed_steps=100,
        num_pairs=60,
        target_ratio=0.97,
    ),
    Workload(
        name="(c) wide MLP 512-1024-1024-1, batch 256, same work",
        overrides=dict(
            num_features=512,
            width=1024,
            num_hidden_layers=2,
            num_samples=4096,
            micro_batch_size=256,
            global_batch_size=256,
            log_every_steps=10,
        ),  # fmt: skip
        num_untimed_steps=2,
        num_timed_steps=10,
        num_pairs=60,  # 30 rounds put the median anywhere in 0.99-1.02 from run to run
        target_ratio=0.99,
    ),
)


@dataclass
class StepClock:
    """Reads wall and CPU time at the start of two given steps; each loop calls `tick()` once per step."""

    start_step: int
    end_step: int
    step: int = 0
    marks: list[tuple[float, float]] = field(default_factory=list)

    def tick(self) -> None:
        self.step += 1
        if self.step in (self.start_step, self.end_step):
            self.marks.append((time.perf_counter(), time.process_time()))

    def seconds(self) -> tuple[float, float]:
        """(wall, CPU) seconds from the first mark to the second."""
        (wall0, cpu0), (wall1, cpu1) = self.marks
        return wall1 - wall0, cpu1 - cpu0


# ---- the shared workload: data, model, optimizer, loss, schedule ----


@functools.cache
def synthetic_dataset(num_samples: int, num_features: int, seed: int = 1234) -> datasets.Dataset:
    """A fixed random regression problem (a noisy linear target), built once per shape."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_samples, num_features), dtype=np.float32)
    y = x @ rng.standard_normal(num_features, dtype=np.float32) + 0.1 * rng.standard_normal(num_samples)
    return datasets.Dataset.from_dict({"x": x, "y": y.astype(np.float32)})


def build_mlp(cfg: MLPConfig) -> nn.Module:
    layers: list[nn.Module] = []
    width_in = cfg.num_features
    for _ in range(cfg.num_hidden_layers):
        layers += [nn.Linear(width_in, cfg.width), nn.ReLU()]
        width_in = cfg.width
    return nn.Sequential(*layers, nn.Linear(width_in, 1))


def build_optimizer(cfg: MLPConfig, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def mse_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])


def cosine_multiplier(max_steps: int) -> Callable[[int], float]:
    return lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step / max_steps, 1.0)))


# ---- (a) the plain loop ----


def endless(loader: DataLoader) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        yield from loader


def batched_loader(dataset: datasets.Dataset, batch_size: int, seed: int) -> DataLoader:
    """A DataLoader that reads each batch with one indexing of the columns held as tensors (through the set's
    `__getitems__`, torch's hook for batched reads): the data path accel-trainer takes for such a set."""
    columns = ColumnBatches(dataset.with_format("torch")[:])
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(columns, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator,
                      collate_fn=already_collated)  # fmt: skip


def plain_seconds(cfg: MLPConfig, clock: StepClock, at_defaults: bool, lean_clip: bool = False) -> tuple[float, float]:
    """Train `cfg.max_steps` steps with a hand-written loop; return the (wall, CPU) seconds `clock` measured.
    `lean_clip`: clip with accel-trainer's one-group clip instead of torch's `clip_grad_norm_`."""
    torch.manual_seed(cfg.seed)
    model = build_mlp(cfg)
    optimizer = build_optimizer(cfg, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_multiplier(cfg.max_steps))
    dataset = synthetic_dataset(cfg.num_samples, cfg.num_features)
    if at_defaults:
        generator = torch.Generator().manual_seed(cfg.seed)
        batches = endless(DataLoader(dataset.with_format("torch"), batch_size=cfg.micro_batch_size, shuffle=True,
                                     drop_last=True, generator=generator))  # fmt: skip
    else:
        batches = endless(batched_loader(dataset, cfg.micro_batch_size, cfg.seed))
    loss_sum, logged_step = torch.zeros(()), 0
    parameters = list(model.parameters())
    model.train()
    for step in range(1, cfg.max_steps + 1):
        batch = next(batches)
        clock.tick()
        loss = mse_loss(model, batch)
        loss.backward()
        if lean_clip:
            clip_one_group(parameters, cfg.max_grad_norm)
        elif not at_defaults:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        if not at_defaults:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        if step % cfg.log_every_steps == 0 or step == cfg.max_steps:
            # The only host read-back, on the same steps as accel-trainer's.
            print(f"step {step} | loss {loss_sum.item() / (step - logged_step):.4g}")
            loss_sum, logged_step = torch.zeros(()), step
    return clock.seconds()


def accelerate_seconds(cfg: MLPConfig, clock: StepClock, at_defaults: bool) -> tuple[float, float]:
    """The plain loop at its defaults, through plain accelerate (`prepare`, `backward`), as its docs show."""
    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(cfg.seed)
    model = build_mlp(cfg)
    optimizer = build_optimizer(cfg, model)
    dataset = synthetic_dataset(cfg.num_samples, cfg.num_features).with_format("torch")
    loader = DataLoader(dataset, batch_size=cfg.micro_batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = endless(loader)
    loss_sum, logged_step = torch.zeros(()), 0
    for step in range(1, cfg.max_steps + 1):
        batch = next(batches)
        clock.tick()
        loss = mse_loss(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        if step % cfg.log_every_steps == 0 or step == cfg.max_steps:
            print(f"step {step} | loss {loss_sum.item() / (step - logged_step):.4g}")
            loss_sum, logged_step = torch.zeros(()), step
    accelerate.state.AcceleratorState._reset_state(True)
    return clock.seconds()


def lightning_seconds(cfg: MLPConfig, clock: StepClock, run_dir: Path) -> tuple[float, float]:
    """The same model and data as a LightningModule, trained by Lightning's `Trainer` at its defaults (its logger
    and checkpointing, `self.log` of the loss; only the progress bar and model summary off: there is no terminal)."""
    import lightning

    for name in ("lightning.pytorch", "lightning.fabric"):  # its tips and device lines on every chunk
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_mlp(cfg)

        def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
            clock.tick()
            loss = mse_loss(self.model, batch)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return build_optimizer(cfg, self.model)

    torch.manual_seed(cfg.seed)
    dataset = synthetic_dataset(cfg.num_samples, cfg.num_features).with_format("torch")
    loader = DataLoader(dataset, batch_size=cfg.micro_batch_size, shuffle=True, drop_last=True)
    trainer = lightning.Trainer(max_steps=cfg.max_steps, accelerator="cpu", devices=1, default_root_dir=run_dir,
                                log_every_n_steps=cfg.log_every_steps, enable_progress_bar=False,
                                enable_model_summary=False)  # fmt: skip
    trainer.fit(Module(), loader)
    shutil.rmtree(run_dir, ignore_errors=True)
    return clock.seconds()


def lightning_installed() -> bool:
    """Lightning is compared when installed (`pip install -e .[bench]`)."""
    try:
        import lightning  # noqa: F401
    except ImportError:
        return False
    return True


# ---- (b) accel-trainer ----


@at.register_recipe(RECIPE_NAME)
class MLPRegression(at.Recipe):
    """The benchmark's MLP on synthetic regression data, with the plain loop's optimizer and clock."""

    Config = MLPConfig
    clock = StepClock(start_step=0, end_step=0)  # replaced by `accel_seconds` before each run

    def build_model(self, cfg: MLPConfig) -> nn.Module:
        return build_mlp(cfg)

    def build_datasets(self, cfg: MLPConfig) -> tuple[datasets.Dataset, None]:
        return synthetic_dataset(cfg.num_samples, cfg.num_features), None

    def build_optimizer(self, cfg: MLPConfig, model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(cfg, model) if cfg.plain_optimizer else super().build_optimizer(cfg, model)

    def compute_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.clock.tick()
        return mse_loss(model, batch)


def accel_seconds(cfg: MLPConfig, clock: StepClock, at_defaults: bool, run_dir: Path) -> tuple[float, float]:
    """Train `cfg.max_steps` steps through `accel_trainer.train`; return the (wall, CPU) seconds measured."""
    MLPRegression.clock = clock
    settings = dataclasses.asdict(cfg)
    if at_defaults:  # only the workload's sizes: every other field at accel-trainer's default
        settings = {k: v for k, v in settings.items() if k in WORKLOADS[0].overrides or k == "max_steps"}
        settings["plain_optimizer"] = False  # the recipe writes no build_optimizer: the framework's default
        settings["show_progress_bar"] = False  # no terminal here; a bar on a terminal costs about nothing
    at.train(RECIPE_NAME, **{**settings, "output_dir": str(run_dir)})
    shutil.rmtree(run_dir)  # each run ends with a checkpoint (25 MB for the wide MLP); keep the disk clear
    return clock.seconds()


# ---- the comparison ----


@dataclass
class Rates:
    """Steps per second of each chunk of one loop, by CPU time and by wall time."""

    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)


def sides(workload: Workload) -> list[str]:
    """(a) and (d): each framework at its defaults, Lightning when installed; otherwise the same work."""
    if not workload.at_defaults:
        return ["plain", "plain, lean clip", "accel-trainer"]
    return ["plain", "accelerate", *(["lightning"] if lightning_installed() else []), "accel-trainer"]


def run_chunk(side: str, workload: Workload, cfg: MLPConfig, run_dir: Path, rates: Rates) -> None:
    start = workload.num_untimed_steps + 1
    clock = StepClock(start_step=start, end_step=start + workload.num_timed_steps)
    with contextlib.redirect_stdout(io.StringIO()):  # every loop prints a line on each logging step
        if side == "plain":
            wall, cpu = plain_seconds(cfg, clock, workload.at_defaults)
        elif side == "plain, lean clip":
            wall, cpu = plain_seconds(cfg, clock, workload.at_defaults, lean_clip=True)
        elif side == "accelerate":
            wall, cpu = accelerate_seconds(cfg, clock, workload.at_defaults)
        elif side == "lightning":
            wall, cpu = lightning_seconds(cfg, clock, run_dir)
        else:
            wall, cpu = accel_seconds(cfg, clock, workload.at_defaults, run_dir)
    rates.cpu.append(workload.num_timed_steps / cpu)
    rates.wall.append(workload.num_timed_steps / wall)


def compare(workload: Workload, out_dir: Path) -> dict[str, Rates]:
    """Time `workload.num_pairs` rounds of one chunk per side, in rotating order; return each side's rates."""
    max_steps = workload.num_untimed_steps + 1 + workload.num_timed_steps  # the last step starts the end mark
    cfg = MLPConfig(**COMMON, **workload.overrides, max_steps=max_steps)
    synthetic_dataset(cfg.num_samples, cfg.num_features)  # built once, outside every timed region
    names = sides(workload)
    rates = {name: Rates() for name in names}
    for round_index in range(workload.num_pairs):
        shift = round_index % len(names)
        for side in names[shift:] + names[:shift]:
            run_chunk(side, workload, cfg, out_dir / f"run{round_index}", rates[side])
    return rates


def ratios(plain: list[float], other: list[float]) -> list[float]:
    return [a / p for p, a in zip(plain, other, strict=True)]


def report(workload: Workload, rates: dict[str, Rates], elapsed_s: float) -> str:
    plain = rates["plain"]
    lines = [f"{workload.name}: {workload.num_pairs} rounds of {workload.num_timed_steps}-step chunks,"
             f" {elapsed_s:.0f} s", f"  plain loop       {statistics.median(plain.cpu):7.1f} steps/s"]  # fmt: skip
    for side in sides(workload)[1:]:
        side_ratios = ratios(plain.cpu, rates[side].cpu)
        low, _, high = statistics.quantiles(side_ratios)
        lines.append(
            f"  {side:<16} {statistics.median(rates[side].cpu):7.1f} steps/s, x{statistics.median(side_ratios):.3f}"
            f" the plain loop (middle half {low:.3f}-{high:.3f}; wall clock"
            f" x{statistics.median(ratios(plain.wall, rates[side].wall)):.3f})"
        )
    ratio = statistics.median(ratios(plain.cpu, rates["accel-trainer"].cpu))
    verdict = "met" if ratio >= workload.target_ratio else "NOT met"
    lines.append(f"  target           accel-trainer >= {workload.target_ratio:.2f}x: {verdict}")
    return "\n".join(lines)


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, accelerate {accelerate.__version__}, {torch.get_num_threads()} thread;")
    print("steps/s are per second of CPU time, medians over chunks\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for index, workload in enumerate(WORKLOADS):
            started = time.perf_counter()
            rates = compare(workload, Path(tmp) / str(index))
            print(report(workload, rates, time.perf_counter() - started), flush=True)


if __name__ == "__main__":
    main()
