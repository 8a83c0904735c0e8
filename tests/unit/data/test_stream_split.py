"""A sharded stream split over the processes: each reads only its shards, every example once an epoch, the
epoch ending together, and a resume continuing each process's part exactly, from datasets' own state or (with a
shuffle buffer) by re-reading that part. Two processes are played by two threads that agree on each step.
"""

from __future__ import annotations

import threading
import time

import datasets
import pytest
import torch

from accel_trainer.data import loaders
from accel_trainer.data.batching import plan_batches
from accel_trainer.data.prefetch import prefetched
from accel_trainer.data.stream_split import SplitStream, gathered, has_shuffle_buffer, position_for, splits
from accel_trainer.data.streams import whole_position
from accel_trainer.errors import ConfigError

PLAN = plan_batches(8, 2, 2)  # each process: 2 micro-batches of 2 a step
PER_STEP = 4  # examples each process reads a step


def sharded(sizes: list[int], shuffle: bool = False) -> datasets.IterableDataset:
    """Shards of the given sizes holding 0, 1, 2, ... in order."""
    shards = []
    for size in sizes:
        start = sum(len(shard) for shard in shards)
        shards.append(list(range(start, start + size)))
    stream = datasets.IterableDataset.from_generator(
        lambda shards: ({"x": x} for shard in shards for x in shard), gen_kwargs={"shards": shards}
    )
    return stream.shuffle(seed=3, buffer_size=8) if shuffle else stream


def read_on_two_processes(dataset, steps: int, saved=None, said=None, ahead=None) -> list[tuple[SplitStream, list]]:
    """`steps` steps of each process's micro-batches, the processes summing counts as all_reduce would;
    `ahead`: that many steps read ahead on a thread (num_prefetch_batches)."""
    barrier, counts = threading.Barrier(2), [0, 0]
    results: list = [None, None]

    def process(rank: int) -> None:
        def total(count: int) -> int:
            counts[rank] = count
            barrier.wait()
            answer = sum(counts)
            barrier.wait()
            return answer

        collate = lambda rows: [int(r["x"]) for r in rows]  # noqa: E731
        warn = (said if said is not None else []).append if rank == 0 else lambda line: None
        stream = SplitStream(dataset, loaders.as_torch, collate, PLAN, rank, total, warn, read_ahead(ahead))
        batches = stream.micro_batches(position_for(saved, rank, 2), None)
        results[rank] = stream, [next(batches) for _ in range(steps * PLAN.accumulation_steps)]

    threads = [threading.Thread(target=process, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def read_ahead(depth: int | None):
    return (lambda steps: steps) if depth is None else lambda steps: prefetched(steps, None, depth)


def epoch_examples(batches, epoch: int) -> list[int]:
    return [x for e, batch in batches for x in batch if e == epoch]


def test_each_process_reads_only_its_own_shards_and_every_example_is_read_once_an_epoch():
    (_, first), (_, second) = read_on_two_processes(sharded([8, 8, 8, 8]), steps=4)  # one epoch: 32 examples

    assert sorted(epoch_examples(first, 0) + epoch_examples(second, 0)) == list(range(32))
    assert set(epoch_examples(first, 0)) == {*range(0, 8), *range(16, 24)}  # shards 0 and 2
    assert set(epoch_examples(second, 0)) == {*range(8, 16), *range(24, 32)}  # shards 1 and 3


def test_the_epoch_ends_for_every_process_at_the_first_step_one_cannot_fill_and_the_run_says_what_it_dropped():
    said: list[str] = []
    (_, first), (_, second) = read_on_two_processes(sharded([8, 4, 8, 4]), steps=6, said=said)  # process 1: 8

    assert [epoch for epoch, _ in first] == [0] * 4 + [1] * 4 + [2] * 4  # 2 steps of each epoch, then the next
    assert [epoch for epoch, _ in second] == [0] * 4 + [1] * 4 + [2] * 4
    assert epoch_examples(first, 1)[:4] == [0, 1, 2, 3]  # its part starts again; 8 of its 16 were dropped
    assert said == [  # once, not at every epoch
        "accel-trainer: epoch 1 of the split training stream ended where one process's part did: 8 examples of"
        " the longer parts were not trained on (its shards differ in size; more, evener shards lose less, and"
        " stream_split=off reads every example)"
    ]


def test_equal_parts_end_their_epochs_without_a_word():
    said: list[str] = []
    read_on_two_processes(sharded([8, 8, 8, 8]), steps=6, said=said)
    assert said == []


@pytest.mark.parametrize("ahead", [None, 2], ids=["read in the step", "read ahead"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["from datasets' state", "re-reading a shuffled part"])
def test_a_resume_continues_each_process_where_it_was(shuffle, ahead):
    """8 steps a pass: reading ahead, the thread reads from step 4 on, so at step 5 it has read beyond."""
    uninterrupted = read_on_two_processes(sharded([16, 16, 16, 16], shuffle), steps=10)
    stopped = read_on_two_processes(sharded([16, 16, 16, 16], shuffle), steps=5, ahead=ahead)
    position = gathered([(rank, stream.position()) for rank, (stream, _) in enumerate(stopped)])

    resumed = read_on_two_processes(sharded([16, 16, 16, 16], shuffle), steps=5, saved=position)

    assert [s.exact_state for s, _ in stopped] == [not shuffle] * 2
    for rank in (0, 1):
        assert resumed[rank][1] == uninterrupted[rank][1][5 * PLAN.accumulation_steps :]


def test_reading_ahead_on_a_thread_changes_nothing_the_processes_train_on_or_say():
    said_inline: list[str] = []
    said_ahead: list[str] = []
    inline = read_on_two_processes(sharded([8, 4, 8, 4]), steps=9, said=said_inline)  # 3 epochs, 8 dropped each
    ahead = read_on_two_processes(sharded([8, 4, 8, 4]), steps=9, said=said_ahead, ahead=3)

    assert [batches for _, batches in ahead] == [batches for _, batches in inline]
    assert said_ahead == said_inline and len(said_inline) == 1


def test_a_thread_reads_ahead_while_the_position_stays_where_the_training_is():
    produced: list[int] = []

    def counted(values: list[int]):
        for x in values:
            produced.append(x)
            yield {"x": x}

    stream = SplitStream(datasets.IterableDataset.from_generator(counted, gen_kwargs={"values": list(range(64))}),
                         loaders.as_torch, lambda rows: [int(r["x"]) for r in rows], plan_batches(4, 2, 1), 0,
                         lambda count: count, ahead=read_ahead(4))  # fmt: skip
    batches = stream.micro_batches(None, None)
    taken = [next(batches) for _ in range(10)]  # 5 steps of 4 examples: 3 read in the step, then the thread's
    deadline = time.monotonic() + 10
    while len(produced) < 20 + 4 * 4 and time.monotonic() < deadline:
        time.sleep(0.01)

    assert len(produced) >= 20 + 4 * 4  # 4 steps queued beyond the one in hand
    assert stream.position()["read"] == 20 and [x for _, batch in taken for x in batch] == list(range(20))
    batches.close()
    assert not [thread for thread in threading.enumerate() if thread.name == "accel-trainer-prefetch"]


def test_only_a_stream_of_shards_dividing_over_the_processes_is_split_and_shards_insists():
    assert splits(sharded([4] * 4), "auto", 2) and splits(sharded([4] * 4), "shards", 4)
    assert not splits(sharded([4] * 3), "auto", 2)  # read whole instead
    assert not splits(sharded([4] * 4), "off", 2) and not splits(sharded([4] * 4), "auto", 1)
    with pytest.raises(ConfigError, match=r"has 3 shard\(s\), which do not split over 2 .* a multiple of 2 shards"):
        splits(sharded([4] * 3), "shards", 2)
    with pytest.raises(ConfigError, match="is not a datasets.IterableDataset: it has no shards"):
        splits(TorchStream(), "shards", 2)


class TorchStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_a_shuffle_buffer_is_seen_through_the_stream_s_transformations():
    assert has_shuffle_buffer(sharded([4] * 4, shuffle=True).map(lambda row: row).with_format("torch"))
    assert not has_shuffle_buffer(sharded([4] * 4).map(lambda row: row))


def test_a_position_saved_one_way_is_refused_the_other_way_in_one_line():
    split_position = {"parts": [{"epoch": 0, "read": 4, "state": None}] * 2}
    with pytest.raises(ConfigError, match="split over 2 data-parallel processes and this run has 4: resume on 2$"):
        position_for(split_position, 0, 4)
    with pytest.raises(ConfigError, match="saved reading the stream whole .* resume with stream_split=off$"):
        position_for([0, 8], 0, 2)
    with pytest.raises(ConfigError, match="reads it whole: resume on 2 data-parallel processes with stream_split=auto"):
        whole_position(split_position)


def test_canary_datasets_resume_of_a_shuffled_stream_drops_its_buffer():
    """datasets' documented limit, which a split stream with a shuffle buffer works around by re-reading its part
    (stream_split.py). The day a resume from state_dict() continues exactly, this fails: resume from the state."""
    stream = sharded([16, 16], shuffle=True)
    uninterrupted = [row["x"] for row in stream]
    reading = iter(stream)
    first = [next(reading)["x"] for _ in range(10)]
    state = stream.state_dict()

    resumed = sharded([16, 16], shuffle=True)
    resumed.load_state_dict(state)
    rest = [row["x"] for row in resumed]

    assert first == uninterrupted[:10]
    assert first + rest != uninterrupted and len(first + rest) < len(uninterrupted)
