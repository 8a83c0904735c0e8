"""Pipeline x FSDP on the CPU: cpu_pp_fsdp.yaml cuts the model into 2 stages and shards each over 2 processes.

{1 process} = {PP 2 x FSDP 2} for the token-loss GPT (padded to block_size: under FSDP the stages are traced
for one shape; its LM head tied to the embedding on the other stage) and the mean-loss MLP split by its
`pipeline_split`: gradient norm and loss of every step within 1e-6 (relative), weights after 10 AdamW steps
within 1e-4, and each process training half of its stage's weights. A checkpoint resumes bitwise on the
layout, continues on an FSDP layout without a pipeline and exports to the run's own weights; a training
micro-batch of another shape is a one-line error naming the fix. Four processes on two cores: the slow tier.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from accel_trainer import LayoutError
from accel_trainer.config.layout import LayoutSettings
from accel_trainer.parallel.mesh import MeshShape, mesh_shape
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

SAVED = ["save_every_steps=5", "keep_last=0"]  # checkpoints at steps 5 and 10, for the resume and export tests
PADDED = {"gpt": [*PIPELINE_RECIPES["gpt"], "pad_to_block_size=true", *SAVED], "mlp_tp": PIPELINE_RECIPES["mlp_tp"]}


def test_a_pipeline_on_an_fsdp_layout_shards_each_stage_over_the_processes_left():
    assert mesh_shape(LayoutSettings(pp_size=2), 4, True) == MeshShape(dp_shard=2, pp=2)
    assert mesh_shape(LayoutSettings(pp_size=2), 8, True) == MeshShape(dp_shard=4, pp=2)


@pytest.mark.parametrize(
    ("settings", "world", "message"),
    [({"pp_size": 2}, 2, "launch a multiple of pp_size above it"), ({"pp_size": 2}, 5, "launch a multiple"),
     ({"pp_size": 2, "tp_size": 2}, 8, "combines with FSDP only")],
)  # fmt: skip
def test_a_pipeline_fsdp_launch_that_does_not_fit_is_a_one_line_error(settings, world, message):
    with pytest.raises(LayoutError, match=message):
        mesh_shape(LayoutSettings(**settings), world, True)


@pytest.fixture(scope="module")
def references():
    return {recipe: trajectory("cpu", recipe, *overrides, world_size=1) for recipe, overrides in PADDED.items()}


@pytest.mark.parametrize("recipe", ["gpt", "mlp_tp"])
@pytest.mark.multiprocess
def test_pipeline_x_fsdp_follows_the_one_process_trajectory(recipe, references):
    reference_dir, reference_records = references[recipe]
    run_dir, records = trajectory("cpu_pp_fsdp", recipe, *PADDED[recipe], world_size=4)
    assert_same_trajectory(records, reference_records, run_dir, reference_dir, f"{recipe} pp x fsdp")
    if recipe == "mlp_tp":  # processes 0, 1 shard the first stage; 2, 3 the last Linear
        whole = final_parameters(reference_dir)
        last_stage = whole["3.weight"].numel() + whole["3.bias"].numel()
        trained = [rank_summary(run_dir, rank)["optimizer_elements"] for rank in range(4)]
        first_stage = sum(t.numel() for t in whole.values()) - last_stage
        assert trained[0] + trained[1] == first_stage and trained[2] + trained[3] == last_stage
        assert max(trained[:2]) < first_stage and max(trained[2:]) < last_stage


@pytest.fixture(scope="module")
def pp_fsdp_run():
    """The padded GPT on cpu_pp_fsdp (the trajectory test's run), checkpointed at steps 5 and 10."""
    return trajectory("cpu_pp_fsdp", "gpt", *PADDED["gpt"], world_size=4)[0]


@pytest.mark.multiprocess
def test_a_pipeline_x_fsdp_checkpoint_resumes_bitwise_and_exports_the_runs_weights(pp_fsdp_run, tmp_path):
    folder = checkpoint(pp_fsdp_run, 5)
    assert (folder / "distributed").is_dir() and not (folder / "model.safetensors").exists()
    train_and_dump("cpu_pp_fsdp", tmp_path / "resumed", "gpt", *PADDED["gpt"], f"resume={folder}", world_size=4)
    resumed, uninterrupted = final_parameters(tmp_path / "resumed"), final_parameters(pp_fsdp_run)
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)
    losses = {r["step"]: r["loss"] for r in train_records(read_metrics(tmp_path / "resumed"))}
    assert losses == {r["step"]: r["loss"] for r in train_records(read_metrics(pp_fsdp_run)) if r["step"] > 5}

    export_checkpoint(checkpoint(pp_fsdp_run, PIPELINE_STEPS), tmp_path / "export")
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert exported.keys() == uninterrupted.keys()
    assert all(torch.equal(exported[name], uninterrupted[name]) for name in uninterrupted)


@pytest.mark.multiprocess
def test_a_pipeline_x_fsdp_checkpoint_continues_on_fsdp_without_a_pipeline(pp_fsdp_run, tmp_path):
    train_and_dump("cpu_fsdp", tmp_path, "gpt", *PADDED["gpt"], f"resume={checkpoint(pp_fsdp_run, 5)}",
                   world_size=2)  # fmt: skip
    resumed, uninterrupted = final_parameters(tmp_path), final_parameters(pp_fsdp_run)
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], **PIPELINE_WEIGHTS)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("layout", "world_size"), [("cpu_pp", 2), ("cpu_pp_fsdp", 4)])
def test_activation_checkpointing_on_a_pipeline_recomputes_the_same_gradients(layout, world_size, tmp_path):
    """Each stage's blocks run under torch's checkpoint (applied after tracing, before fully_shard): the same
    losses, gradient norms and weights as without it."""
    plain_dir, plain_records = trajectory(layout, "gpt", *PADDED["gpt"], world_size=world_size)  # off: the default
    checkpointed_records = train_and_dump(layout, tmp_path, "gpt", *PADDED["gpt"], "activation_checkpointing=true",
                                          world_size=world_size)  # fmt: skip
    for key in ("loss", "grad_norm"):
        plain, checkpointed = ([r[key] for r in train_records(rs)] for rs in (plain_records, checkpointed_records))
        assert checkpointed == pytest.approx(plain, rel=1e-6)
    plain, checkpointed = final_parameters(plain_dir), final_parameters(tmp_path)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_a_training_batch_of_another_shape_is_a_one_line_error_naming_the_fix(tmp_path):
    """The module's last use of cpu_pp_fsdp: the refusal ends the shared launch (a LayoutError's one line on a
    launch of its own is the CLI's, tests/test_cli.py)."""
    unpadded = [*PIPELINE_RECIPES["gpt"], "block_size=512", "micro_batch_size=2"]  # most batches shorter than 512
    with pytest.raises(AssertionError) as failed:
        train_and_dump("cpu_pp_fsdp", tmp_path, "gpt", *unpadded, world_size=4)
    assert "pipeline x FSDP trains stages traced for one micro-batch shape" in str(failed.value)
    assert "pad_to_block_size=true" in str(failed.value)
