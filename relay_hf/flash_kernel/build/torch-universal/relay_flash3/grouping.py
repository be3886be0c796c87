"""Which requests of a paged decode step share leading pages, derived on the device from the block table.

Continuous batching with block sharing gives requests that start with the same complete pages the same page ids, so
a run of identical leading entries in two rows of the block table is KV stored once. This module turns the block
table into tile tables for the kernels, with static shapes and no host synchronisation, so a CUDA graph captured at
one mix of requests replays correctly at any other.

Two levels (a system prompt shared by a group, then a document shared by part of it):

* level 1: rows whose first complete page is the same page form a group; the group's prefix is the leading pages
  every member shares with the group's first row (its leader);
* level 2: inside a level-1 group, rows that share more pages than the group's prefix with a fellow member form a
  subgroup the same way; its prefix is the pages after the level-1 prefix that every member shares with its leader.

A page counts only if it was complete before this step's write (a shared page is never partly filled; the page the
new token goes to is private). Groups of one row get no shared prefix: the row reads all of its pages as its suffix.

Tensors (all int32 unless said otherwise; ``B`` rows of the step, ``M`` block-table columns):

* ``block_table [B, M]`` page ids, ``-1`` where unallocated; ``past [B]`` tokens in the cache before this step's
  write (``-1``: a padding row);
* ``Groups.tiles [2 * B, 4]``: ``(level, leader, first, count)`` one tile of up to ``rows_per_tile`` members of one
  group of ``level`` (1 or 2); ``first`` indexes ``Groups.members[level - 1]``; level 1's live tiles are rows
  ``0 .. counts[0]``, level 2's rows ``B .. B + counts[1]``; unused tiles have ``count = 0``;
* ``Groups.counts [2]``: the live tiles of each level;
* ``Groups.members [2, B]``: per level, the rows ordered by their leader (a group's members are consecutive);
* ``Groups.bounds [B, 3]``: per row, in pages, the end of its level-1 prefix, the end of its level-2 prefix, and
  where its suffix starts (``0`` when the row is in no group of two or more).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

try:
    from . import grouping_jit
except ImportError:  # pragma: no cover
    grouping_jit = None


class Groups(NamedTuple):
    tiles: torch.Tensor  # [2 * B, 4] int32 (level, leader, first, count)
    counts: torch.Tensor  # [2] int32 live tiles of level 1 (rows 0..) and level 2 (rows B..)
    members: torch.Tensor  # [2, B] int32
    bounds: torch.Tensor  # [B, 3] int32 (level-1 end, level-2 end, suffix start), pages


def pages_shared_with(table: torch.Tensor, complete: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: how many leading pages row ``b`` shares with row ``other[b]`` (identical ids, complete in
    both). ``[B, M]`` work: each row is compared with one row only."""
    columns = torch.arange(table.shape[1], device=table.device)
    limit = torch.minimum(complete, complete[other])
    differs = (table != table[other]) | (columns >= limit[:, None])  # [B, M]
    # the first differing column (M where none differs) is the length of the shared run
    return torch.where(differs, columns, table.shape[1]).amin(-1)


def _leaders(candidate: torch.Tensor) -> torch.Tensor:
    """``[B]``: per column ``b`` the first row ``a`` with ``candidate[a, b]``, or ``b`` itself where there is none."""
    rows = torch.arange(candidate.shape[0], device=candidate.device)
    return torch.where(candidate.any(0), candidate.to(torch.int8).argmax(0), rows)


def _group_min(leader: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the minimum of ``values`` over the rows with the same leader, and how many rows that is."""
    big = torch.full_like(values, torch.iinfo(values.dtype).max)
    least = big.scatter_reduce(0, leader, values, "amin")
    size = torch.zeros_like(values).scatter_add_(0, leader, torch.ones_like(values))
    return least[leader], size[leader]


def _tiles(level: int, leader: torch.Tensor, size: torch.Tensor, pages: torch.Tensor, rows_per_tile: int):
    """The tiles of one level (``[B, 4]``, the live ones first), its members in leader order (``[B]``) and how many
    tiles are live (``[1]``)."""
    rows = torch.arange(leader.shape[0], device=leader.device)
    members = torch.argsort(leader * leader.shape[0] + rows)  # stable: grouped by leader, in row order
    is_leader = (leader == rows) & (size >= 2) & (pages > 0)
    count = torch.where(is_leader, (size + rows_per_tile - 1) // rows_per_tile, 0)  # tiles per group, by leader id
    ends = torch.cumsum(count, 0)
    starts_in_members = torch.cumsum(torch.zeros_like(size).scatter_add_(0, leader, torch.ones_like(size)), 0)
    group_first = starts_in_members - torch.zeros_like(size).scatter_add_(0, leader, torch.ones_like(size))
    tile = rows  # B tiles at most: a group of n rows has at most n tiles
    owner = torch.searchsorted(ends, tile, right=True).clamp(max=leader.shape[0] - 1)
    chunk = tile - (ends[owner] - count[owner])
    live = tile < ends[-1]
    first = group_first[owner] + chunk * rows_per_tile
    n = torch.where(live, torch.minimum(size[owner] - chunk * rows_per_tile, torch.full_like(size, rows_per_tile)), 0)
    table = torch.stack([torch.full_like(rows, level), owner, first, n], 1)
    return table, members, ends[-1:]


def share_groups(block_table: torch.Tensor, past: torch.Tensor, page_size: int, rows_per_tile: int,
                 triton: bool | None = None) -> Groups:
    """The step's groups (module docstring), from ``block_table [B, M]`` and ``past [B]`` tokens already cached:
    one Triton program (``grouping_jit``) where Triton runs (CUDA, or its CPU interpreter) and the step has at most
    ``grouping_jit.MAX_ROWS`` rows, else ``share_groups_torch``. ``triton`` forces the choice (tests)."""
    batch, columns = block_table.shape
    if triton is None:
        triton = (grouping_jit is not None and grouping_jit.HAS_TRITON and 0 < batch <= grouping_jit.MAX_ROWS
                  and columns > 0
                  and (block_table.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"))
    if not triton:
        return share_groups_torch(block_table, past, page_size, rows_per_tile)
    device = block_table.device
    table = block_table.to(torch.int32)
    table = table if table.stride(-1) == 1 else table.contiguous()
    work = torch.empty(grouping_jit.ROWS, batch, device=device, dtype=torch.int32)
    tiles = torch.empty(2 * batch, 4, device=device, dtype=torch.int32)
    counts = torch.empty(2, device=device, dtype=torch.int32)
    members = torch.empty(2, batch, device=device, dtype=torch.int32)
    bounds = torch.empty(batch, 3, device=device, dtype=torch.int32)
    grouping_jit._groups_kernel[(1,)](table, past.to(torch.int32).contiguous(), work, tiles, counts,
                                      members, bounds, table.stride(0), batch, columns, page_size, rows_per_tile,
                                      CHUNK=grouping_jit.CHUNK, COLUMNS=grouping_jit.COLUMNS, num_warps=4)
    return Groups(tiles, counts, members, bounds)


def share_groups_torch(block_table: torch.Tensor, past: torch.Tensor, page_size: int, rows_per_tile: int) -> Groups:
    """``share_groups`` as tensor operations (the CPU path, large steps, and the kernel's reference).

    Sharing a run of leading pages is transitive (the ids are identical), so a level's groups are rows with the same
    page at one column: column 0 for level 1, the column after the group's prefix for level 2. ``[B, B]`` and
    ``[B, M]`` work, nothing of ``[B, B, M]``."""
    table = block_table.to(torch.int64)
    complete = torch.where(past >= 0, past.to(torch.int64) // page_size, 0)  # pages complete before this step
    rows = torch.arange(table.shape[0], device=table.device)
    alone = -1 - rows  # a key no other row has
    key1 = torch.where(complete >= 1, table[:, 0], alone)
    leader1 = _leaders(key1[:, None] == key1[None, :])
    shared1, size1 = _group_min(leader1, pages_shared_with(table, complete, leader1))
    shared1 = torch.where(size1 >= 2, shared1, 0)
    at = table.gather(1, shared1.clamp(max=table.shape[1] - 1)[:, None])[:, 0]  # the page after the prefix
    key2 = torch.where(complete > shared1, at, alone)
    leader2 = _leaders((leader1[:, None] == leader1[None, :]) & (key2[:, None] == key2[None, :]))
    shared2, size2 = _group_min(leader2, pages_shared_with(table, complete, leader2))
    in2 = size2 >= 2
    shared2 = torch.where(in2, shared2, shared1)
    tiles1, members1, live1 = _tiles(1, leader1, size1, shared1, rows_per_tile)
    tiles2, members2, live2 = _tiles(2, leader2, torch.where(in2, size2, 0), shared2 - shared1, rows_per_tile)
    tiles = torch.cat([tiles1, tiles2]).to(torch.int32)
    members = torch.stack([members1, members2]).to(torch.int32)
    bounds = torch.stack([shared1, shared2, shared2], 1).to(torch.int32)
    return Groups(tiles, torch.cat([live1, live2]).to(torch.int32), members, bounds)


def prefix_reads(groups: Groups, past: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[3]`` int64 on the device, for a process-wide tally: ``(1, rows, tokens)`` for a step in which some tile
    read shared pages (rows: the step's requests; tokens: shared tokens the requests would each have read, less
    those the tiles read), ``(0, 0, 0)`` otherwise. Static shapes, no synchronisation."""
    tiles, bounds = groups.tiles.long(), groups.bounds.long()
    level, lead, live = tiles[:, 0], tiles[:, 1], tiles[:, 3] > 0
    pages = torch.where(level == 1, bounds[lead, 0], bounds[lead, 1] - bounds[lead, 0])
    read = torch.where(live, pages, 0).sum()
    shared = live.any().long()
    rows = (past >= 0).sum()
    return torch.stack([shared, shared * rows, (bounds[:, 2].sum() - read) * page_size])
