"""Loading a checkpoint never runs code from it.

Whoever can write a run folder (a shared file system, a downloaded run) can also rewrite its manifest, so the
checksums stop corruption, not tampering. These tests play that writer: they plant pickles whose loading
would create a file, re-sign the manifest, and show that `resume=` refuses the checkpoint with one line and
`export` reads only safetensors, while the planted file is never created. A control shows each payload is
live: `torch.load(..., weights_only=False)` of it does create the file. The commands run in the test's process
(`training.main`, `cli.main`: the entry points of a recipe script and of `accel-trainer`), which would run a payload
just as a process of their own would; tests/test_cli.py shows that a command's one-line error is the same there.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import accel_trainer as at
from accel_trainer import cli, training
from accel_trainer.checkpoint import state_files
from accel_trainer.checkpoint.files import MANIFEST
from conftest import assert_one_line_error, exit_status, reset_accelerate_state


class Payload:
    """A pickle that creates `marker` when unpickled, as an attacker's would run any command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def plant(path: Path, marker: Path) -> None:
    """The files of accel-trainer 0.1 were torch.save pickles; DCP's `.metadata` index is a plain pickle."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".pt":
        torch.save(Payload(marker), path)
    else:
        path.write_bytes(pickle.dumps(Payload(marker)))


def resign_manifest(folder: Path) -> None:
    """What an attacker does after editing a checkpoint: recompute every size and checksum."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in files
    }
    (folder / MANIFEST).write_text(json.dumps({"files": manifest}))


def resume_status(checkpoint: Path, tmp_path: Path) -> int:
    """`python recipes/vae.py resume=CHECKPOINT max_steps=6 output_dir=...`, in this process."""
    overrides = [f"resume={checkpoint}", "max_steps=6", f"output_dir={tmp_path / 'resumed'}", "show_progress_bar=false"]
    return exit_status(training.main, "vae", overrides)


def export_status(checkpoint: Path, output: Path) -> int:
    """`accel-trainer export CHECKPOINT --output OUTPUT`, in this process."""
    return exit_status(cli.main, ["export", str(checkpoint), "--output", str(output)])


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    at.train("vae", output_dir=str(run_dir), max_steps=4, save_every_steps=4, eval_every_steps=0, log_every_steps=0,
             show_progress_bar=False, report=False)  # fmt: skip
    reset_accelerate_state()
    return run_dir


@pytest.fixture
def checkpoint_copy(trained_run, tmp_path) -> Path:
    import shutil

    copy = tmp_path / "step_00000004"
    shutil.copytree(trained_run / "checkpoints" / "step_00000004", copy)
    return copy


def test_a_checkpoint_holds_only_safetensors_json_and_yaml(trained_run):
    folder = trained_run / "checkpoints" / "step_00000004"
    names = sorted(p.name for p in folder.iterdir())

    assert names == ["config.yaml", MANIFEST, "model.safetensors", "optimizer.safetensors", "rng_rank0.safetensors",
                     "train_state.json", "trainer.safetensors"]  # fmt: skip
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt"):  # parses as safetensors: a header of JSON, then raw bytes
            pass
    assert json.loads((folder / "train_state.json").read_text())["format"] == 2


@pytest.mark.parametrize("name", ["optimizer.pt", ".metadata"])
def test_the_payload_is_live_when_unpickled(name, tmp_path):
    marker = tmp_path / "pwned"
    plant(tmp_path / name, marker)

    if name.endswith(".pt"):
        torch.load(tmp_path / name, weights_only=False)  # how accel-trainer 0.1 loaded its files
    else:
        pickle.loads((tmp_path / name).read_bytes())  # how DCP's FileSystemReader loads .metadata

    assert marker.exists()  # so the absence of the marker in the tests below means something


@pytest.mark.parametrize("planted", ["optimizer.pt", "distributed/.metadata", "rng_rank0.pt"])
def test_a_checkpoint_holding_a_pickle_is_refused_without_running_it(checkpoint_copy, planted, tmp_path, capsys):
    marker = tmp_path / "pwned"
    plant(checkpoint_copy / planted, marker)
    resign_manifest(checkpoint_copy)

    status = resume_status(checkpoint_copy, tmp_path)

    assert_one_line_error(status, capsys.readouterr().err, f"holds {planted}, which accel-trainer never writes")
    assert not marker.exists()


def test_a_checkpoint_of_the_earlier_pickle_format_is_refused_and_its_weights_still_export(
    checkpoint_copy, tmp_path, capsys
):
    marker = tmp_path / "pwned"
    for name in ("optimizer.pt", "trainer.pt", "rng_rank0.pt"):  # the file names of format 1
        plant(checkpoint_copy / name, marker)
    for name in ("optimizer.safetensors", "trainer.safetensors", "rng_rank0.safetensors"):
        (checkpoint_copy / name).unlink()
    state = json.loads((checkpoint_copy / "train_state.json").read_text())
    del state["format"]
    (checkpoint_copy / "train_state.json").write_text(json.dumps(state))
    resign_manifest(checkpoint_copy)

    resumed = resume_status(checkpoint_copy, tmp_path)
    resume_stderr = capsys.readouterr().err
    exported = export_status(checkpoint_copy, tmp_path / "export")

    assert_one_line_error(resumed, resume_stderr, "has the format of accel-trainer 0.1")
    assert exported == 0, capsys.readouterr().err
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert not marker.exists()


def test_export_refuses_a_sharded_checkpoint_of_the_earlier_format_without_running_it(
    checkpoint_copy, tmp_path, capsys
):
    marker = tmp_path / "pwned"
    (checkpoint_copy / "model.safetensors").unlink()
    plant(checkpoint_copy / "distributed" / ".metadata", marker)  # DCP's default format: a pickled index
    plant(checkpoint_copy / "distributed" / "__0_0.distcp", marker)
    resign_manifest(checkpoint_copy)

    status = export_status(checkpoint_copy, tmp_path / "export")

    assert_one_line_error(status, capsys.readouterr().err, "sharded checkpoint of accel-trainer 0.1")
    assert not marker.exists()


def test_state_files_bring_back_rng_states_and_python_types_exactly(tmp_path):
    random.seed(1)
    np.random.seed(2)
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "other": {3: ("a", None, True), "lrs": [0.5, math.inf], "step": torch.tensor(7.0), "count": np.int64(4)},
    }
    expected = (random.random(), np.random.rand(), torch.rand(1))

    state_files.save(state, tmp_path / "state.safetensors")
    loaded = state_files.load(tmp_path / "state.safetensors")
    random.setstate(loaded["python"])
    np.random.set_state(loaded["numpy"])
    torch.set_rng_state(loaded["torch"])

    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert loaded["other"] == {**state["other"], "step": loaded["other"]["step"]}
    assert torch.equal(loaded["other"]["step"], torch.tensor(7.0))
    assert type(loaded["other"]["count"]) is int


def test_a_state_holding_code_cannot_be_saved(tmp_path):
    with pytest.raises(state_files.StateFileError, match=r"cannot store schedule/fn \(function\) in a checkpoint"):
        state_files.save({"schedule": {"fn": lambda step: step}}, tmp_path / "state.safetensors")


def test_a_file_that_is_not_a_state_file_is_a_clear_error(tmp_path):
    (tmp_path / "state.safetensors").write_bytes(pickle.dumps({"a": 1}))

    with pytest.raises(state_files.StateFileError, match="is not a readable safetensors file"):
        state_files.load(tmp_path / "state.safetensors")
