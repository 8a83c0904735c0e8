"""How a launch becomes a mesh (parallel/mesh.py), and how a recipe's tp_plan is checked and applied
(parallel/tensor_parallel.py).

The layouts themselves train in test_model_parallel.py; these are the in-process rules and error messages,
and the canaries of the accelerate behaviour launch_fixes.attach_mesh works around.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, ParallelismConfig
from torch import nn
from torch.distributed.tensor import DTensor

import accel_trainer as at
from accel_trainer import ConfigError, LayoutError
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.parallel import launch_fixes
from accel_trainer.parallel.accelerator import data_parallel_size_on_layout, settings_on_layout
from accel_trainer.parallel.layout_file import read_layout
from accel_trainer.parallel.mesh import MeshShape, mesh_shape
from accel_trainer.parallel.tensor_parallel import _check_sequence_lengths, apply_tensor_parallel, check_tp_plan
from conftest import launcher_sizes, one_process_mesh


@pytest.mark.parametrize(
    ("layout", "data_parallel"),
    [("cpu", 1), ("cpu_ddp", 2), ("cpu_fsdp", 2), ("cpu_tp", 1), ("cpu_fsdp_tp", 2), ("cpu_hsdp", 4), ("cpu_pp", 1),
     ("cpu_pp_fsdp", 2), ("2node_cpu", 2)],
)  # fmt: skip
def test_the_launching_process_knows_each_layout_s_data_parallel_ranks_before_any_starts(layout, data_parallel):
    """What the run's batch plan divides by, checked once before the layout's processes start (training.py): the
    figures the processes themselves find (test_model_parallel.py, test_pipeline.py)."""
    spec = read_layout(layout)
    _, settings = settings_on_layout(at.TrainConfig, spec, None, {})
    assert data_parallel_size_on_layout(settings, spec) == data_parallel


@pytest.mark.parametrize(
    ("tp_size", "sizes", "world", "fsdp", "expected"),
    [
        (2, {}, 2, False, MeshShape(tp=2)),  # cpu_tp.yaml: tp_size from the settings file
        (1, {"dp_shard": 2, "tp": 2}, 4, True, MeshShape(dp_shard=2, tp=2)),  # cpu_fsdp_tp.yaml
        (1, {"dp_replicate": 2, "dp_shard": 2}, 4, True, MeshShape(dp_replicate=2, dp_shard=2)),  # cpu_hsdp.yaml
        (2, {"dp_shard": 4, "tp": 2}, 8, True, MeshShape(dp_shard=4, tp=2)),  # the same tp in both places
        (1, {}, 2, True, MeshShape(dp_shard=2)),  # plain FSDP: accelerate's own layout, no mesh of ours
    ],
)
def test_a_launch_becomes_a_mesh_of_data_parallel_and_tensor_parallel_ranks(monkeypatch, tp_size, sizes, world,
                                                                              fsdp, expected):  # fmt: skip
    if sizes:
        launcher_sizes(monkeypatch, **sizes)
    shape = mesh_shape(LayoutSettings(tp_size=tp_size), world, fsdp)
    assert shape == expected
    assert shape.needs_mesh == (expected.tp > 1 or expected.dp_replicate > 1)


@pytest.mark.parametrize(
    ("tp_size", "sizes", "world", "fsdp", "message"),
    [
        (2, {}, 4, False, "needs FSDP for the data-parallel dimension"),
        (3, {}, 4, False, "cannot be split into tp_size=3"),
        (2, {"dp_shard": 2, "tp": 4}, 8, True, "disagrees with parallelism_config_tp_size=4"),
        (1, {"dp_shard": 1, "tp": 2}, 2, True, "leaves FSDP nothing to shard over"),
        (1, {"dp_shard": 2, "tp": 2}, 8, True, "parallelism_config_dp_shard_size=2"),
        (1, {"dp_shard": 2, "cp": 2}, 4, True, "context parallelism needs CUDA GPUs"),
        (1, {"sp": 2}, 2, True, "parallelism_config_sp_size > 1"),
        (0, {}, 2, False, "tp_size=0"),
    ],
)
def test_a_mesh_that_does_not_fit_the_launch_is_a_one_line_error(monkeypatch, tp_size, sizes, world, fsdp,
                                                                 message):  # fmt: skip
    if sizes:
        launcher_sizes(monkeypatch, **sizes)
    with pytest.raises(LayoutError, match=message):
        mesh_shape(LayoutSettings(tp_size=tp_size), world, fsdp)


def test_canary_accelerate_refuses_a_parallelism_config_on_a_cpu_launch():
    """Why attach_mesh hands the mesh over after construction: under MULTI_CPU (what a CPU FSDP launch is until
    enable_fsdp_on_cpu) accelerate 1.15 refuses any mesh. When this stops raising, the detour can go."""
    cpu_launch = SimpleNamespace(multi_device=False, num_processes=4, is_fsdp2=False, is_main_process=True,
                                 distributed_type=DistributedType.MULTI_CPU)  # fmt: skip
    with pytest.raises(ValueError, match="only compatible"):
        ParallelismConfig(dp_shard_size=2, tp_size=2)._validate_accelerator(cpu_launch)


def test_canary_accelerates_own_tensor_parallel_step_is_for_transformers_models():
    """Why the FSDP mesh config reports TP as done: accelerate's TP step imports transformers under FSDP2."""
    assert "from transformers" in inspect.getsource(Accelerator._prepare_tp)


def test_the_config_handed_to_accelerate_under_fsdp_hides_tp_from_prepare_but_not_from_the_data_path():
    config = launch_fixes._FsdpMesh(dp_shard_size=2, tp_size=2)
    assert not config.tp_enabled and config.tp_size == 2
    assert "tp" not in config._get_mesh()[0]  # why attach_mesh builds the mesh with a plain ParallelismConfig
    assert "tp" in ParallelismConfig(dp_shard_size=2, tp_size=2)._get_mesh()[0]


@pytest.fixture
def tp_mesh():
    """A 1-process tensor-parallel mesh: enough to check and apply a plan (the splitting is tested on 2)."""
    with one_process_mesh("tp") as mesh:
        yield mesh


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids):
        return self.head(self.norm(self.down(self.up(self.embedding(ids)))))


PLAN = {"embedding": "embedding", "norm": "sequence_parallel", "up": "colwise", "down": "rowwise",
        "head": "colwise_gather_output"}  # fmt: skip


def test_a_plan_is_applied_with_tied_weights_tied_again(tp_mesh):
    model = TinyLM()
    apply_tensor_parallel(model, PLAN, tp_mesh)
    assert model.head.weight is model.embedding.weight
    assert all(isinstance(parameter, DTensor) for parameter in model.parameters())
    assert model(torch.randint(0, 10, (2, 4))).shape == (2, 4, 10)


def test_modules_a_plan_without_sequence_parallelism_leaves_alone_get_replicated_parameters(tp_mesh):
    model = TinyLM()
    apply_tensor_parallel(model, {"embedding": "embedding", "up": "colwise", "down": "rowwise",
                                  "head": "colwise_gather_output"}, tp_mesh)  # fmt: skip
    assert isinstance(model.norm.weight, DTensor) and model.norm.weight.placements[0].is_replicate()
    output = model(torch.randint(0, 10, (2, 4)))
    assert not isinstance(output, DTensor)  # the recipe's loss sees plain tensors


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({}, "has no tp_plan"),
        ({**PLAN, "up": "diagonal"}, "'diagonal' is not one of"),
        ({**PLAN, "blocks.*.up": "colwise"}, "'blocks.*.up' matches no module of TinyLM"),
        ({key: style for key, style in PLAN.items() if key != "norm"} | {"up": "sequence_parallel"},
         'norm \\(LayerNorm\\) has none: give it "sequence_parallel"'),
        ({key: style for key, style in PLAN.items() if key != "embedding"},
         'embedding \\(Embedding\\) has none: give it "embedding"'),
        ({**PLAN, "head": "rowwise"}, "are tied but tp_plan splits them differently"),
    ],
)  # fmt: skip
def test_a_plan_that_cannot_be_applied_is_a_one_line_error(tp_mesh, plan, message):
    with pytest.raises(ConfigError, match=message):
        apply_tensor_parallel(TinyLM(), plan, tp_mesh)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({**PLAN, "up": "diagonal"}, "'diagonal' is not one of"),
        ({**PLAN, "blocks.*.up": "colwise"}, "'blocks.*.up' matches no module of TinyLM"),
        ({key: style for key, style in PLAN.items() if key != "down"},
         'down \\(Linear\\) has none: give it "colwise"'),
    ],
)  # fmt: skip
def test_a_plan_is_checked_without_a_mesh_so_its_mistakes_show_on_one_process(plan, message):
    assert [name for name, _, _ in check_tp_plan(TinyLM(), PLAN)] == list(PLAN)
    with pytest.raises(ConfigError, match=message):
        check_tp_plan(TinyLM(), plan)


def test_a_one_process_run_warns_about_a_plan_that_names_no_module(tmp_path):
    @at.register_recipe("mistyped_tp_plan")
    class MistypedPlan(at.get_recipe("gpt")):
        tp_plan = {**at.get_recipe("gpt").tp_plan, "blocks.*.attn.q": "colwise"}

    with pytest.warns(UserWarning, match="'blocks.\\*.attn.q' matches no module of GPT .it matters on a tensor-par"):
        at.train("mistyped_tp_plan", output_dir=str(tmp_path), max_steps=1, n_layer=1, d_model=32, block_size=32,
                 max_source_bytes=100_000, eval_every_steps=0, show_progress_bar=False, report=False)  # fmt: skip


def test_sequence_parallelism_refuses_a_batch_whose_length_it_cannot_split():
    check = _check_sequence_lengths(tp_size=2)
    check(nn.Identity(), (torch.zeros(3, 8),), {})
    with pytest.raises(ConfigError, match="length 5: pad batches to a multiple of 2"):
        check(nn.Identity(), (torch.zeros(3, 5),), {})
