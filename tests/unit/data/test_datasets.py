"""Any dataset a recipe returns trains the same on every layout, and resumes exactly mid-stream.

The kinds: datasets.Dataset, a sharded and shuffled datasets.IterableDataset, one from a generator, a torch
map-style Dataset and a torch IterableDataset (tuple batches). Each trains on 1 and 2 processes to the same
weights, evaluates every example once, and resumes bitwise mid-epoch and at an epoch's end. A stream's
micro-batches split every global batch between the processes with no example twice. Anything else is a
one-line error.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import accel_trainer as at
from accel_trainer.data.batching import plan_batches
from accel_trainer.data.streams import TrainStream
from accel_trainer.errors import ConfigError, RecipeError
from conftest import WORKERS, final_parameters, read_metrics, train_and_dump

STREAMS = ["hf_sharded", "hf_generator", "torch_stream"]
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def stream_of(values: list[int], plan, process_index: int, position=(0, 0)) -> TrainStream:
    return TrainStream(values, list, plan, process_index, position)


def take(stream: TrainStream, count: int) -> list[tuple[int, list[int]]]:
    batches = stream.micro_batches()
    return [next(batches) for _ in range(count)]


def test_each_global_batch_of_a_stream_is_split_between_the_processes_with_nothing_twice():
    plan = plan_batches(8, 2, 2)  # 2 processes x 2 micro-batches of 2
    values = list(range(20))  # 2 global batches an epoch, 4 examples dropped

    per_process = [take(stream_of(values, plan, rank), 6) for rank in (0, 1)]

    assert [batch for _, batch in per_process[0][:2]] == [[0, 1], [4, 5]]
    assert [batch for _, batch in per_process[1][:2]] == [[2, 3], [6, 7]]
    first_epoch = sorted(x for rank in (0, 1) for epoch, batch in per_process[rank] if epoch == 0 for x in batch)
    assert first_epoch == list(range(16))
    assert [epoch for epoch, _ in per_process[0]] == [0, 0, 0, 0, 1, 1]


def test_a_stream_resumes_from_its_position_with_the_same_micro_batches():
    plan = plan_batches(8, 4, 1)
    values = list(range(20))
    stream = stream_of(values, plan, 0)
    uninterrupted = take(stream, 8)
    first = stream_of(values, plan, 0)
    take(first, 2)  # one optimizer step

    resumed = take(stream_of(values, plan, 0, first.position), 6)

    assert first.position == (0, 8)
    assert resumed == uninterrupted[2:]


def test_a_stream_shorter_than_a_global_batch_is_a_clear_error():
    with pytest.raises(ConfigError, match="gave 5 examples in epoch 0, fewer than global_batch_size=8"):
        take(stream_of(list(range(5)), plan_batches(8, 4, 1), 0), 1)


def test_a_list_is_refused_listing_what_is_accepted(tmp_path):
    at.registry.discover_recipes([WORKERS / "recipes"])
    with pytest.raises(RecipeError, match="returned a list as the training set; return a datasets.Dataset"):
        at.train("sources", source="list", output_dir=str(tmp_path), show_progress_bar=False, report=False)


def test_loader_workers_on_a_stream_are_warned_about(tmp_path):
    at.registry.discover_recipes([WORKERS / "recipes"])
    with pytest.warns(UserWarning, match="num_dataloader_workers has no effect on a stream"):
        at.train("sources", source="torch_stream", num_dataloader_workers=2, max_steps=1, output_dir=str(tmp_path),
                 show_progress_bar=False, report=False)  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", ["hf_map", "torch_map", "hf_sharded", "hf_generator", "torch_stream"])
def test_every_kind_of_dataset_trains_to_the_same_weights_on_one_and_two_processes(source, tmp_path):
    one = train_and_dump("cpu", tmp_path / "one", "sources", f"source={source}", world_size=1)
    # a sharded stream is read as readers of its shards (each process reading its own), in the same order
    two = train_and_dump("cpu_ddp", tmp_path / "two", "sources", f"source={source}", world_size=2)

    expected, actual = final_parameters(tmp_path / "one"), final_parameters(tmp_path / "two")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE)
    epochs = [r["epoch"] for r in one if "loss" in r]
    assert epochs == [1] * 6 + [2] * 6 + [3] * 2  # 6 full global batches a pass of 100 examples
    evals = ([r["eval/loss"] for r in records if "eval/loss" in r] for records in (one, two))
    torch.testing.assert_close(torch.tensor(next(evals)), torch.tensor(next(evals)), rtol=1e-5, atol=0)


@pytest.mark.parametrize("source", STREAMS)
@pytest.mark.parametrize("stop_step", [5, 12], ids=["mid-epoch", "end-of-epoch"])
def test_a_stream_resumes_bitwise(source, stop_step, tmp_path):
    at.registry.discover_recipes([WORKERS / "recipes"])
    settings = dict(source=source, save_every_steps=1, keep_last=0, show_progress_bar=False, report=False)
    at.train("sources", output_dir=str(tmp_path / "full"), **settings)
    checkpoint = tmp_path / "full" / "checkpoints" / f"step_{stop_step:08d}"

    at.train("sources", output_dir=str(tmp_path / "resumed"), resume=str(checkpoint), **settings)

    full = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "full") if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "resumed") if "loss" in r}
    assert sorted(resumed) == list(range(stop_step + 1, 15))
    assert all(resumed[step] == full[step] for step in resumed)
    before, after = final_parameters(tmp_path / "full"), final_parameters(tmp_path / "resumed")
    assert all(torch.equal(before[name], after[name]) for name in before)


def assert_same_training(got: Path, expected: Path, from_step: int = 0) -> None:
    """The runs' losses after `from_step` and final weights agree as DDP's do with one process's (the order of
    the gradient sums differs)."""
    losses = [{r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r and r["step"] > from_step}
              for run in (got, expected)]  # fmt: skip
    assert sorted(losses[0]) == list(range(from_step + 1, 15))
    torch.testing.assert_close([losses[0][s] for s in sorted(losses[0])], [losses[1][s] for s in sorted(losses[0])],
                               **TOLERANCE)  # fmt: skip
    actual, wanted = final_parameters(got), final_parameters(expected)
    for name in wanted:
        torch.testing.assert_close(actual[name], wanted[name], **TOLERANCE)


@pytest.mark.multiprocess
def test_a_sharded_stream_trains_the_same_on_1_2_and_4_processes_and_resumes_from_2_onto_1_and_4(tmp_path):
    """4 shards, global batch 16: 4 readers of 4 examples a step; 4 processes (cpu_hsdp: 4 data-parallel ranks)
    read one reader each, 2 read two, 1 reads all four."""
    run = ["source=hf_shards", "save_every_steps=5", "keep_last=0"]
    train_and_dump("cpu_ddp", tmp_path / "two", "sources", *run, world_size=2)
    checkpoint = tmp_path / "two" / "checkpoints" / "step_00000005"
    train_and_dump("cpu", tmp_path / "one", "sources", *run, world_size=1)
    train_and_dump("cpu_hsdp", tmp_path / "four", "sources", *run, world_size=4)
    train_and_dump("cpu", tmp_path / "onto_one", "sources", *run, f"resume={checkpoint}", world_size=1)
    train_and_dump("cpu_hsdp", tmp_path / "onto_four", "sources", *run, f"resume={checkpoint}", world_size=4)

    for other in ("one", "four"):
        assert_same_training(tmp_path / other, tmp_path / "two")
    for resumed in ("onto_one", "onto_four"):
        assert_same_training(tmp_path / resumed, tmp_path / "two", from_step=5)


@pytest.mark.multiprocess
def test_a_shuffled_sharded_stream_read_ahead_on_two_processes_resumes_on_one_re_reading_its_readers(tmp_path):
    run = ["source=hf_sharded", "save_every_steps=5", "keep_last=0"]  # a shuffle buffer: re-read to the position
    train_and_dump("cpu_ddp", tmp_path / "full", "sources", *run, "num_prefetch_batches=2", world_size=2)
    checkpoint = tmp_path / "full" / "checkpoints" / "step_00000005"

    train_and_dump("cpu", tmp_path / "resumed", "sources", *run, f"resume={checkpoint}", world_size=1)

    assert_same_training(tmp_path / "resumed", tmp_path / "full", from_step=5)


@pytest.mark.multiprocess
def test_the_main_process_builds_the_datasets_before_the_others_so_a_datasets_cache_is_written_once(tmp_path):
    """build_datasets runs under main_process_first: what the main process maps or tokenizes into a datasets
    cache, the others read from it instead of computing it again."""
    log = tmp_path / "builds.log"
    train_and_dump("cpu_ddp", tmp_path, "sources", "max_steps=1", f"build_log={log}", world_size=2)
    events = {
        (event, rank): float(clock) for event, rank, clock in (line.split() for line in log.read_text().splitlines())
    }
    assert events[("end", "0")] <= events[("begin", "1")]


def test_collate_receives_examples_in_torch_format_as_the_contract_says(tmp_path):
    """README's contract: for a `datasets` set, `collate` gets a list of dicts of tensors (numbers as 0-dim
    tensors, strings as str), not the Python lists `datasets` returns without a format."""
    import datasets

    received = []

    @at.register_recipe("collate_contract")
    class CollateContract(at.Recipe):
        def build_model(self, cfg):
            return torch.nn.Linear(2, 1)

        def build_datasets(self, cfg):
            rows = {"x": [[1.0, 2.0]] * 8, "y": [3.0] * 8, "name": ["a"] * 8}
            return datasets.Dataset.from_dict(rows), None

        def collate(self, examples):
            received.append(examples)
            return torch.utils.data.default_collate([{k: v for k, v in e.items() if k != "name"} for e in examples])

        def compute_loss(self, model, batch):
            return (model(batch["x"]).squeeze(1) - batch["y"]).pow(2).mean()

    at.train("collate_contract", output_dir=str(tmp_path), max_steps=1, global_batch_size=4, micro_batch_size=4,
             show_progress_bar=False, report=False)  # fmt: skip
    example = received[0][0]
    assert isinstance(received[0], list) and len(received[0]) == 4
    assert isinstance(example["x"], torch.Tensor) and example["x"].shape == (2,)
    assert isinstance(example["y"], torch.Tensor) and example["y"].ndim == 0
    assert example["name"] == "a"


def test_a_stream_position_the_run_cannot_continue_is_refused_before_anything_is_loaded_or_said(tmp_path, recwarn):
    """A checkpoint of 2 processes reading a stream as 3 readers, resumed on 1 reading another as 4: one line,
    and no warning first that the data order continues exactly."""
    at.registry.discover_recipes([WORKERS / "recipes"])
    settings = dict(source="hf_sharded", max_steps=2, save_every_steps=2, show_progress_bar=False, report=False)
    at.train("sources", output_dir=str(tmp_path / "run"), **settings)
    folder = tmp_path / "run" / "checkpoints" / "step_00000002"
    as_if_two_processes_read_another_stream(folder)

    with pytest.raises(ConfigError, match="as 3 readers and this run as 4 .* global_batch_size it was trained with"):
        at.train("sources", output_dir=str(tmp_path / "resumed"), resume=str(folder), **settings)
    assert not [w for w in recwarn if "continue exactly" in str(w.message)]


def as_if_two_processes_read_another_stream(folder):
    """Rewrite a checkpoint's train state (and its manifest entry) as 2 processes reading 3 readers save it."""
    recorded = json.loads((folder / "train_state.json").read_text())
    recorded["world_size"], recorded["data_position"] = 2, {"epoch": 0, "readers": [{"read": 8, "state": None}] * 3}
    written = json.dumps(recorded).encode()
    (folder / "train_state.json").write_bytes(written)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["train_state.json"] = {"bytes": len(written), "sha256": hashlib.sha256(written).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
