"""Checkpoint folders on disk: atomic publication, verification, choosing a checkpoint to resume, retention.

Pure filesystem tests, no training: a fake checkpoint is a folder holding a `train_state.json` with the step it
records and a few data files (one in a subfolder, as a sharded checkpoint has), published the way `save` does.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import pytest

from accel_trainer.checkpoint import files
from accel_trainer.checkpoint.files import (
    LATEST,
    MANIFEST,
    CheckpointError,
    apply_retention,
    checkpoints_dir,
    complete_checkpoints,
    final_folder,
    newest_valid_checkpoint,
    publish,
    remove_stale_temporaries,
    temporary_folder,
    verify,
)

DATA_FILES = ("model.safetensors", "optimizer.safetensors", "distributed/shard-00001.safetensors")


def write_checkpoint_files(folder: Path, step: int) -> None:
    """Fill a folder with what a checkpoint of `step` holds: its train state and some data files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train_state.json").write_text(json.dumps({"step": step}))
    for index, name in enumerate(DATA_FILES):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(bytes([step % 256, index]) * (100 + index))


def make_checkpoint(run_dir: Path, step: int, name: str | None = None) -> Path:
    """Publish a fake checkpoint recording `step`, in a folder called `name` (by default step_XXXXXXXX)."""
    temporary = checkpoints_dir(run_dir) / f".tmp-{name}" if name else temporary_folder(run_dir, step)
    write_checkpoint_files(temporary, step)
    return publish(temporary)


def make_interrupted_save(run_dir: Path, step: int) -> Path:
    """What a kill -9 in the middle of a save leaves: a temporary folder, some files partly written, no manifest."""
    temporary = temporary_folder(run_dir, step)
    temporary.mkdir(parents=True)
    (temporary / "train_state.json").write_text(json.dumps({"step": step}))
    (temporary / "model.safetensors").write_bytes(b"\x01" * 37)  # cut short mid-write
    return temporary


def read_manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())["files"]


def names(folders: list[Path]) -> list[str]:
    return [folder.name for folder in folders]


def remaining(run_dir: Path) -> list[str]:
    return sorted(p.name for p in checkpoints_dir(run_dir).iterdir() if p.is_dir())


# publish


def test_publish_renames_the_temporary_folder_to_its_final_name_and_points_latest_at_it(tmp_path):
    temporary = temporary_folder(tmp_path, 7)
    write_checkpoint_files(temporary, 7)

    final = publish(temporary)

    assert final == final_folder(tmp_path, 7) == checkpoints_dir(tmp_path) / "step_00000007"
    assert final.is_dir()
    assert not temporary.exists()
    assert (checkpoints_dir(tmp_path) / LATEST).read_text() == "step_00000007"
    assert not (checkpoints_dir(tmp_path) / f"{LATEST}.tmp").exists()  # the pointer was replaced atomically


def test_publish_writes_a_manifest_with_the_size_and_sha256_of_every_file(tmp_path):
    final = make_checkpoint(tmp_path, 7)

    manifest = read_manifest(final)

    assert sorted(manifest) == sorted(["train_state.json", *DATA_FILES])  # subfolders included, itself not
    for name, entry in manifest.items():
        content = (final / name).read_bytes()
        assert entry == {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}


def test_publish_writes_the_manifest_only_after_every_other_file_is_durable(tmp_path, monkeypatch):
    # The order of the durable writes is the property: a manifest written before a file's fsync could name
    # a file that a power cut then loses.
    temporary = temporary_folder(tmp_path, 7)
    write_checkpoint_files(temporary, 7)
    events: list[str] = []

    def recording(verb, real):
        def record(path, *args, **kwargs):
            events.append(f"{verb} {path.name}")
            return real(path, *args, **kwargs)

        return record

    monkeypatch.setattr(files, "_fsync_file", recording("fsync", files._fsync_file))
    monkeypatch.setattr(files, "_write_durably", recording("write", files._write_durably))

    publish(temporary)

    data_files = {p.name for p in temporary.with_name("step_00000007").rglob("*") if p.is_file()} - {MANIFEST}
    manifest_at = events.index(f"write {MANIFEST}")
    assert {event.split()[1] for event in events[:manifest_at] if event.startswith("fsync")} == data_files


def test_publish_renames_the_folder_into_place_only_once_its_manifest_is_complete(tmp_path, monkeypatch):
    temporary = temporary_folder(tmp_path, 7)
    write_checkpoint_files(temporary, 7)
    real_replace = os.replace
    problems_at_rename: list[str | None] = []

    def replace_checking_the_source(source, destination):
        if Path(source) == temporary:
            try:
                verify(temporary)
                problems_at_rename.append(None)
            except CheckpointError as problem:
                problems_at_rename.append(str(problem))
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace_checking_the_source)
    publish(temporary)

    assert problems_at_rename == [None]


def test_publish_of_a_step_that_already_exists_replaces_the_old_folder_whole(tmp_path):
    old = make_checkpoint(tmp_path, 7)
    (old / "left_over_from_the_first_attempt.bin").write_bytes(b"old")
    temporary = temporary_folder(tmp_path, 7)
    write_checkpoint_files(temporary, 7)
    (temporary / "model.safetensors").write_bytes(b"new weights")

    final = publish(temporary)

    assert final == old
    assert not (final / "left_over_from_the_first_attempt.bin").exists()
    assert (final / "model.safetensors").read_bytes() == b"new weights"
    assert "left_over_from_the_first_attempt.bin" not in read_manifest(final)
    verify(final)
    assert remaining(tmp_path) == ["step_00000007"]


def test_publish_moves_latest_to_the_newest_publication(tmp_path):
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2)

    assert (checkpoints_dir(tmp_path) / LATEST).read_text() == "step_00000002"


# verify


def test_verify_accepts_a_published_checkpoint(tmp_path):
    verify(make_checkpoint(tmp_path, 7))


def _remove_manifest(folder: Path) -> None:
    (folder / MANIFEST).unlink()


def _remove_a_file(folder: Path) -> None:
    (folder / "optimizer.safetensors").unlink()


def _truncate_a_file(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:5])


def _corrupt_a_byte_keeping_the_size(folder: Path) -> None:
    path = folder / "model.safetensors"
    content = bytearray(path.read_bytes())
    content[0] ^= 0xFF
    path.write_bytes(bytes(content))


def _write_a_manifest_that_is_not_json(folder: Path) -> None:
    (folder / MANIFEST).write_text('{"files": {"model.safe')


def _write_a_manifest_without_a_file_list(folder: Path) -> None:
    (folder / MANIFEST).write_text("{}")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        pytest.param(
            _remove_manifest, r"is incomplete \(no manifest\.json: the save was interrupted\)", id="no-manifest"
        ),
        pytest.param(_remove_a_file, r"is missing optimizer\.safetensors$", id="missing-file"),
        pytest.param(
            _truncate_a_file, r"model\.safetensors has 5 bytes, not 200 \(truncated or altered\)$", id="truncated-file"
        ),
        pytest.param(
            _corrupt_a_byte_keeping_the_size, r"model\.safetensors does not match its checksum", id="checksum"
        ),
        pytest.param(_write_a_manifest_that_is_not_json, r"has a corrupt manifest\.json$", id="manifest-not-json"),
        pytest.param(_write_a_manifest_without_a_file_list, r"has a corrupt manifest\.json$", id="manifest-no-files"),
    ],
)
def test_verify_rejects_a_damaged_checkpoint_with_one_line_naming_the_problem(tmp_path, damage, message):
    folder = make_checkpoint(tmp_path, 7)
    damage(folder)

    with pytest.raises(CheckpointError, match=message) as caught:
        verify(folder)

    assert str(caught.value).startswith(f"checkpoint {folder}")
    assert "\n" not in str(caught.value)


def test_verify_rejects_a_missing_folder(tmp_path):
    missing = checkpoints_dir(tmp_path) / "step_00000007"

    with pytest.raises(CheckpointError, match=r"step_00000007 does not exist$"):
        verify(missing)


@pytest.mark.parametrize(
    "manifest",
    ["[]", "null", '{"files": []}', '{"files": {"model.safetensors": {}}}', '{"files": {"model.safetensors": 3}}'],
)
def test_verify_reports_a_manifest_of_the_wrong_shape_as_corrupt(tmp_path, manifest):
    folder = make_checkpoint(tmp_path, 7)
    (folder / MANIFEST).write_text(manifest)

    with pytest.raises(CheckpointError, match=r"has a corrupt manifest\.json$"):
        verify(folder)


# complete_checkpoints


def test_complete_checkpoints_is_empty_without_a_checkpoints_folder(tmp_path):
    assert complete_checkpoints(tmp_path) == []


def test_complete_checkpoints_ignores_temporary_folders_and_the_latest_pointer(tmp_path):
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2)
    make_interrupted_save(tmp_path, 3)

    assert names(complete_checkpoints(tmp_path)) == ["step_00000001", "step_00000002"]


def test_complete_checkpoints_orders_by_the_step_recorded_inside_never_by_folder_name(tmp_path):
    # Names that sort (and even parse) the opposite way from the steps the folders record.
    make_checkpoint(tmp_path, 900, name="step_00000100")
    make_checkpoint(tmp_path, 100, name="step_00000900")
    make_checkpoint(tmp_path, 500, name="step_00000050")

    assert names(complete_checkpoints(tmp_path)) == ["step_00000900", "step_00000050", "step_00000100"]


# newest_valid_checkpoint


def test_newest_valid_checkpoint_is_the_one_with_the_highest_recorded_step(tmp_path):
    make_checkpoint(tmp_path, 1)
    newest = make_checkpoint(tmp_path, 20, name="b")
    make_checkpoint(tmp_path, 3, name="z")

    assert newest_valid_checkpoint(tmp_path) == newest


def test_newest_valid_checkpoint_skips_a_corrupt_newest_one_with_a_warning(tmp_path):
    previous = make_checkpoint(tmp_path, 1)
    corrupt = make_checkpoint(tmp_path, 2)
    _corrupt_a_byte_keeping_the_size(corrupt)

    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step_00000002.* does not match its checksum"):
        found = newest_valid_checkpoint(tmp_path)

    assert found == previous


def test_newest_valid_checkpoint_is_none_without_checkpoints(tmp_path):
    assert newest_valid_checkpoint(tmp_path) is None
    checkpoints_dir(tmp_path).mkdir()
    assert newest_valid_checkpoint(tmp_path) is None


def test_newest_valid_checkpoint_is_none_when_every_checkpoint_is_broken(tmp_path):
    _remove_manifest(make_checkpoint(tmp_path, 1))
    _truncate_a_file(make_checkpoint(tmp_path, 2))

    with pytest.warns(UserWarning) as caught:
        assert newest_valid_checkpoint(tmp_path) is None

    assert len(caught) == 2


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_to_resume_from(tmp_path):
    previous = make_checkpoint(tmp_path, 100)
    make_interrupted_save(tmp_path, 200)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an interrupted save is expected, not worth a warning
        found = newest_valid_checkpoint(tmp_path)

    assert found == previous
    verify(found)
    assert (checkpoints_dir(tmp_path) / LATEST).read_text() == "step_00000100"


# remove_stale_temporaries


def test_remove_stale_temporaries_deletes_temporary_folders_only(tmp_path):
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2)
    make_interrupted_save(tmp_path, 3)
    make_interrupted_save(tmp_path, 4)

    remove_stale_temporaries(tmp_path)

    assert remaining(tmp_path) == ["step_00000001", "step_00000002"]
    assert (checkpoints_dir(tmp_path) / LATEST).read_text() == "step_00000002"
    verify(final_folder(tmp_path, 1))
    verify(final_folder(tmp_path, 2))


def test_remove_stale_temporaries_does_nothing_without_a_checkpoints_folder(tmp_path):
    remove_stale_temporaries(tmp_path)

    assert not checkpoints_dir(tmp_path).exists()


# apply_retention


def test_retention_keeps_the_newest_keep_last_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        make_checkpoint(tmp_path, step)

    apply_retention(tmp_path, keep_last=2, best=None)

    assert remaining(tmp_path) == ["step_00000003", "step_00000004"]


def test_retention_with_keep_last_zero_keeps_every_checkpoint(tmp_path):
    for step in (1, 2, 3, 4):
        make_checkpoint(tmp_path, step)

    apply_retention(tmp_path, keep_last=0, best=None)

    assert remaining(tmp_path) == ["step_00000001", "step_00000002", "step_00000003", "step_00000004"]


def test_retention_keeps_the_best_checkpoint_however_old(tmp_path):
    best = make_checkpoint(tmp_path, 1)
    for step in (2, 3, 4):
        make_checkpoint(tmp_path, step)

    apply_retention(tmp_path, keep_last=2, best=best)

    assert remaining(tmp_path) == ["step_00000001", "step_00000003", "step_00000004"]


def test_retention_never_deletes_the_newest_checkpoint_even_when_best_is_another(tmp_path):
    make_checkpoint(tmp_path, 1)
    best = make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 3)

    apply_retention(tmp_path, keep_last=1, best=best)

    assert remaining(tmp_path) == ["step_00000002", "step_00000003"]


def test_retention_ranks_checkpoints_by_recorded_step_not_folder_name(tmp_path):
    make_checkpoint(tmp_path, 300, name="a")
    make_checkpoint(tmp_path, 100, name="c")
    make_checkpoint(tmp_path, 200, name="b")

    apply_retention(tmp_path, keep_last=2, best=None)

    assert remaining(tmp_path) == ["a", "b"]


def test_retention_never_deletes_the_checkpoint_just_published_after_resuming_past_a_corrupt_one(tmp_path):
    make_checkpoint(tmp_path, 100)
    _corrupt_a_byte_keeping_the_size(make_checkpoint(tmp_path, 200))
    just_published = make_checkpoint(tmp_path, 150)  # the run resumed from step 100 and saved again

    apply_retention(tmp_path, keep_last=1, best=None)

    assert just_published.is_dir()
    with pytest.warns(UserWarning, match="step_00000200"):
        assert newest_valid_checkpoint(tmp_path) == just_published


def test_published_files_follow_the_umask_like_any_file_the_user_writes(tmp_path):
    temporary = temporary_folder(tmp_path, 5)
    write_checkpoint_files(temporary, 5)
    os.chmod(temporary / "model.safetensors", 0o600)  # what safetensors' save_file does

    final = publish(temporary)

    umask = os.umask(0)
    os.umask(umask)
    assert all((path.stat().st_mode & 0o777) == 0o666 & ~umask for path in final.rglob("*") if path.is_file())
