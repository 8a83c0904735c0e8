"""Bad input, fuzzed: random overrides, YAML documents, recipe names, export and resume paths.

Each property: the entry point either succeeds or raises a UserError (printed by the command line as one
line with exit status 2), never another exception, which would be a traceback. The training itself is not
started (these test the checks in front of it); the real command-line paths are covered in test_cli.py.
"""

from __future__ import annotations

import dataclasses
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accel_trainer import registry
from accel_trainer.checkpoint import export
from accel_trainer.checkpoint.files import CheckpointError
from accel_trainer.config.fields import parse_overrides
from accel_trainer.config.train_config import resolve_config
from accel_trainer.errors import UserError

VAE_CONFIG = registry.get_recipe("vae").Config
KEYS = st.one_of(st.sampled_from([f.name for f in dataclasses.fields(VAE_CONFIG)]), st.text(max_size=12))
VALUES = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["-1", "0", "1e400", "nan", "inf", "-inf", "true", "none", "1_0", "0x10", "3.5", "", "fp16"]),
    st.integers(-(10**12), 10**12).map(str),
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.lists(st.one_of(st.tuples(KEYS, VALUES).map("=".join), st.text(max_size=20)), max_size=6))
def test_random_overrides_are_accepted_or_a_user_error(words):
    try:
        resolve_config(VAE_CONFIG, None, parse_overrides(words))
    except UserError as error:
        assert "\n" not in str(error)


YAML_TEXT = st.one_of(
    st.text(alphabet=string.printable, max_size=80),
    st.dictionaries(
        KEYS, st.one_of(VALUES, st.integers(), st.floats(), st.booleans(), st.none(), st.lists(st.integers()))
    ).map(lambda d: "\n".join(f"{k}: {v}" for k, v in d.items())),
)


@FUZZ
@given(YAML_TEXT)
def test_random_yaml_documents_are_accepted_or_a_user_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("yaml") / "config.yaml"
    path.write_text(text)
    try:
        resolve_config(VAE_CONFIG, path, {})
    except UserError as error:
        assert "\n" not in str(error)


@FUZZ
@given(st.text(max_size=30))
def test_random_recipe_names_are_found_or_a_user_error(name):
    try:
        registry.get_recipe(name)
    except UserError as error:
        assert "\n" not in str(error)


def _fill(folder, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_dir():
            path.write_bytes(content)


CHECKPOINT_NAMES = st.sampled_from(["manifest.json", "train_state.json", "model.safetensors", "config.yaml",
                                    "optimizer.safetensors", "distributed/shard-00001.safetensors",
                                    "checkpoints/latest", "checkpoints/step_00000001/manifest.json", "x"])  # fmt: skip
CONTENTS = st.one_of(st.binary(max_size=64), st.sampled_from([b"{}", b'{"files": {}}', b'{"step": 1}', b"\x08" * 8]))


@FUZZ
@given(st.dictionaries(CHECKPOINT_NAMES, CONTENTS, max_size=6))
def test_export_of_random_folders_is_a_result_or_a_user_error(tmp_path_factory, files):
    folder = tmp_path_factory.mktemp("random")
    _fill(folder, files)
    try:
        export.export(folder, folder / "out")
    except UserError as error:
        assert "\n" not in str(error)


@FUZZ
@given(st.dictionaries(CHECKPOINT_NAMES, CONTENTS, max_size=6))
def test_a_random_folder_as_a_checkpoint_to_resume_is_refused_in_one_line(tmp_path_factory, files):
    from accel_trainer.checkpoint import checks
    from accel_trainer.checkpoint import files as checkpoint_files

    folder = tmp_path_factory.mktemp("random")
    _fill(folder, files)
    with pytest.raises(CheckpointError) as refused:  # what restore() checks before it loads anything
        checkpoint_files.verify(folder)
        checks.check_format(folder)
    assert "\n" not in str(refused.value)
