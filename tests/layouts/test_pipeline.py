"""Pipeline parallelism on the CPU: a recipe's model cut into stages, one process each, on every schedule.

{1 process} = {PP 2: GPipe, 1F1B, Interleaved1F1B, LoopedBFS}, for the variable-length token-loss GPT (its LM
head tied to the embedding on the other stage: gradients summed between them) and a mean-loss MLP split by its
`pipeline_split`: gradient norm and loss of every step within 1e-6 (relative), weights after 10 AdamW steps
within 1e-4, items counted once, and each process training only its stages' weights. A pipeline checkpoint is
sharded, resumes bitwise on its layout, continues on one process and from one, and exports to the run's own
weights. The in-process tests below pin the split rules, the optimizer-state bookkeeping and the torch and
accelerate behaviour the pipeline works around.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from accelerate import data_loader
from safetensors.torch import load_file
from torch import nn
from torch.distributed.pipelining import _IR as pipelining_ir
from torch.distributed.pipelining import SplitPoint

from accel_trainer import ConfigError, LayoutError, RecipeError
from accel_trainer.checkpoint.pipeline_state import merge_optimizer_skeletons, restrict_optimizer_skeleton
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.parallel.mesh import MeshShape, mesh_shape
from accel_trainer.parallel.pipeline.recipe_calls import StageOutput
from accel_trainer.parallel.pipeline.split import (
    local_view,
    split_spec,
    stages_of_process,
    tied_groups,
    traced_pipeline,
)
from conftest import (
    PIPELINE_RECIPES,
    PIPELINE_STEPS,
    PIPELINE_WEIGHTS,
    assert_same_trajectory,
    checkpoint,
    export_checkpoint,
    final_parameters,
    rank_summary,
    read_metrics,
    train_and_dump,
    train_records,
    trajectory,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.linear(x)


class Stack(nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids):
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BlockRecipe:
    wrap_classes = (Block,)
    pipeline_split = ()


@pytest.mark.parametrize(
    ("depth", "stages", "begins"),
    [
        (2, 2, ["blocks.1"]),
        (3, 4, ["blocks.0", "blocks.1", "blocks.2"]),
        (6, 2, ["blocks.3"]),
        (6, 4, ["blocks.1", "blocks.3", "blocks.5"]),
    ],
)
def test_blocks_are_spread_evenly_with_the_input_and_output_layers_counted_as_blocks(depth, stages, begins):
    assert split_spec(Stack(depth), BlockRecipe(), stages) == dict.fromkeys(begins, SplitPoint.BEGINNING)


@pytest.mark.parametrize(
    ("recipe_split", "wrap", "stages", "message"),
    [
        ((), (Block,), 4, "2 blocks, too few for 4 pipeline stages"),
        ((), (), 2, "give the recipe wrap_classes"),
        (("blocks.7",), (Block,), 2, "'blocks.7', which is not a module of Stack"),
        (("blocks.1",), (Block,), 3, "names 1 boundaries, but this layout has 3 pipeline stages"),
    ],
)
def test_a_model_the_pipeline_cannot_cut_is_a_one_line_error(recipe_split, wrap, stages, message):
    recipe = type("R", (), {"wrap_classes": wrap, "pipeline_split": recipe_split})()
    with pytest.raises(ConfigError, match=message):
        split_spec(Stack(2), recipe, stages)


def test_looped_schedules_give_each_process_every_pth_stage():
    assert [stages_of_process(p, 2, 4) for p in (0, 1)] == [[0, 2], [1, 3]]
    assert stages_of_process(1, 2, 2) == [1]


def test_a_process_keeps_only_its_stages_weights_under_the_models_own_names():
    model = Stack(2)
    view = local_view(model, {"blocks.1.linear.weight", "blocks.1.linear.bias", "head.weight"})
    assert list(view.state_dict()) == ["blocks.1.linear.weight", "blocks.1.linear.bias", "head.weight"]
    assert view.get_parameter("head.weight") is model.embedding.weight  # shared, not copied
    assert tied_groups(model) == [["embedding.weight", "head.weight"]]


def skeleton(names: list[str], lr: float = 0.1) -> dict:
    return {"state": {n: {"exp_avg": {"__tensor__": f"optimizer/state/{n}/exp_avg"}} for n in names},
            "param_groups": [{"lr": lr, "params": names}]}  # fmt: skip


def test_optimizer_skeletons_merge_over_stages_and_split_back_with_tied_names_taking_each_others_state():
    merged = merge_optimizer_skeletons([skeleton(["embedding.weight", "a"]), skeleton(["b", "head.weight"])])
    assert merged["param_groups"] == [{"lr": 0.1, "params": ["embedding.weight", "a", "b", "head.weight"]}]
    two_groups = [
        {**skeleton(["w"]), "param_groups": [{"lr": 0.1, "params": ["w"]}, {"lr": 0.1, "params": ["b"]}]},
        {**skeleton(["v"]), "param_groups": [{"lr": 0.1, "params": ["v"]}, {"lr": 0.1, "params": ["c"]}]},
    ]
    assert [g["params"] for g in merge_optimizer_skeletons(two_groups)["param_groups"]] == [["w", "v"], ["b", "c"]]

    one_process = skeleton(["embedding.weight", "a", "b"])  # its optimizer names the tied weight once
    part, sources = restrict_optimizer_skeleton(
        one_process, ["b", "head.weight"], [["embedding.weight", "head.weight"]]
    )

    assert part["param_groups"] == [{"lr": 0.1, "params": ["b", "head.weight"]}]
    assert part["state"]["head.weight"] == {"exp_avg": {"__tensor__": "optimizer/state/head.weight/exp_avg"}}
    assert sources == {"optimizer/state/head.weight/exp_avg": "optimizer/state/embedding.weight/exp_avg",
                       "optimizer/state/b/exp_avg": "optimizer/state/b/exp_avg"}  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "world", "fsdp", "message"),
    [
        ({"pp_size": 2}, 4, False, "launch 2"),
        ({"pp_size": 2}, 2, True, "launch a multiple of pp_size above it"),
        ({"pp_size": 2, "tp_size": 2}, 4, False, "combines with FSDP only"),
        ({"pp_size": 0}, 1, False, "at least 1"),
    ],
)
def test_a_pipeline_layout_that_does_not_fit_the_launch_is_a_one_line_error(settings, world, fsdp, message):
    with pytest.raises(LayoutError, match=message):
        mesh_shape(LayoutSettings(**settings), world, fsdp)
    assert mesh_shape(LayoutSettings(pp_size=2), 2, False) == MeshShape(pp=2)


class BranchesOnValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.first(x)
        return self.second(x) if x.sum() > 0 else x


def test_a_model_torch_cannot_trace_is_a_one_line_error_and_prints_no_graph(capsys):
    with pytest.raises(
        ConfigError, match="could not trace BranchesOnValues into one graph .*must not branch on tensor"
    ):
        traced_pipeline(BranchesOnValues(), (torch.randn(2, 4),), {}, {"second": SplitPoint.BEGINNING})
    assert "def forward" not in capsys.readouterr().err


def test_a_model_is_traced_again_for_new_shapes_and_left_as_it_was():
    model = Stack(2)
    for length in (3, 5):  # a second trace of a marked model would recurse without end
        pipe = traced_pipeline(
            model, (torch.zeros(2, length, dtype=torch.long),), {}, {"blocks.1": SplitPoint.BEGINNING}
        )
        assert pipe.num_stages == 2
    assert "forward" not in vars(model.blocks[1])


def test_the_last_stage_stand_in_returns_the_stage_output_once_and_refuses_a_second_call():
    output = torch.ones(2, 3)
    stand_in = StageOutput(output)
    assert stand_in(torch.zeros(2, 4)) is output
    with pytest.raises(RecipeError, match="calls its model more than once"):
        stand_in(torch.zeros(2, 4))


def test_canary_torch_pipeline_leaves_its_split_marks_on_the_model():
    """pipeline_split.traced_pipeline removes the marks; the day torch does, this fails and it can go."""
    assert "_orig_forward" in inspect.getsource(pipelining_ir.annotate_split_points)
    assert "_orig_forward = mod_to_wrap.forward" in inspect.getsource(pipelining_ir.annotate_split_points)
    assert "del " not in inspect.getsource(pipelining_ir.pipeline)


def test_canary_accelerates_loaders_know_no_pipeline_dimension():
    """launch_fixes.prepare_loader_for_data_ranks exists because accelerate splits data over pipeline stages."""
    source = inspect.getsource(data_loader.prepare_data_loader)
    assert '"tp" in torch_device_mesh.mesh_dim_names' in source and '"pp"' not in source


# -- real pipelines on 2 processes ------------------------------------------------------------------------------


pipelines = pytest.mark.multiprocess


SAVED = ["save_every_steps=5", "keep_last=0"]  # checkpoints at steps 5 and 10, for the resume and export tests
GPT = [*PIPELINE_RECIPES["gpt"], *SAVED]


@pytest.fixture(scope="module")
def references():
    """Each recipe on one process (the GPT's run also resumed as a pipeline below)."""
    return {
        "gpt": trajectory("cpu", "gpt", *GPT, world_size=1),
        "mlp_tp": trajectory("cpu", "mlp_tp", *PIPELINE_RECIPES["mlp_tp"], world_size=1),
    }


@pipelines
@pytest.mark.parametrize(
    ("recipe", "schedule"),
    [
        ("gpt", "1f1b"),
        ("gpt", "gpipe"),
        ("gpt", "interleaved_1f1b"),
        ("gpt", "looped_bfs"),
        ("mlp_tp", "gpipe"),
        ("mlp_tp", "1f1b"),
    ],
)
def test_a_pipeline_follows_the_one_process_trajectory_on_every_schedule(recipe, schedule, references):
    reference_dir, reference_records = references[recipe]
    overrides = GPT if recipe == "gpt" else PIPELINE_RECIPES[recipe]
    run_dir, records = trajectory("cpu_pp", recipe, *overrides, f"pp_schedule={schedule}", world_size=2)
    assert_same_trajectory(records, reference_records, run_dir, reference_dir, f"{recipe} {schedule}")
    if recipe == "mlp_tp":  # each process trains only its stage's weights: the last Linear on the second
        whole = final_parameters(reference_dir)
        last_stage = whole["3.weight"].numel() + whole["3.bias"].numel()
        trained = [rank_summary(run_dir, rank)["optimizer_elements"] for rank in (0, 1)]
        assert trained == [sum(t.numel() for t in whole.values()) - last_stage, last_stage]


@pytest.fixture(scope="module")
def pp_run():
    """The GPT on 2 pipeline stages (1F1B, the schedule test's run), checkpointed at steps 5 and 10."""
    return trajectory("cpu_pp", "gpt", *GPT, "pp_schedule=1f1b", world_size=2)[0]


@pipelines
def test_a_pipeline_checkpoint_is_sharded_and_resumes_bitwise_on_its_layout(pp_run, tmp_path):
    folder = checkpoint(pp_run, 5)
    assert (folder / "distributed").is_dir() and not (folder / "model.safetensors").exists()
    train_and_dump("cpu_pp", tmp_path, "gpt", *PIPELINE_RECIPES["gpt"], f"resume={folder}", world_size=2)

    resumed, uninterrupted = final_parameters(tmp_path), final_parameters(pp_run)
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)
    losses = {r["step"]: r["loss"] for r in train_records(read_metrics(tmp_path))}
    assert losses == {r["step"]: r["loss"] for r in train_records(read_metrics(pp_run)) if r["step"] > 5}


@pipelines
def test_a_pipeline_checkpoint_continues_on_one_process(pp_run, tmp_path):
    train_and_dump("cpu", tmp_path, "gpt", *PIPELINE_RECIPES["gpt"], f"resume={checkpoint(pp_run, 5)}", world_size=1)
    resumed, uninterrupted = final_parameters(tmp_path), final_parameters(pp_run)
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], **PIPELINE_WEIGHTS)


@pipelines
def test_a_one_process_checkpoint_continues_as_a_pipeline_its_tied_weights_state_on_both_stages(references, tmp_path):
    one = references["gpt"][0]
    train_and_dump("cpu_pp", tmp_path / "pp", "gpt", *GPT, f"resume={checkpoint(one, 5)}", world_size=2)
    resumed, uninterrupted = final_parameters(tmp_path / "pp"), final_parameters(one)
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], **PIPELINE_WEIGHTS)


@pipelines
def test_a_bf16_pipeline_follows_the_one_process_bf16_trajectory(tmp_path):
    """Stages traced in fp32 gave NaN losses under bf16 autocast; traced under it, they match one process."""
    bf16 = [*PIPELINE_RECIPES["gpt"], "mixed_precision=bf16"]
    one = train_and_dump("cpu", tmp_path / "one", "gpt", *bf16, world_size=1)
    pipeline = train_and_dump("cpu_pp", tmp_path / "pp", "gpt", *bf16, world_size=2)
    for key in ("loss", "grad_norm"):
        got, want = ([r[key] for r in train_records(records)] for records in (pipeline, one))
        assert got == pytest.approx(want, rel=2e-3)


@pipelines
def test_export_of_a_pipeline_checkpoint_equals_the_runs_weights(pp_run, tmp_path):
    export_checkpoint(checkpoint(pp_run, PIPELINE_STEPS), tmp_path)
    exported, final = load_file(str(tmp_path / "model.safetensors")), final_parameters(pp_run)
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[name], final[name]) for name in final)


@pipelines
@pytest.mark.parametrize("layout", ["cpu_pp"])  # TP's checkpoints continue: test_model_parallel.py (CI time)
def test_extending_max_steps_on_a_model_parallel_layout_continues_exactly(layout, tmp_path):
    """With a constant schedule, 10 steps then `max_steps=15` on the same run folder end bitwise where one run of
    15 steps ends: the extension resumes weights, optimizer state and data position exactly."""
    gpt = [*PIPELINE_RECIPES["gpt"], "lr_schedule=constant", "eval_every_steps=0"]
    train_and_dump(layout, tmp_path / "whole", "gpt", *gpt, "max_steps=15", world_size=2)
    train_and_dump(layout, tmp_path / "extended", "gpt", *gpt, world_size=2)  # max_steps=10 (PIPELINE_RECIPES)
    train_and_dump(layout, tmp_path / "extended", "gpt", *gpt, "max_steps=15", world_size=2)
    whole, extended = final_parameters(tmp_path / "whole"), final_parameters(tmp_path / "extended")
    assert all(torch.equal(whole[name], extended[name]) for name in whole)
