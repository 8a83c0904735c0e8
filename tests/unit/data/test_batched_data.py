"""The batched in-memory data path gives the same batches as the per-row path, so the same trajectories.

Where a recipe keeps the default collate and its set fits `data_cache_gb`, each micro-batch is one indexing of
column tensors instead of rows read one by one and stacked. The batches are bitwise the ones `default_collate`
builds from the rows; training with it ends with bitwise the weights and losses of the per-row path
(`data_cache_gb=0`) on one process and on two; the resume tests (test_resume.py, the VAE) run on it. What it
cannot batch keeps the per-row path: a custom collate, a transform, strings, ragged columns, a set over budget.
"""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset, default_collate

import accel_trainer as at
from accel_trainer.data.columns import ColumnBatches, column_batches
from accel_trainer.data.loaders import as_torch
from conftest import final_parameters, read_metrics, train_and_dump


class DefaultCollate(at.Recipe):
    pass


class OwnCollate(at.Recipe):
    def collate(self, examples):
        return default_collate(examples)


def mixed_columns() -> datasets.Dataset:
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict({
        "image": rng.standard_normal((20, 2, 3)).astype(np.float32),
        "label": rng.integers(0, 10, 20),
        "weight": rng.random(20).tolist(),  # Python floats: float64 in Arrow, float32 in torch format
        "flag": [bool(i % 2) for i in range(20)],
    })  # fmt: skip


def assert_bitwise_equal(got, want) -> None:
    assert type(got) is type(want)
    pairs = zip(got.values(), want.values(), strict=True) if isinstance(got, dict) else zip(got, want, strict=True)
    for a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("indices", [[3, 0, 7, 7], [19], list(range(20))])
def test_a_batch_of_columns_is_bitwise_what_default_collate_builds_from_the_rows(indices):
    dataset = mixed_columns()
    batched = column_batches(DefaultCollate(at.TrainConfig()), dataset, budget_gb=1.0)
    assert isinstance(batched, ColumnBatches)
    rows = as_torch(dataset)
    assert_bitwise_equal(batched.__getitems__(indices), default_collate([rows[i] for i in indices]))


def test_a_tensor_dataset_is_batched_as_default_collate_batches_its_tuples():
    dataset = TensorDataset(torch.randn(10, 3), torch.arange(10))
    batched = column_batches(DefaultCollate(at.TrainConfig()), dataset, budget_gb=1.0)
    assert_bitwise_equal(batched.__getitems__([4, 1]), default_collate([dataset[4], dataset[1]]))  # a list


def with_strings() -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})


def ragged() -> datasets.Dataset:
    return datasets.Dataset.from_dict({"ids": [[1, 2], [3]]})


def with_transform() -> datasets.Dataset:
    dataset = datasets.Dataset.from_dict({"x": [1.0, 2.0]})
    dataset.set_transform(lambda batch: {"x": [2 * x for x in batch["x"]]})
    return dataset


@pytest.mark.parametrize(
    ("recipe", "dataset", "budget_gb"),
    [(OwnCollate, mixed_columns, 1.0), (DefaultCollate, with_strings, 1.0), (DefaultCollate, ragged, 1.0),
     (DefaultCollate, with_transform, 1.0), (DefaultCollate, mixed_columns, 0.0),
     (DefaultCollate, mixed_columns, 1e-9)],
    ids=["custom collate", "strings", "ragged", "transform", "turned off", "over budget"],
)  # fmt: skip
def test_what_cannot_be_batched_keeps_the_per_row_path(recipe, dataset, budget_gb):
    assert column_batches(recipe(at.TrainConfig()), dataset(), budget_gb) is None


def test_a_sets_own_transform_still_makes_its_rows():
    assert as_torch(with_transform())[1] == {"x": 4.0}


VAE = ["max_steps=30", "log_every_steps=5", "eval_every_steps=15", "micro_batch_size=16", "global_batch_size=32"]


def train_vae(layout: str, out, cache_gb: int, world: int) -> list[dict]:
    if world == 1:  # in this process: the quickest
        at.train("vae", output_dir=str(out), data_cache_gb=cache_gb, show_progress_bar=False, report=False,
                 **{k: int(v) for k, v in (o.split("=") for o in VAE)})  # fmt: skip
        return read_metrics(out)
    return train_and_dump(layout, out, "vae", *VAE, f"data_cache_gb={cache_gb}", world_size=world)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("layout", "world"), [("cpu", 1), ("cpu_ddp", 2)])
def test_training_on_batched_columns_ends_bitwise_where_the_per_row_path_ends(layout, world, tmp_path):
    runs = {cache_gb: (tmp_path / f"cache{cache_gb}", train_vae(layout, tmp_path / f"cache{cache_gb}", cache_gb, world))
            for cache_gb in (1, 0)}  # fmt: skip
    (batched_dir, batched), (rows_dir, rows) = runs[1], runs[0]
    keys = ("loss", "grad_norm", "eval/loss")
    assert [[r.get(k) for k in keys] for r in batched] == [[r.get(k) for k in keys] for r in rows]
    a, b = final_parameters(batched_dir), final_parameters(rows_dir)
    assert all(torch.equal(a[name], b[name]) for name in b)
    assert read_metrics(batched_dir)[-1]["step"] == 30


@pytest.mark.parametrize(("overrides", "line"), [
    ({}, "data: columns held in memory, one indexing per micro-batch"),
    ({"data_cache_gb": 0, "num_prefetch_batches": 2}, "data: row by row (data_cache_gb=0), 2 prefetched on a thread"),
])  # fmt: skip
def test_the_run_header_says_which_data_path_builds_the_batches(overrides, line, tmp_path, capsys):
    at.train(
        "vae",
        output_dir=str(tmp_path),
        max_steps=1,
        eval_every_steps=0,
        show_progress_bar=False,
        report=False,
        **overrides,
    )
    assert f"  {line}\n" in capsys.readouterr().out
