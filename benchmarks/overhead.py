"""How much slower accel-trainer trains than a plain hand-written PyTorch loop, on one CPU thread.

    make bench      # OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py; 1-3 minutes on 2 cores

The same model, data, batch, optimizer, clipping, LR schedule and logging cadence go through (a) a plain loop
(DataLoader, AdamW, zero_grad / backward / clip / step, LambdaLR, no accelerate) and (b) `accel_trainer.train`
with the recipe registered below. Two workloads: a tiny MLP, whose steps are mostly per-step overhead, and a
wide MLP, whose steps are tens of milliseconds of matrix work. For each, it prints the steps/s of both loops,
the median accel/plain ratio and whether the target ratio is met. It asserts nothing: it is a measurement.

Method (docs/benchmarks.md has the details and the figures). Separate runs on a small shared machine vary by
up to 2x, so both loops run in this one process and alternate short chunks, plain-accel then accel-plain;
each adjacent pair gives one accel/plain ratio and the median over all pairs is reported. A chunk is a fresh
run: building the model, preparing and writing files stay outside the timed region, and so do the first few
steps. One clock, ticked by both loops at the start of each step's loss computation, then times the same
number of whole steps: data loading, forward, backward, clipping, optimizer and schedule steps, and the loss
read-back on logging steps. The figures are per second of the process's CPU time, which a busy neighbour
inflates less than wall time; the wall-clock ratio is printed beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import shutil
import statistics
import tempfile
import time
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


@dataclass(frozen=True)
class Workload:
    """One benchmark case: its config, the shape of one timed chunk, how many pairs, and the ratio to reach."""

    name: str
    overrides: dict[str, Any]
    num_untimed_steps: int
    """Steps at the start of each chunk left out of the timing (first batches, optimizer state, caches)."""
    num_timed_steps: int
    """A multiple of log_every_steps, so that every chunk times the same number of logging steps."""
    num_pairs: int
    target_ratio: float


# Both loops: AdamW without weight decay, clipping at norm 1, a cosine schedule without warmup.
COMMON: dict[str, Any] = dict(
    seed=0, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, lr_schedule="cosine", warmup_steps=0,
    show_progress_bar=False,
)  # fmt: skip
WORKLOADS = (
    Workload(
        name="tiny MLP 64-32-32-1, batch 32",
        overrides=dict(
            num_features=64,
            width=32,
            num_hidden_layers=2,
            num_samples=8192,
            micro_batch_size=32,
            global_batch_size=32,
            log_every_steps=100,
        ),
        num_untimed_steps=20,
        num_timed_steps=100,
        num_pairs=120,
        target_ratio=0.90,
    ),
    Workload(
        name="wide MLP 512-1024-1024-1, batch 256",
        overrides=dict(
            num_features=512,
            width=1024,
            num_hidden_layers=2,
            num_samples=4096,
            micro_batch_size=256,
            global_batch_size=256,
            log_every_steps=10,
        ),
        num_untimed_steps=2,
        num_timed_steps=10,
        num_pairs=30,
        target_ratio=0.97,
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


def plain_seconds(cfg: MLPConfig, clock: StepClock) -> tuple[float, float]:
    """Train `cfg.max_steps` steps with a hand-written loop; return the (wall, CPU) seconds `clock` measured."""
    torch.manual_seed(cfg.seed)
    model = build_mlp(cfg)
    optimizer = build_optimizer(cfg, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_multiplier(cfg.max_steps))
    dataset = synthetic_dataset(cfg.num_samples, cfg.num_features).with_format("torch")
    generator = torch.Generator().manual_seed(cfg.seed)
    loader = DataLoader(dataset, batch_size=cfg.micro_batch_size, shuffle=True, drop_last=True, generator=generator)
    batches = endless(loader)
    loss_sum, logged_step = torch.zeros(()), 0
    model.train()
    for step in range(1, cfg.max_steps + 1):
        batch = next(batches)
        clock.tick()
        loss = mse_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        if step % cfg.log_every_steps == 0 or step == cfg.max_steps:
            # The only host read-back, on the same steps as accel-trainer's.
            print(f"step {step} | loss {loss_sum.item() / (step - logged_step):.4g}")
            loss_sum, logged_step = torch.zeros(()), step
    return clock.seconds()


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
        return build_optimizer(cfg, model)

    def compute_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.clock.tick()
        return mse_loss(model, batch)


def accel_seconds(cfg: MLPConfig, clock: StepClock, run_dir: Path) -> tuple[float, float]:
    """Train `cfg.max_steps` steps through `accel_trainer.train`; return the (wall, CPU) seconds measured."""
    MLPRegression.clock = clock
    at.train(RECIPE_NAME, **{**dataclasses.asdict(cfg), "output_dir": str(run_dir)})
    shutil.rmtree(run_dir)  # each run ends with a checkpoint (25 MB for the wide MLP); keep the disk clear
    return clock.seconds()


# ---- the comparison ----


@dataclass
class Rates:
    """Steps per second of each chunk of one loop, by CPU time and by wall time."""

    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)


def run_chunk(side: str, workload: Workload, cfg: MLPConfig, run_dir: Path, rates: Rates) -> None:
    start = workload.num_untimed_steps + 1
    clock = StepClock(start_step=start, end_step=start + workload.num_timed_steps)
    with contextlib.redirect_stdout(io.StringIO()):  # both loops print a line on each logging step
        wall, cpu = plain_seconds(cfg, clock) if side == "plain" else accel_seconds(cfg, clock, run_dir)
    rates.cpu.append(workload.num_timed_steps / cpu)
    rates.wall.append(workload.num_timed_steps / wall)


def compare(workload: Workload, out_dir: Path) -> tuple[Rates, Rates]:
    """Time `workload.num_pairs` pairs of chunks, the first loop alternating; return (plain, accel) rates."""
    max_steps = workload.num_untimed_steps + 1 + workload.num_timed_steps  # the last step starts the end mark
    cfg = MLPConfig(**COMMON, **workload.overrides, max_steps=max_steps)
    synthetic_dataset(cfg.num_samples, cfg.num_features)  # built once, outside every timed region
    plain, accel = Rates(), Rates()
    for pair in range(workload.num_pairs):
        for side in ("plain", "accel") if pair % 2 == 0 else ("accel", "plain"):
            run_chunk(side, workload, cfg, out_dir / f"run{pair}", plain if side == "plain" else accel)
    return plain, accel


def ratios(plain: list[float], accel: list[float]) -> list[float]:
    return [a / p for p, a in zip(plain, accel, strict=True)]


def report(workload: Workload, plain: Rates, accel: Rates, elapsed_s: float) -> str:
    cpu_ratios = ratios(plain.cpu, accel.cpu)
    ratio = statistics.median(cpu_ratios)
    low, _, high = statistics.quantiles(cpu_ratios)
    verdict = "met" if ratio >= workload.target_ratio else "NOT met"
    return "\n".join(
        [
            f"{workload.name}: {workload.num_pairs} pairs of {workload.num_timed_steps}-step chunks, {elapsed_s:.0f} s",
            f"  plain          {statistics.median(plain.cpu):7.1f} steps/s",
            f"  accel-trainer  {statistics.median(accel.cpu):7.1f} steps/s",
            f"  accel/plain    {ratio:7.3f}  median of {workload.num_pairs} pair ratios,"
            f" middle half {low:.3f}-{high:.3f}",
            f"  target         >= {workload.target_ratio:.2f}: {verdict}",
            f"  wall clock     {statistics.median(plain.wall):.1f} and {statistics.median(accel.wall):.1f} steps/s,"
            f" accel/plain {statistics.median(ratios(plain.wall, accel.wall)):.3f}",
        ]
    )


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, accelerate {accelerate.__version__}, {torch.get_num_threads()} thread;")
    print("steps/s are per second of CPU time, medians over chunks\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for index, workload in enumerate(WORKLOADS):
            started = time.perf_counter()
            plain, accel = compare(workload, Path(tmp) / str(index))
            print(report(workload, plain, accel, time.perf_counter() - started), flush=True)


if __name__ == "__main__":
    main()
