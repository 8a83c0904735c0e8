"""Ray Train: a recipe trained by the workers of a `TorchTrainer`, each calling `at.train`.

    pip install "accel-trainer[ray]"
    python deploy/ray/train_recipe.py gpt layout=cpu_fsdp output_dir=/shared/runs/gpt max_steps=500

Ray starts the workers and their process group (RANK, WORLD_SIZE, MASTER_ADDR, ... as torchrun would); `layout=`
gives them the rest of the accelerate config (FSDP, HSDP, TP, precision, the settings companion) in each worker
(parallel/layout_file.py), and the worker count is the layout's process count. With GPUs, name a GPU layout and
pass `--gpu`. On a Ray cluster, output_dir must be on storage every node mounts; Ray's own results go to
`storage_path` (here the run folder's `ray/`). tests/processes/test_cluster_engines.py trains it on 2 CPU workers
and gets the weights of one process.

Ray Train patches `print` in its workers to copy each line to its logger, even lines a library captured on
purpose: `datasets` (through dill) disassembles the recipe's map functions into a captured stdout to fingerprint
them, and every worker then logs pages of bytecode. RAY_TRAIN_ENABLE_PRINT_PATCH=0 keeps print as it is.

Ray starts its workers (the training workers and Ray Train's controller) at niceness 15: on a machine that also
runs anything else at the usual niceness 0 they get next to no CPU, and Ray Train's own timeouts (resource
requests, the worker group's start) then loop without end (a local 2-worker run on a 2-core machine with 4 busy
processes beside it never started training in 6 minutes; with RAY_worker_niceness=0 it ended in 92 s). The local
cluster this script starts runs its workers at niceness 0, as Ray's own job supervisor does for its drivers; on a
cluster started with `ray start`, set RAY_worker_niceness=0 there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import accel_trainer as at
from accel_trainer.parallel.layout_file import read_layout


def train_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: its share of the run, as a worker of `accelerate launch --config_file LAYOUT`."""
    result = at.train(config["recipe"], layout=config["layout"], **config["overrides"])
    if ray.train.get_context().get_world_rank() == 0:
        print(f"run folder: {result.run_dir} (step {result.metrics.get('step')})")


def train_on_ray(recipe: str, layout: str, *, use_gpu: bool = False, **overrides: Any) -> None:
    """Train `recipe` on the layout's processes as Ray Train workers."""
    num_workers = read_layout(layout).num_processes
    output_dir = Path(overrides.get("output_dir") or "outputs").resolve()
    os.environ.setdefault("RAY_worker_niceness", "0")  # read by the local cluster ray.init starts
    ray.init(runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}}, include_dashboard=False)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"recipe": recipe, "layout": layout, "overrides": overrides},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=RunConfig(storage_path=str(output_dir / "ray"), name=recipe),
    )
    trainer.fit()


def main(words: list[str]) -> None:
    if not words or words[0].startswith("-") or not any(word.startswith("layout=") for word in words):
        raise SystemExit("usage: python deploy/ray/train_recipe.py RECIPE layout=LAYOUT [--gpu] [key=value ...]")
    overrides = dict(word.split("=", 1) for word in words[1:] if word != "--gpu")
    layout = overrides.pop("layout")
    train_on_ray(words[0], layout, use_gpu="--gpu" in words, **overrides)


if __name__ == "__main__":
    main(sys.argv[1:])
