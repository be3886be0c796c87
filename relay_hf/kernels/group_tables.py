"""The device tables the Triton kernels read a ``PrefixGroups`` layout through (``groups.py``).

A grouped prefix launch walks work items: each a block of at most ``block_m`` of one segment's rows at one level,
with the columns ``ITEM_FIELDS``, and a row list in which the rows of each (level, segment) are consecutive. The
tables depend on the layout and on the launch shape, so they are built once per (device, launch shape) and kept with
the layout (``TableCache``), or written into buffers a static cache pins (CUDA graphs replay on fixed addresses).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

import torch


class PrefixGroups(Protocol):
    """What the tables read of a ``groups.PrefixGroups`` (which imports this module, so it is described here, not
    imported: the package's imports run one way)."""

    depth: int
    offsets: Sequence[int]
    lengths: Sequence[int]
    bases: Sequence[int]
    prefix_lengths: Sequence[int]
    segment_rows: Sequence[Sequence[int]]  # per segment, the rows that read it

    def level_rows(self, level: int) -> Iterable[tuple[int, list[int]]]: ...

# columns of one work item of the grouped prefix kernel (``triton_relay``): a block of one segment's rows
ITEM_FIELDS = ("offset", "length", "base", "row_start", "rows", "block_start", "level")


class GroupTables(NamedTuple):
    """A grouped call's device tables, built ahead (``PrefixGroups.tables``) for one launch shape: what the custom
    op hands the kernels, which cannot take a Python object through ``torch.library``."""

    items: torch.Tensor  # [capacity, 7] int32 work items (ITEM_FIELDS)
    rows: torch.Tensor  # [levels * B] int32 the rows of each (level, segment), consecutive
    row_prefix: torch.Tensor  # [B] int32 each row's prefix length
    depth: int
    segments: int  # per level, as planned


def work_items(groups: PrefixGroups, block_m: int, folded: int, capacity: int) -> tuple[list[list[int]], list[int]]:
    """The grouped prefix kernel's work items and row list (host lists); see ``PrefixGroups.items``."""
    items, row_list = [], []
    for lvl in range(groups.depth):
        for seg, rows in groups.level_rows(lvl):
            start, n = len(row_list), len(rows) * folded
            row_list.extend(rows)
            off, length, base = (0, 0, 0) if seg < 0 else (groups.offsets[seg], groups.lengths[seg], groups.bases[seg])
            for first in range(0, n, block_m):
                items.append([off, length, base, start, n, first, lvl])
    if len(items) > capacity:
        raise ValueError(f"{len(items)} work items exceed the planned {capacity}")
    items.extend([[0, 0, 0, 0, 0, 0, 0]] * (capacity - len(items)))
    return items, row_list


class TableCache:
    """One layout's device tables, keyed by what they were built for; shared by the threads that read the layout
    (a lock guards building, so each table is built once). Keys are ``(device, block_m, folded, capacity)`` for the
    kernel tables and ``("rows", segment, device)`` for the reference's per-segment row indices."""

    def __init__(self):
        self._found: dict[tuple, object] = {}
        self._pinned: set[tuple] = set()  # launch shapes whose tables live in buffers a static cache owns
        self._lock = threading.Lock()

    def row_index(self, groups: PrefixGroups, segment: int, device: torch.device) -> torch.Tensor:
        """``[rows]`` int64 on ``device``: the rows that read ``segment`` (built once per device)."""
        key = ("rows", segment, device)
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = torch.tensor(groups.segment_rows[segment], dtype=torch.int64, device=device)
        return found

    def tables(self, groups: PrefixGroups, device: torch.device, block_m: int, folded: int, capacity: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(items, rows, row_prefix)`` int32 on ``device`` for one launch shape; see ``PrefixGroups.tables``."""
        key = (device, block_m, folded, capacity)
        if key not in self._pinned and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError("a CUDA graph over several prefixes needs their kernel tables pinned in buffers of its "
                             "own (a static RelayCache pins them for its decode shape)")
        found = self._found.get(key)
        if found is None:
            with self._lock:
                found = self._found.get(key)
                if found is None:
                    items, rows = work_items(groups, block_m, folded, capacity)
                    found = tuple(torch.tensor(x, dtype=torch.int32).to(device) for x in
                                  (items, rows or [0], list(groups.prefix_lengths) or [0]))
                    self._found[key] = found
        return found

    def pin(self, groups: PrefixGroups, device: torch.device, block_m: int, folded: int, capacity: int,
            buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Write the tables of one launch shape into ``buffers`` in place; see ``PrefixGroups.pin``."""
        items, rows = work_items(groups, block_m, folded, capacity)
        for buf, values in zip(buffers, (items, rows, list(groups.prefix_lengths))):
            src = torch.tensor(values, dtype=torch.int32)
            if src.numel() > buf.numel():
                raise ValueError(f"a table of {src.numel()} entries does not fit its buffer of {buf.numel()}")
            buf.view(-1)[:src.numel()].copy_(src.view(-1))
        with self._lock:
            self._found[(device, block_m, folded, capacity)] = buffers
            self._pinned.add((device, block_m, folded, capacity))
