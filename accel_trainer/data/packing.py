"""Whole sequences packed into fixed windows by best fit decreasing: fewer windows, less padding, none cut.

A recipe that packs conversations (sft_chat) hands `pack_table` a split's rows as an Arrow table (a batched
`Dataset.map` over the whole split in `arrow` format) and gets windows of exactly `capacity` values, each row
whole in one window, the room left filled, and a `documents` column that marks each value's row (-1 in the fill),
which `collate_packed` (recipes/gpt.py) and the models' attention read. The windows are a function of the row
lengths alone (ties keep the rows' order), so every process of every layout builds the same ones.

Best fit decreasing is TRL's packing (`trl.data_utils._pack_bfd`, the default of `SFTTrainer(packing=True)`), from
"Fewer Truncations Improve Language Modeling" (Ding et al., 2024, arXiv:2404.10830): the longest row first, each
into the window with the least room that holds it, a new window when none does. Ours gives TRL's windows in TRL's
order (tests/unit/data/test_packing.py compares them); it is our own because TRL is not a dependency of the
package. Every pair of its windows holds more than `capacity` values between them (a row opened a window only
where no earlier window had room for it), which greedy packing in order (the earlier sft_chat's) does not promise;
on random lengths it never used more windows than that, though an adversarial order can favour the greedy one
(capacity 7, lengths 2, 2, 3, 2, 2, 3: two windows in order, three by best fit decreasing).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """The rows (indices into `lengths`) of each window, by best fit decreasing; windows in the order they open
    (so the longest rows' first), each window's rows in the order they entered it.

    Among windows with the same room, the one that reached it first takes the row, and equal lengths keep their
    order: TRL's choices. The rooms are kept as a sorted list of the distinct values (at most `capacity` of them),
    where TRL keeps a segment tree over them: the same answer to "the least room at least this length".

    Raises:
        ValueError: a length outside 1..capacity (a row that no window holds, or an empty one).
    """
    if any(not 0 < length <= capacity for length in lengths):
        raise ValueError(f"every length must be in 1..{capacity}: got {min(lengths)}..{max(lengths)}")
    windows: list[list[int]] = []
    with_room: dict[int, deque[int]] = defaultdict(deque)  # room left -> windows with that room, oldest first
    rooms: list[int] = []  # the distinct rooms of windows that can take more, ascending
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # sorted() is stable
        length = lengths[row]
        at = bisect_left(rooms, length)
        if at < len(rooms):
            room = rooms[at]
            window = with_room[room].popleft()
            if not with_room[room]:
                del rooms[at]
        else:
            room, window = capacity, len(windows)
            windows.append([])
        windows[window].append(row)
        left = room - length
        if left > 0:
            if not with_room[left]:
                insort(rooms, left)
            with_room[left].append(window)
    return windows


def pack_table(rows: pa.Table, capacity: int, fills: Mapping[str, int]) -> pa.Table:
    """The list columns named in `fills` packed into windows of exactly `capacity` values by best fit
    decreasing, the room left in a window filled with that column's fill value, and `documents`: each value's
    row in `rows` (-1 in the fill). Every named column holds the same number of values in a row.

    Arrow and NumPy throughout, with no Python object per token: a window's values are its rows' values back to
    back (the rows taken in window order, then laid row-major into the windows' filled positions).

    Raises:
        ValueError: a row longer than `capacity`, an empty one, or columns of unequal lengths in a row.
    """
    lengths = {name: pc.list_value_length(rows[name]).to_numpy(zero_copy_only=False) for name in fills}
    counts = next(iter(lengths.values()))
    if any(not np.array_equal(counts, other) for other in lengths.values()):
        raise ValueError(f"the columns {sorted(fills)} hold different numbers of values in a row")
    windows = best_fit_decreasing(counts.tolist(), capacity)
    order = np.fromiter((row for window in windows for row in window), dtype=np.int64, count=len(counts))
    used = np.array([counts[window].sum() for window in windows], dtype=np.int64)
    filled = np.arange(capacity) < used[:, None]  # (windows, capacity): row-major, a window's values come first
    packed = {
        name: _laid_out(pc.list_flatten(rows[name].take(order)).to_numpy(), filled, fill)
        for name, fill in fills.items()
    }
    packed["documents"] = _laid_out(np.repeat(order, counts[order]), filled, -1)
    return pa.table(packed)


def _laid_out(values: np.ndarray, filled: np.ndarray, fill: int) -> pa.ListArray:
    """`values` in the `filled` positions of windows (the rows of `filled`), `fill` elsewhere: one list a window.
    One column at a time, so that a column's copies are gone before the next is taken."""
    grid = np.full(filled.shape, fill, dtype=np.int64)
    grid[filled] = values
    offsets = pa.array(np.arange(len(grid) + 1, dtype=np.int64) * filled.shape[1], pa.int32())  # raises past 2**31
    return pa.ListArray.from_arrays(offsets, pa.array(grid.ravel()))


def padding_share(documents: pa.ChunkedArray | pa.Array) -> float:
    """The share of the windows' positions that are fill (marked -1 in `documents`, as `pack_table` writes it);
    0.0 for no windows."""
    marks = pc.list_flatten(documents)
    return float(pc.sum(pc.equal(marks, -1)).as_py() or 0) / len(marks) if len(marks) else 0.0


def rows_packed(documents: pa.ChunkedArray | pa.Array) -> int:
    """How many rows the windows hold (the distinct marks in `documents` other than the fill's -1)."""
    marks = pc.list_flatten(documents)
    return int(pc.count_distinct(pc.filter(marks, pc.greater_equal(marks, 0))).as_py())
