"""Context parallelism: each process of a cp group takes a slice of every sequence (GPU layouts only).

On the CPU, what can be proven without a ring-attention kernel is proven: the mesh and data ranks the cp
dimension gives, the one-line errors (a CPU launch, no `sequence_dims`, a length the group cannot split, a mean
loss), and, on a model without attention (the GPT with n_layer=0), a 2-process run whose processes each see
half of every sequence and still follow the one-process trajectory: the same gradient norms and losses, and
the same items counted (which a run that did not slice would count twice). The GPT with attention on CUDA GPUs
is tests/layouts/test_gpu.py's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import ParallelismConfig

from accel_trainer import ConfigError, LayoutError
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.parallel.context_parallel import check_loss_counts_items, sequence_buffers
from accel_trainer.parallel.mesh import MeshShape, data_ranks, mesh_shape
from conftest import (
    TWO_PROCESS_CP_LAYOUT,
    WORKERS,
    accelerate_launch,
    dump_env,
    launcher_sizes,
    read_metrics,
    train_and_dump,
)


def test_a_cp_layout_on_cuda_gives_fsdp_the_cp_processes_too(monkeypatch):
    launcher_sizes(monkeypatch, dp_shard=4, cp=2)
    assert mesh_shape(LayoutSettings(), 8, True, "cuda") == MeshShape(dp_shard=4, cp=2)
    launcher_sizes(monkeypatch, dp_shard=1, cp=2)
    assert mesh_shape(LayoutSettings(), 2, True, "cuda") == MeshShape(dp_shard=1, cp=2)


@pytest.mark.parametrize(
    ("device", "fsdp", "settings", "message"),
    [("cpu", True, {}, "context parallelism needs CUDA GPUs"), ("cuda", False, {}, "runs on FSDP2 layouts"),
     ("cuda", True, {"tp_size": 2}, "without tensor or pipeline parallelism")],
)  # fmt: skip
def test_a_cp_layout_that_cannot_run_is_a_one_line_error(monkeypatch, device, fsdp, settings, message):
    launcher_sizes(monkeypatch, dp_shard=2, cp=2)
    with pytest.raises(LayoutError, match=message):
        mesh_shape(LayoutSettings(**settings), 4, fsdp, device)


def test_the_processes_of_a_cp_group_form_one_data_parallel_rank():
    config = ParallelismConfig(dp_shard_size=2, cp_size=2)
    ranks = [data_ranks(SimpleNamespace(parallelism_config=config, num_processes=4, process_index=index))
             for index in range(4)]  # fmt: skip
    assert [r.rank for r in ranks] == [0, 0, 1, 1]
    assert {(r.size, r.replicas, r.context_parallel) for r in ranks} == {(2, 1, 2)}


class SequenceRecipe:
    sequence_dims = {"input_ids": 1, "positions": 1}


def test_the_recipe_names_the_tensors_to_slice_and_their_sequence_dimension():
    batch = {"input_ids": torch.zeros(2, 8), "positions": torch.zeros(2, 8), "mask": torch.ones(2)}
    buffers, dims = sequence_buffers(SequenceRecipe(), batch, cp=2)
    assert [b is batch[k] for b, k in zip(buffers, ["input_ids", "positions"], strict=True)] == [True, True]
    assert dims == [1, 1]


@pytest.mark.parametrize(
    ("recipe", "batch", "message"),
    [(object(), {"input_ids": torch.zeros(2, 8)}, "has no sequence_dims"),
     (SequenceRecipe(), {"input_ids": torch.zeros(2, 8)}, r"names \['input_ids', 'positions'\], but the batch holds"),
     (SequenceRecipe(), {"input_ids": torch.zeros(2, 6), "positions": torch.zeros(2, 6)}, "pad sequences to a"
      " multiple of 4")],
)  # fmt: skip
def test_what_context_parallelism_cannot_slice_is_a_one_line_error(recipe, batch, message):
    with pytest.raises(ConfigError, match=message):
        sequence_buffers(recipe, batch, cp=2)


def test_a_mean_loss_under_context_parallelism_is_a_one_line_error():
    check_loss_counts_items(None, SequenceRecipe(), cp=1)  # no context parallelism: any loss
    check_loss_counts_items(torch.tensor(3.0), SequenceRecipe(), cp=2)
    with pytest.raises(ConfigError, match="needs SequenceRecipe.compute_loss to return a token loss"):
        check_loss_counts_items(None, SequenceRecipe(), cp=2)


NO_ATTENTION_GPT = ["n_layer=0", "max_steps=6", "d_model=32", "block_size=32", "global_batch_size=8",
                    "micro_batch_size=4", "log_every_steps=1", "eval_every_steps=3",
                    "max_source_bytes=100000"]  # fmt: skip


@pytest.mark.multiprocess
def test_two_cp_processes_each_see_half_of_every_sequence_and_follow_the_one_process_trajectory(tmp_path):
    (tmp_path / "cpu_fsdp_cp.yaml").write_text(TWO_PROCESS_CP_LAYOUT)
    one = train_and_dump("cpu", tmp_path / "one", "gpt", *NO_ATTENTION_GPT, world_size=1)
    out = tmp_path / "cp"
    accelerate_launch(str(tmp_path / "cpu_fsdp_cp"), WORKERS / "context_parallel_on_cpu.py", "gpt",
                      f"output_dir={out}", *NO_ATTENTION_GPT, env=dump_env(out, 2))  # fmt: skip
    sliced = read_metrics(out)
    for key in ("loss", "grad_norm", "eval/loss"):
        got, want = ([r[key] for r in records if key in r] for records in (sliced, one))
        assert len(got) == len(want) > 0 and got == pytest.approx(want, rel=1e-5), key
    # Counted over the slices: a run whose processes each saw whole sequences would count every item twice.
    assert [r["items_seen"] for r in sliced if "items_seen" in r] == [r["items_seen"] for r in one if "items_seen" in r]
