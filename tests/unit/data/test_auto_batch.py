"""micro_batch_size=auto: halve the micro-batch until one fits, keep the global batch, leave no trace.

The `tight_memory` test recipe (tests/workers/recipes) raises the CUDA out-of-memory error for micro-batches
above `fits_up_to` samples, after its forward pass has moved the BatchNorm statistics, so the search and its
clean-up run on the CPU; tests/layouts/test_gpu.py runs it into a real out-of-memory on a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import accel_trainer as at
from accel_trainer import ConfigError
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.data.auto_batch import check_auto_layout
from accel_trainer.data.batching import halved_micro_batch, per_process_batch
from accel_trainer.parallel.mesh import DataRanks
from conftest import WORKERS, final_parameters, read_metrics, reset_accelerate_state, train_and_dump

QUICK = dict(
    max_steps=6, log_every_steps=1, eval_every_steps=0, global_batch_size=16, show_progress_bar=False, report=False
)


@pytest.fixture(autouse=True, scope="module")
def test_recipes():
    at.registry.discover_recipes([WORKERS / "recipes"])


def halvings(per_process: int) -> list[int]:
    sizes = [per_process]
    while sizes[-1]:
        sizes.append(halved_micro_batch(per_process, sizes[-1]))
    return sizes[:-1]


def test_each_try_halves_to_a_divisor_so_the_accumulation_steps_stay_whole():
    assert halvings(24) == [24, 12, 6, 3, 1]
    assert halvings(20) == [20, 10, 5, 2, 1]
    assert halvings(18) == [18, 9, 3, 1]  # 4 does not divide 18: 3 does
    assert halvings(7) == [7, 1]
    assert per_process_batch(64, 2) == 32
    with pytest.raises(ConfigError, match="not a multiple"):
        per_process_batch(30, 4)


def test_auto_finds_the_largest_that_fits_and_trains_bitwise_like_that_size_set_by_hand(tmp_path, capsys):
    at.train("tight_memory", micro_batch_size="auto", fits_up_to=5, output_dir=str(tmp_path / "auto"), **QUICK)
    assert "micro_batch_size=auto: 4 of 16 samples per process fit in one pass" in capsys.readouterr().out
    reset_accelerate_state()
    at.train("tight_memory", micro_batch_size=4, fits_up_to=5, output_dir=str(tmp_path / "by_hand"), **QUICK)

    auto, by_hand = final_parameters(tmp_path / "auto"), final_parameters(tmp_path / "by_hand")
    assert all(torch.equal(auto[k], by_hand[k]) for k in by_hand)  # the tries left no trace (BatchNorm stats)
    # That micro-batches with accumulation follow the whole batch's trajectory is the accumulation property
    # (tests/layouts/test_layout_equivalence.py); BatchNorm, like this model's, normalises over each micro-batch,
    # auto or not.
    assert (tmp_path / "auto" / "config.yaml").read_text().count("micro_batch_size: auto") == 1


def test_auto_where_one_sample_does_not_fit_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="not even one sample fits"):
        at.train("tight_memory", micro_batch_size="auto", fits_up_to=0, output_dir=str(tmp_path), **QUICK)


@pytest.mark.parametrize(
    "where",
    [dict(is_fsdp2=True), dict(tp_size=2), dict(pp_size=2), dict(context_parallel=2)],
    ids=["fsdp", "tensor_parallel", "pipeline", "context_parallel"],
)  # fmt: skip
def test_auto_is_refused_where_an_unsharded_probe_cannot_measure_the_run(where):
    accelerator = SimpleNamespace(is_fsdp2=where.get("is_fsdp2", False))
    layout = LayoutSettings(tp_size=where.get("tp_size", 1), pp_size=where.get("pp_size", 1))
    ranks = DataRanks(rank=0, size=1, replicas=1, context_parallel=where.get("context_parallel", 1))
    kind = {"is_fsdp2": "an FSDP", "tp_size": "a tensor-parallel", "pp_size": "a pipeline",
            "context_parallel": "a context-parallel"}[next(iter(where))]  # fmt: skip
    with pytest.raises(ConfigError, match=f"micro_batch_size=auto on {kind} layout: auto probes an unsharded copy"):
        check_auto_layout(accelerator, layout, ranks)


@pytest.mark.multiprocess
def test_on_two_processes_every_process_takes_the_size_the_tightest_one_fits(tmp_path):
    overrides = [f"{k}={v}" for k, v in QUICK.items()]
    auto = train_and_dump("cpu_ddp", tmp_path / "auto", "tight_memory", *overrides, "micro_batch_size=auto",
                          "fits_up_to=2", "tight_rank=1", world_size=2)  # fmt: skip
    by_hand = train_and_dump("cpu_ddp", tmp_path / "by_hand", "tight_memory", *overrides, "micro_batch_size=2",
                             world_size=2)  # fmt: skip

    assert [r["loss"] for r in auto if "loss" in r] == [r["loss"] for r in by_hand if "loss" in r]
    first, second = final_parameters(tmp_path / "auto"), final_parameters(tmp_path / "by_hand")
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert len(read_metrics(tmp_path / "auto")) == len(auto)
