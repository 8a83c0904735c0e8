"""A checkpoint written on one layout resumes on another, exports from any layout, and refuses a wrong model.

FSDP's sharded checkpoint resumes on 1 process and on 2-process DDP, and a DDP checkpoint resumes under FSDP;
each continues the trajectory of the uninterrupted run (allclose: summation order differs between layouts).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from accel_trainer import training
from conftest import (
    BIN,
    REPO,
    WORKERS,
    assert_one_line_error,
    checkpoint,
    clean_env,
    exit_status,
    export_checkpoint,
    final_parameters,
    read_metrics,
    train_and_dump,
)

pytestmark = pytest.mark.multiprocess

STEPS = 20
RUN = [f"max_steps={STEPS}", "log_every_steps=1", "eval_every_steps=0", "save_every_steps=10", "keep_last=0",
       "sample_latent=false", "micro_batch_size=16", "warmup_steps=3"]  # fmt: skip
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fsdp")
    train_and_dump("cpu_fsdp", run_dir, "vae", *RUN, world_size=2)
    return run_dir


@pytest.mark.parametrize(("layout", "world_size"), [("cpu", 1), ("cpu_ddp", 2)])
def test_fsdp_checkpoint_resumes_on_another_layout_and_continues_the_trajectory(fsdp_run, layout, world_size,
                                                                                  tmp_path):  # fmt: skip
    assert (checkpoint(fsdp_run, 10) / "distributed").is_dir()  # really a sharded checkpoint

    train_and_dump(layout, tmp_path, "vae", *RUN, f"resume={checkpoint(fsdp_run, 10)}", world_size=world_size)

    expected, actual = final_parameters(fsdp_run), final_parameters(tmp_path)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)
    full = {r["step"]: r["loss"] for r in read_metrics(fsdp_run) if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path) if "loss" in r}
    assert sorted(resumed) == list(range(11, STEPS + 1))
    torch.testing.assert_close(torch.tensor([resumed[s] for s in resumed]), torch.tensor([full[s] for s in resumed]),
                               rtol=1e-5, atol=0)  # fmt: skip


def test_a_sharded_checkpoint_holds_no_pickle(fsdp_run):
    folder = checkpoint(fsdp_run, 10)
    shards = sorted(p.name for p in (folder / "distributed").iterdir())

    assert shards == ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert all(p.name.endswith((".safetensors", ".json", ".yaml")) for p in folder.rglob("*") if p.is_file())


def test_ddp_checkpoint_resumes_under_fsdp(fsdp_run, tmp_path):
    train_and_dump("cpu_ddp", tmp_path / "ddp", "vae", *RUN, "max_steps=20", world_size=2)
    assert (checkpoint(tmp_path / "ddp", 10) / "model.safetensors").is_file()

    train_and_dump("cpu_fsdp", tmp_path / "fsdp", "vae", *RUN, f"resume={checkpoint(tmp_path / 'ddp', 10)}",
                   world_size=2)  # fmt: skip

    expected, actual = final_parameters(tmp_path / "ddp"), final_parameters(tmp_path / "fsdp")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)


def test_export_of_a_sharded_checkpoint_equals_the_runs_consolidated_weights(fsdp_run, tmp_path):
    export_checkpoint(fsdp_run, tmp_path)

    exported, final = load_file(str(tmp_path / "model.safetensors")), final_parameters(fsdp_run)
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[name], final[name]) for name in final)
    assert (tmp_path / "config.yaml").is_file()


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(fsdp_run, tmp_path, capsys):
    status = exit_status(training.main, "vae", ["latent_dim=4", f"resume={checkpoint(fsdp_run, 10)}",
                                           f"output_dir={tmp_path}", "show_progress_bar=false"])  # fmt: skip

    message = "parameter 'decoder.0.weight' has shape [256, 8] in the checkpoint and [256, 4] here"
    assert_one_line_error(status, capsys.readouterr().err, message)


def test_a_checkpoint_of_another_recipe_is_refused_naming_the_difference(fsdp_run, tmp_path):
    """The recipe script of a file of its own (`line`), in a process of its own: it registers a recipe."""
    command = [BIN / "python", WORKERS / "standalone_recipe.py", f"resume={checkpoint(fsdp_run, 10)}",
               f"output_dir={tmp_path}", "show_progress_bar=false"]  # fmt: skip
    result = subprocess.run([str(c) for c in command], env=clean_env(), cwd=REPO, capture_output=True, text=True,
                            timeout=120)  # fmt: skip

    assert_one_line_error(result.returncode, result.stderr, "written by recipe 'vae', not 'line'")


def test_naming_a_corrupt_checkpoint_explicitly_is_a_one_line_error(fsdp_run, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint(fsdp_run, 10), broken)
    shard = next((broken / "distributed").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-10])

    status = exit_status(training.main, "vae", [f"resume={broken}", f"output_dir={tmp_path / 'run'}",
                                           "show_progress_bar=false"])  # fmt: skip

    assert_one_line_error(status, capsys.readouterr().err, "truncated or altered")
