"""Prefetching micro-batches on a thread (`num_prefetch_batches`) trains on the same batches in the same order.

The test recipe collates rows itself (the per-row path, where a thread pays) and draws dropout from torch's
global generator in every forward pass, so a batch fetched at another moment of the generator's sequence, or a
loader iterator created on the thread, would change the losses. Runs with and without prefetching end bitwise
equal on one process and two, over epoch boundaries and across a mid-epoch resume; a collate that draws random
numbers itself is refused in one line; a failing row fails the run as it does without a thread. A stream is read
ahead a step at a time, bitwise the same, its checkpoints holding the training's position, not the reading's
(data/stream_split.py's tests play a split stream's two processes).
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

import accel_trainer as at
from accel_trainer.data.prefetch import CHECKED_FETCHES, PrefetchGate, _from_thread, prefetched
from accel_trainer.engine.run import Run
from conftest import WORKERS, assert_bitwise, final_parameters, read_metrics, train_and_dump

at.registry.discover_recipes([WORKERS / "recipes"])


def prefetch_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "accel-trainer-prefetch"]


def losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


def assert_same_training(a, b) -> None:
    assert losses(a) == losses(b)
    assert_bitwise(final_parameters(a), final_parameters(b))


def train(run_dir, **overrides) -> None:
    at.train("rows_with_dropout", output_dir=str(run_dir), show_progress_bar=False, report=False, **overrides)


def test_prefetched_training_is_bitwise_the_training_without_a_thread(tmp_path):
    train(tmp_path / "inline")
    train(tmp_path / "prefetched", num_prefetch_batches=3)
    assert len(losses(tmp_path / "inline")) == 23  # 4 epochs and a part (5 steps an epoch)
    assert_same_training(tmp_path / "inline", tmp_path / "prefetched")


def test_negative_control_a_thread_running_ahead_across_epochs_changes_the_losses(tmp_path, monkeypatch):
    """Why each epoch's loader iterator is created in the training thread: it draws a seed from the global
    generator, and drawn ahead of time it shifts every dropout mask after it."""
    train(tmp_path / "inline")
    whole_run = Run.micro_batches
    monkeypatch.setattr(Run, "micro_batches", lambda run: _from_thread(whole_run(run), 10**6, 3, PrefetchGate(), None))
    train(tmp_path / "ahead")
    assert losses(tmp_path / "ahead") != losses(tmp_path / "inline")


def test_a_prefetched_run_resumed_mid_epoch_ends_where_the_run_without_a_thread_ends(tmp_path):
    """Step 11 is one step into the third epoch: the resumed loader skips 2 of its 10 micro-batches and the
    thread builds 4 of the 8 left."""
    train(tmp_path / "full", save_every_steps=1, keep_last=0)
    train(tmp_path / "resumed", num_prefetch_batches=2,
          resume=str(tmp_path / "full" / "checkpoints" / "step_00000011"))  # fmt: skip
    assert losses(tmp_path / "resumed") == losses(tmp_path / "full")[11:]
    expected, actual = final_parameters(tmp_path / "full"), final_parameters(tmp_path / "resumed")
    assert all(torch.equal(actual[name], expected[name]) for name in expected)


def test_a_collate_that_draws_from_the_global_generator_is_refused_in_one_line_before_any_work(tmp_path):
    with pytest.raises(at.ConfigError, match="num_prefetch_batches: building a training batch draws from a global"):
        train(tmp_path / "refused", num_prefetch_batches=2, random_collate=True)
    assert not (tmp_path / "refused").exists()  # refused while preparing: the new run folder is removed
    train(tmp_path / "inline", random_collate=True)  # without a thread the same recipe trains


def test_prefetching_on_the_batched_column_path_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match="num_prefetch_batches=2 on the batched column path"):
        at.train("vae", output_dir=str(tmp_path), num_prefetch_batches=2, max_steps=2, eval_every_steps=0,
                 show_progress_bar=False, report=False)  # fmt: skip


def test_an_error_building_a_batch_on_the_thread_is_raised_in_the_training_thread(tmp_path):
    """Read 30 belongs to micro-batch 7 of the first epoch, which the thread builds (1-3 are the caller's)."""
    with pytest.raises(ValueError, match="read 30 failed") as failure:
        train(tmp_path, num_prefetch_batches=2, failing_read=30)
    assert "fetch" in [frame.name for frame in failure.traceback]  # raised by the thread's fetch
    assert not prefetch_threads()


@pytest.mark.parametrize("draw", [lambda: torch.rand(1), lambda: np.random.rand(), lambda: random.random()],
                         ids=["torch", "numpy", "random"])  # fmt: skip
def test_a_draw_from_any_global_generator_while_building_a_batch_is_refused(draw):
    def drawing_batches():
        while True:
            draw()
            yield 0

    with pytest.raises(at.ConfigError, match="draws from a global random generator"):
        list(prefetched(drawing_batches(), total=10, depth=2))


class CallerThreads:
    """An iterator of 0..n-1 that records which thread fetched each item."""

    def __init__(self, n: int) -> None:
        self.items, self.threads = iter(range(n)), []

    def __iter__(self):
        return self

    def __next__(self) -> int:
        item = next(self.items)
        self.threads.append(threading.current_thread() is threading.main_thread())
        return item


def test_the_first_fetches_and_the_last_are_made_by_the_caller_the_ones_between_by_the_thread():
    source = CallerThreads(10)
    assert list(prefetched(source, total=10, depth=2)) == list(range(10))
    first = 1 + CHECKED_FETCHES
    assert source.threads == [True] * first + [False] * (10 - first - 1) + [True]


def test_closing_early_stops_the_thread():
    batches = prefetched(iter(range(1000)), total=1000, depth=2)
    assert [next(batches) for _ in range(6)] == list(range(6))
    batches.close()
    assert not prefetch_threads()


def test_while_the_gate_is_paused_the_thread_fetches_nothing():
    gate, source = PrefetchGate(), CallerThreads(1000)
    batches = prefetched(source, total=1000, depth=2, gate=gate)
    [next(batches) for _ in range(5)]
    with gate.paused():
        fetched = len(source.threads)
        time.sleep(0.3)
        assert len(source.threads) == fetched
    next(batches)
    time.sleep(0.1)
    assert len(source.threads) > fetched
    batches.close()


def test_a_stream_read_ahead_trains_bitwise_as_read_in_the_step_and_resumes_where_the_training_was(tmp_path, capsys):
    """A datasets stream of 40 rows: 5 steps a pass, so 23 steps cross four epoch boundaries. Each pass's first
    3 steps are read in the step, the rest by the thread: the checkpoint of step 14, the fourth of its pass,
    is taken while the thread has read the fifth, and holds the position of step 14, not of the reading."""
    stream = dict(stream="datasets", random_collate=True)  # the collate draws: in the step, as without a thread
    train(tmp_path / "inline", **stream)
    train(tmp_path / "ahead", num_prefetch_batches=4, save_every_steps=14, keep_last=0, **stream)
    said = capsys.readouterr().out  # 4 shards: read as readers (data/stream_split.py), ahead
    assert "  data: a stream of 4 shards read as 4 readers" in said and "ahead on a thread, 2 step(s) at most" in said
    assert len(losses(tmp_path / "inline")) == 23
    assert_same_training(tmp_path / "inline", tmp_path / "ahead")

    train(tmp_path / "resumed", num_prefetch_batches=4,
          resume=str(tmp_path / "ahead" / "checkpoints" / "step_00000014"), **stream)  # fmt: skip
    assert losses(tmp_path / "resumed") == losses(tmp_path / "inline")[14:]
    assert_bitwise(final_parameters(tmp_path / "inline"), final_parameters(tmp_path / "resumed"))


def test_a_stream_whose_reading_draws_from_the_global_generator_is_refused_in_one_line(tmp_path):
    with pytest.raises(at.ConfigError, match="num_prefetch_batches: building a training batch draws from a global"):
        train(tmp_path / "refused", num_prefetch_batches=2, stream="random_stream")
    assert not prefetch_threads()
    train(tmp_path / "inline", stream="random_stream")  # without a thread the same recipe trains


@pytest.mark.multiprocess
def test_two_processes_prefetching_train_bitwise_as_without(tmp_path):
    overrides = ["max_steps=12", "micro_batch_size=2"]  # accumulation 2 on each of 2 processes
    train_and_dump("cpu_ddp", tmp_path / "inline", "rows_with_dropout", *overrides, world_size=2)
    train_and_dump("cpu_ddp", tmp_path / "prefetched", "rows_with_dropout", *overrides, "num_prefetch_batches=2",
                   world_size=2)  # fmt: skip
    assert_same_training(tmp_path / "inline", tmp_path / "prefetched")
