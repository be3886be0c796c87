"""``PrefixGroups``: which shared prefix segments each row of a batch reads (several system prompts in one batch,
and a second level such as a document shared by some of a system prompt's rows).

The segments are stored once each, packed along the sequence dim of ONE prefix tensor per layer::

    prefix_key [1, H_kv, P_packed, D]:  | segment 0 | segment 1 | segment 2 | ... | (capacity, unused) |
                                          offsets[j] = lengths[0] + ... + lengths[j - 1]

Row ``b`` reads the segments ``paths[b]``, root first (its level-0 segment, then its level-1 segment, ...): they are
its absolute positions ``0 .. prefix_length(b) - 1``, and its own suffix follows. A segment therefore sits at the same
absolute position (``bases[j]``) in every row that reads it, and its parent segment is the same for all of them (a
tree, as FlashInfer's multi-level cascade and Hydragen's hierarchical sharing have it). A row with an empty path reads
no prefix. ``relay_attention`` computes one partial per (row, level) and merges them with the suffix's by LSE, exactly
as it merges the one prefix of an ungrouped call.

Host-side and immutable: built once per call (or per static cache), read per layer. The device tables the Triton
kernels read are built from it once per launch shape (``tables``) and cached on it (``group_tables``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch

from .group_tables import ITEM_FIELDS, GroupTables, TableCache, work_items

__all__ = ["ITEM_FIELDS", "GroupTables", "PrefixGroups", "paths_of_groups", "tree_of_paths", "window_kept"]


def window_kept(lengths: Sequence[int], window: int | None) -> list[int]:
    """Of segments of these ``lengths``, the tokens a layer with a sliding ``window`` needs: each segment's last
    ``window - 1`` (a query after a segment sees no further back); all of them without a window."""
    return list(lengths) if window is None else [min(n, window - 1) for n in lengths]


def tree_of_paths(K: int, paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Each of ``K`` segments' level and parent segment as ``paths`` read them (``-1``: read by no row / a root;
    ``-2``: the parent of an unread segment), or ``ValueError`` when the paths do not form a tree (a segment read at
    two levels or after two parents, a segment outside ``0..K - 1`` or read twice by one row)."""
    level, parent = [-1] * K, [-2] * K
    for b, path in enumerate(paths):
        if any(isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < K for j in path):
            raise ValueError(f"row {b}'s path {path} names a segment outside 0..{K - 1}")
        if len(set(path)) != len(path):
            raise ValueError(f"row {b}'s path {path} reads a segment twice")
        for depth, j in enumerate(path):
            up = path[depth - 1] if depth else -1
            if level[j] == -1:
                level[j], parent[j] = depth, up
            elif level[j] != depth or parent[j] != up:
                raise ValueError(f"segment {j} is read at level {depth} after segment {up} by row {b}, but at "
                                 f"level {level[j]} after segment {parent[j]} by an earlier row: segments form a "
                                 "tree (one level, one parent each)")
    return level, parent


def paths_of_groups(groups) -> list[list[int]]:
    """Per-row paths from per-row group indices: ``groups`` ``[B]`` (one level) or ``[B, levels]`` integers (a
    tensor or nested lists), ``-1`` for none; level ``l`` of a row is read only if its level ``l - 1`` is."""
    g = torch.as_tensor(groups)
    if g.dtype.is_floating_point or g.dtype == torch.bool or g.dim() not in (1, 2):
        raise ValueError(f"groups must be a [B] or [B, levels] integer tensor, got {g.dtype} {tuple(g.shape)}")
    paths = []
    for b, row in enumerate(g.reshape(g.shape[0], -1).tolist()):
        path = []
        for j in row:
            if j < 0:
                break
            path.append(j)
        if any(j >= 0 for j in row[len(path):]):
            raise ValueError(f"row {b} has groups {row}: a level after a -1")
        paths.append(path)
    return paths


class PrefixGroups:
    """Which packed prefix segments each row reads.

    Args:
        lengths: tokens of each segment, in packing order (``>= 0``; a segment may be empty or read by no row).
        paths: per row, the segments it reads, root first (``()``: none). Each segment must sit at one level with one
            parent for every row that reads it.
        segments_per_level: plan the kernels for up to this many segments per level (each level counting "no
            segment" as one when some row has none), so that layouts of the same depth and capacity share one launch
            plan (a captured CUDA graph replays across them); ``None``: this layout's own count.
        bases, prefix_lengths, window: for a view that keeps only the tail of each segment (``windowed``): each
            stored segment's absolute first position, each row's whole prefix length, and the sliding window the
            view serves. ``None``: derived from the tree (nothing dropped).

    Raises ``ValueError`` naming what does not fit.
    """

    def __init__(self, lengths: Sequence[int], paths: Sequence[Sequence[int]],
                 segments_per_level: int | None = None, *, bases: Sequence[int] | None = None,
                 prefix_lengths: Sequence[int] | None = None, window: int | None = None):
        lengths = tuple(lengths)
        paths = tuple(tuple(p) for p in paths)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths):
            raise ValueError(f"segment lengths must be non-negative ints, got {lengths!r}")
        level, parent = tree_of_paths(len(lengths), paths)
        self.lengths, self.paths = lengths, paths
        self.levels = tuple(level)  # -1: read by no row
        self.parents = tuple(max(p, -1) for p in parent)
        own = max(self._level_counts, default=1)
        if segments_per_level is not None and (not isinstance(segments_per_level, int) or segments_per_level < own):
            raise ValueError(f"segments_per_level={segments_per_level!r} is below this layout's {own}")
        self.segments_per_level = segments_per_level or own
        self.window = window
        if bases is not None:
            self.__dict__["bases"] = tuple(bases)
        if prefix_lengths is not None:
            self.__dict__["prefix_lengths"] = tuple(prefix_lengths)
        self._tables = TableCache()  # the device tables built for this layout, per device and launch shape

    @classmethod
    def from_groups(cls, lengths: Sequence[int], groups) -> PrefixGroups:
        """From per-row group indices: ``groups`` ``[B]`` (one level) or ``[B, levels]`` integers (a tensor or nested
        lists), ``-1`` for none; level ``l`` of a row is read only if its level ``l - 1`` is."""
        return cls(lengths, paths_of_groups(groups))

    # -- derived ---------------------------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self.paths)

    @cached_property
    def depth(self) -> int:
        """Levels (at least 1: a batch that reads no prefix still has the empty level)."""
        return max(1, max((len(p) for p in self.paths), default=0))

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each segment starts in the packed prefix."""
        out, at = [], 0
        for n in self.lengths:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def packed_length(self) -> int:
        """Positions the packed prefix must hold at least."""
        return sum(self.lengths)

    @cached_property
    def bases(self) -> tuple[int, ...]:
        """Absolute position of each segment's first token in the rows that read it (its ancestors' lengths)."""
        out = []
        for j in range(len(self.lengths)):
            at, up = 0, self.parents[j]
            while up >= 0:
                at += self.lengths[up]
                up = self.parents[up]
            out.append(at)
        return tuple(out)

    @cached_property
    def prefix_lengths(self) -> tuple[int, ...]:
        """Per row, its shared tokens (the lengths along its path)."""
        return tuple(sum(self.lengths[j] for j in p) for p in self.paths)

    @property
    def max_prefix_length(self) -> int:
        return max(self.prefix_lengths, default=0)

    @cached_property
    def _level_counts(self) -> list[int]:
        """Per level, segments read there plus one when some row has none there."""
        counts = []
        for lvl in range(max((len(p) for p in self.paths), default=0) or 1):
            segs = {p[lvl] for p in self.paths if len(p) > lvl}
            counts.append(len(segs) + (1 if any(len(p) <= lvl for p in self.paths) else 0))
        return counts

    @cached_property
    def segment_rows(self) -> tuple[tuple[int, ...], ...]:
        """Per segment, the rows that read it."""
        rows: list[list[int]] = [[] for _ in self.lengths]
        for b, p in enumerate(self.paths):
            for j in p:
                rows[j].append(b)
        return tuple(tuple(r) for r in rows)

    def row_index(self, segment: int, device: torch.device) -> torch.Tensor:
        """``[rows]`` int64 on ``device``: the rows that read ``segment`` (built once per device)."""
        return self._tables.row_index(self, segment, device)

    def level_rows(self, level: int) -> list[tuple[int, list[int]]]:
        """``(segment or -1, rows)`` of one level, segments in packing order, then the rows that read none there."""
        by_segment: dict[int, list[int]] = {}
        for b, p in enumerate(self.paths):
            by_segment.setdefault(p[level] if len(p) > level else -1, []).append(b)
        return sorted(by_segment.items(), key=lambda kv: (kv[0] < 0, kv[0]))

    def select(self, rows: Sequence[int]) -> PrefixGroups:
        """The groups of rows ``rows`` (a reorder, repeat or subset of these rows), same segments and plan."""
        return PrefixGroups(self.lengths, [self.paths[b] for b in rows], self.segments_per_level, bases=self.bases,
                            prefix_lengths=[self.prefix_lengths[b] for b in rows], window=self.window)

    def windowed(self, window: int) -> PrefixGroups:
        """The view a sliding-window layer stores: of each segment only its last ``window - 1`` tokens, the most a
        query after it can see (a row's first query sits right after its prefix). Same rows, positions and plan;
        ``self`` when nothing would be dropped."""
        keep = window_kept(self.lengths, window)
        if keep == list(self.lengths):
            return self
        return PrefixGroups(keep, self.paths, self.segments_per_level,
                            bases=[b + n - k for b, n, k in zip(self.bases, self.lengths, keep)],
                            prefix_lengths=self.prefix_lengths, window=window)

    def gather_index(self) -> torch.Tensor:
        """``[B, max_prefix_length]`` int64: for each row's prefix position, where its key is in the packed prefix
        (0 for a position this view does not store: one its own window hides, or past the row's prefix)."""
        index = torch.zeros(self.rows, self.max_prefix_length, dtype=torch.int64)
        for b, path in enumerate(self.paths):
            for j in path:
                base, n = self.bases[j], self.lengths[j]
                index[b, base:base + n] = torch.arange(self.offsets[j], self.offsets[j] + n)
        return index

    def check(self, B: int, P: int) -> None:
        """Raise ``ValueError`` unless these groups fit a call of ``B`` rows over a packed prefix of ``P``
        positions."""
        if self.rows != B:
            raise ValueError(f"prefix_groups describes {self.rows} rows, the query has {B}")
        if self.packed_length > P:
            raise ValueError(f"prefix_groups packs {self.packed_length} positions, prefix_key holds only {P}")

    def summary(self) -> tuple[tuple[int, int, int], ...]:
        """Per segment read by some row: ``(level, rows, tokens)``, in packing order."""
        return tuple((self.levels[j], len(self.segment_rows[j]), n) for j, n in enumerate(self.lengths)
                     if self.levels[j] >= 0)

    # -- device tables (Triton) ------------------------------------------------------------------------------------
    def items(self, block_m: int, folded: int, capacity: int) -> tuple[list[list[int]], list[int]]:
        """The grouped prefix kernel's work items and row list (host lists).

        Each item is a block of at most ``block_m`` of one segment's rows, folded as the kernel folds them (``folded``
        = G * L_q rows per batch row), with the columns ``ITEM_FIELDS``; the rows of each (level, segment), "none"
        included (its items write the empty partial), are consecutive in the row list. Items of one segment are
        adjacent, so programs that read the same prefix tiles run together. Padded to ``capacity`` items with empty
        ones (no rows, no keys)."""
        return work_items(self, block_m, folded, capacity)

    def tables(self, device: torch.device, block_m: int, folded: int, capacity: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(items [capacity, 7], rows [depth * B], row_prefix [B])`` int32 on ``device`` for one launch shape, built
        once and cached (or the buffers ``pin`` placed there). While a CUDA graph is being captured only pinned
        buffers will do: a graph that recorded this object's own tables would read them in every later replay,
        whatever layout a later call has."""
        return self._tables.tables(self, device, block_m, folded, capacity)

    def pin(self, device: torch.device, block_m: int, folded: int, capacity: int,
            buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Write this layout's tables for one launch shape into ``buffers`` (in place, so CUDA graphs recorded on
        them replay with this layout) and use them from now on."""
        self._tables.pin(self, device, block_m, folded, capacity, buffers)

    def __repr__(self) -> str:
        return (f"PrefixGroups(rows={self.rows}, depth={self.depth}, segments={len(self.lengths)}, "
                f"packed_length={self.packed_length})")
