"""Best-fit-decreasing packing (accel_trainer/data/packing.py): whole rows in full windows, TRL's windows, the
same on every process; and sft_chat's use of it (its windows, and the line on their padding)."""

from __future__ import annotations

import random
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import accel_trainer as at
from accel_trainer.data.packing import best_fit_decreasing, pack_table, padding_share, rows_packed

CAPACITIES = st.integers(1, 64)


@st.composite
def lengths_and_capacity(draw: st.DrawFn) -> tuple[list[int], int]:
    capacity = draw(CAPACITIES)
    return draw(st.lists(st.integers(1, capacity), max_size=60)), capacity


def greedy_in_order(lengths: list[int], capacity: int) -> int:
    """How many windows the earlier sft_chat packing filled: rows in order, a new window when the next one does
    not fit the current."""
    windows, used = 0, capacity
    for length in lengths:
        if used + length > capacity:
            windows, used = windows + 1, 0
        used += length
    return windows


@given(lengths_and_capacity())
def test_every_row_is_in_exactly_one_window_and_no_window_holds_more_than_its_capacity(case):
    lengths, capacity = case
    windows = best_fit_decreasing(lengths, capacity)
    assert sorted(row for window in windows for row in window) == list(range(len(lengths)))
    assert all(window and sum(lengths[row] for row in window) <= capacity for window in windows)


@given(lengths_and_capacity())
def test_every_two_windows_hold_more_than_the_capacity_between_them(case):
    """A row opens a window only where no earlier window has room for it, and it is the new window's longest:
    so no two windows could have been one (greedy packing in order promises this of neighbours alone)."""
    lengths, capacity = case
    used = sorted(sum(lengths[row] for row in window) for window in best_fit_decreasing(lengths, capacity))
    assert len(used) < 2 or used[0] + used[1] > capacity


def random_lengths(chooser: random.Random, capacity: int) -> list[int]:
    """Up to 300 lengths, uniform up to the capacity, or to a third of it, or long-tailed (log-normal)."""
    count, shape = chooser.randint(1, 300), chooser.randrange(3)
    if shape == 2:
        return [min(capacity, max(1, int(chooser.lognormvariate(0, 1) * capacity / 4))) for _ in range(count)]
    return [chooser.randint(1, capacity if shape == 0 else capacity // 3 + 1) for _ in range(count)]


def test_best_fit_decreasing_never_needs_more_windows_than_greedy_packing_in_order_on_random_lengths():
    chooser = random.Random(0)
    for _ in range(300):
        capacity = chooser.choice([16, 129, 513])
        lengths = random_lengths(chooser, capacity)
        assert len(best_fit_decreasing(lengths, capacity)) <= greedy_in_order(lengths, capacity), (capacity, lengths)


def test_an_adversarial_order_can_favour_greedy_packing_in_order():
    """Why the test above draws random lengths: best fit decreasing is not better on every input."""
    lengths = [2, 2, 3, 2, 2, 3]
    assert greedy_in_order(lengths, 7) == 2
    assert best_fit_decreasing(lengths, 7) == [[2, 5], [0, 1, 3], [4]]


def test_the_longest_row_goes_first_and_each_row_into_the_window_with_the_least_room_that_holds_it():
    #        row:  0  1  2  3
    lengths = [3, 8, 1, 6]
    # 8 opens a window (room 2), 6 another (room 4), 3 joins the second (room 1), and 1 goes where the least room
    # holds it, the second window (first fit would take the first)
    assert best_fit_decreasing(lengths, 10) == [[1], [3, 0, 2]]


def test_a_row_no_window_holds_or_an_empty_one_is_refused():
    with pytest.raises(ValueError, match=r"every length must be in 1..4: got 1..5"):
        best_fit_decreasing([1, 5], 4)
    with pytest.raises(ValueError, match=r"got 0..2"):
        best_fit_decreasing([0, 2], 4)
    assert best_fit_decreasing([], 4) == []


@settings(max_examples=30, deadline=None)
@given(lengths_and_capacity())
def test_the_windows_are_trls_best_fit_decreasing_windows(case):
    """TRL's `pack_dataset(..., strategy="bfd")` (SFTTrainer's packing) on rows whose every token is the row's
    number: each window's numbers, in order, are our window's rows."""
    import datasets

    trl = pytest.importorskip("trl")
    lengths, capacity = case
    if not lengths:
        return
    rows = datasets.Dataset.from_dict({"input_ids": [[row] * length for row, length in enumerate(lengths)]})
    theirs = trl.pack_dataset(rows, capacity, strategy="bfd")["input_ids"]
    assert [list(dict.fromkeys(window)) for window in theirs] == best_fit_decreasing(lengths, capacity)


def rows_of(lengths: list[int]) -> pa.Table:
    """Rows whose tokens are 100 * row + position and whose mask is 1 from the row's middle on."""
    ids = [[100 * row + i for i in range(length)] for row, length in enumerate(lengths)]
    masks = [[int(i >= length // 2) for i in range(length)] for length in lengths]
    return pa.table(
        {"input_ids": pa.array(ids, pa.list_(pa.int64())), "assistant_masks": pa.array(masks, pa.list_(pa.int64()))}
    )


def test_a_packed_window_is_its_rows_whole_and_back_to_back_then_the_fill_marked_minus_one():
    packed = pack_table(rows_of([3, 6, 4, 5, 2, 1]), 10, {"input_ids": -7, "assistant_masks": 0}).to_pydict()
    assert packed["documents"] == [
        [1] * 6 + [2] * 4,
        [3] * 5 + [0] * 3 + [4] * 2,
        [5] + [-1] * 9,
    ]
    assert packed["input_ids"][1] == [300, 301, 302, 303, 304, 0, 1, 2, 400, 401]
    assert packed["input_ids"][2] == [500] + [-7] * 9
    assert packed["assistant_masks"][1] == [0, 0, 1, 1, 1, 0, 1, 1, 0, 1]
    assert packed["assistant_masks"][2] == [1] + [0] * 9


@given(lengths_and_capacity())
def test_packing_keeps_every_rows_values_and_fills_only_the_room_left(case):
    lengths, capacity = case
    packed = pack_table(rows_of(lengths), capacity, {"input_ids": -7, "assistant_masks": 0})
    ids, marks = np.array(packed["input_ids"].to_pylist()), np.array(packed["documents"].to_pylist())
    assert ids.shape == (len(best_fit_decreasing(lengths, capacity)), capacity) or not lengths
    for row, length in enumerate(lengths):
        assert ids[marks == row].tolist() == [100 * row + i for i in range(length)]
    assert (ids[marks == -1] == -7).all()
    assert padding_share(packed["documents"]) == pytest.approx(1 - sum(lengths) / ids.size if ids.size else 0)
    assert rows_packed(packed["documents"]) == len(lengths)


def test_the_windows_depend_on_the_lengths_alone():
    """What makes them the same on every process and layout: no state, no randomness, the rows' values unread."""
    chooser = random.Random(1)
    lengths = [chooser.randint(1, 129) for _ in range(500)]
    first = pack_table(rows_of(lengths), 129, {"input_ids": 0, "assistant_masks": 0})
    assert pack_table(rows_of(lengths), 129, {"input_ids": 0, "assistant_masks": 0}).equals(first)
    other = pa.table(
        {"input_ids": [[7] * length for length in lengths], "assistant_masks": [[1] * length for length in lengths]}
    )
    assert pack_table(other, 129, {"input_ids": 0, "assistant_masks": 0})["documents"].equals(first["documents"])


def test_columns_of_unequal_lengths_in_a_row_are_refused():
    rows = pa.table({"input_ids": [[1, 2], [3]], "assistant_masks": [[0, 1], [1, 1]]})
    with pytest.raises(ValueError, match="hold different numbers of values in a row"):
        pack_table(rows, 4, {"input_ids": 0, "assistant_masks": 0})


def test_sft_chats_windows_hold_each_conversation_whole_and_its_line_gives_the_padding_share():
    import datasets

    sft_chat = sys.modules[at.get_recipe("sft_chat").__module__]
    rows = rows_of([3, 6, 4, 5, 2, 1])
    windows = datasets.Dataset.from_dict(rows.to_pydict()).with_format("arrow")
    windows = windows.map(sft_chat.pack, batched=True, batch_size=None, fn_kwargs={"window": 10, "pad_id": -7},
                          remove_columns=rows.column_names).with_format(None)  # fmt: skip
    assert windows.column_names == ["input_ids", "assistant", "documents"]
    assert windows[2] == {"input_ids": [500] + [-7] * 9, "assistant": [1] + [0] * 9, "documents": [5] + [-1] * 9}
    line = sft_chat.packing_line({"training": windows, "held-out": windows.select([2])}, 10)
    assert line == (
        "accel-trainer: conversations packed whole in windows of 10 tokens (best fit decreasing): training 6 into 3"
        " (30.0% padding), held-out 1 into 1 (90.0% padding)"
    )
