"""The launch layout of one relay call: which units (programs) run in which launch, with which tiles, and how the
prefix and the suffix are split. Pure functions of sizes, an SM count and a ``KernelConfig``; nothing here touches a
tensor or imports Triton.

Vocabulary (``jit.py`` has the kernels these numbers drive): ``N = B*G*L_q`` query rows folded per KV head; a prefix
unit is ``(row block, split)`` of the shared prefix, a suffix unit ``(row, row block, split)`` of one row's suffix;
each unit writes one partial slot, merged by LSE.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from .config import DEFAULT_CONFIG, KernelConfig, tile_row
from .groups import GroupTables, PrefixGroups


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)``, as ``triton.cdiv``."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def block_d(head_dim: int) -> int:
    """The padded head dim ``BLOCK_D`` of the kernels' tiles."""
    return max(16, next_power_of_2(head_dim))


def block_m(rows: int, cap: int) -> int:
    """Query rows per program for ``rows`` rows: a power of two from 16 (the smallest ``tl.dot`` tile) to ``cap``."""
    return min(cap, max(16, next_power_of_2(rows)))


def prefix_split_count(P: int, N: int, H_kv: int, block_m: int, block_n: int, num_sms: int, waves: int | None = None,
                budget: int | None = None, whole_waves: bool = False,
                config: KernelConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """``(splits, tiles_per_split)`` for the prefix: enough programs for ``waves`` (``config.split_waves``) per SM
    (with ``whole_waves``: as many as fit, never a partial wave more), few enough that the partials
    (``splits * N * D`` elements per head) stay within ``1/budget`` (``config.partial_budget``) of the prefix
    (``P * D`` elements per head, K and V), and at most ``config.max_splits``."""
    if P == 0:
        return 0, 1
    waves, budget = waves or config.split_waves, budget or config.partial_budget
    n_tiles = cdiv(P, block_n)
    units = H_kv * cdiv(N, block_m)
    want = max(1, waves * num_sms // units) if whole_waves else cdiv(waves * num_sms, units)
    cap = max(1, P // (budget * N))
    splits = max(1, min(n_tiles, want, cap, config.max_splits))
    per = cdiv(n_tiles, splits)
    return cdiv(n_tiles, per), per


def suffix_split_count(L_s: int, units: int, H_kv: int, block_n: int, num_sms: int,
                       config: KernelConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """``(splits, tiles_per_split)`` for the suffix: split each row's suffix only when ``units * H_kv`` programs
    (one per row and row block) would leave SMs idle (``config.suffix_waves`` programs per SM)."""
    n_tiles = max(1, cdiv(L_s, block_n))
    want = cdiv(config.suffix_waves * num_sms, H_kv * units)
    splits = max(1, min(n_tiles, want, config.max_splits))
    per = cdiv(n_tiles, splits)
    return cdiv(n_tiles, per), per


def group_block_m(N: int, D: int, segments: int, config: KernelConfig = DEFAULT_CONFIG) -> int:
    """Query rows per grouped prefix program: the ungrouped rule's cap for ``N`` folded rows, sized for the rows of a
    typical segment (``N / segments``), so small groups do not run mostly empty row blocks."""
    cap = (tile_row(config.prefix_tiles, block_d(D))[0] if config.separate_rows[0] <= N <= config.separate_rows[1]
           else config.max_block_m)
    return block_m(cdiv(N, max(1, segments)), cap)


def group_items(N: int, block_m: int, depth: int, segments: int) -> int:
    """Work items a grouped launch plans for: per level, every segment's rows in blocks (``N / block_m`` blocks, plus
    at most one partial block per segment)."""
    return depth * (cdiv(N, block_m) + segments)


def group_split_count(P: int, N: int, segments: int, items: int, H_kv: int, block_n: int, num_sms: int,
                      waves: int | None = None, budget: int | None = None, whole_waves: bool = False,
                      config: KernelConfig = DEFAULT_CONFIG) -> int:
    """Splits of every segment of a grouped prefix (``P`` packed positions, ``segments`` of them per level): the rule of
    ``prefix_split_count`` for a typical segment (``P / segments`` positions read by ``N / segments`` folded rows), over
    ``items`` work items. At least 1: an empty segment still writes its rows' empty partial."""
    waves, budget = waves or config.split_waves, budget or config.partial_budget
    seg, rows = max(1, P // max(1, segments)), max(1, N // max(1, segments))
    units = H_kv * max(1, items)
    want = max(1, waves * num_sms // units) if whole_waves else cdiv(waves * num_sms, units)
    cap = max(1, seg // (budget * rows))
    return max(1, min(cdiv(seg, block_n), want, cap, config.max_splits))


def group_shape(groups: PrefixGroups | GroupTables) -> tuple[int, int]:
    """``(levels, segments per level)`` a grouped call plans for."""
    if isinstance(groups, GroupTables):
        return groups.depth, groups.segments
    return groups.depth, groups.segments_per_level


def grouped_launch_shape(N: int, D: int, groups: PrefixGroups | GroupTables,
                         config: KernelConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """``(block_m, items)``: the row block and work-item capacity a grouped launch of ``N`` folded rows uses, for
    ``PrefixGroups.tables`` (which the caller may build ahead, e.g. into buffers a CUDA graph replays)."""
    depth, segments = group_shape(groups)
    rows = group_block_m(N, D, segments, config)
    return rows, group_items(N, rows, depth, segments)


class LaunchLayout(NamedTuple):
    """One call's launch layout: which units run where, with which tiles (``jit.py`` has the kernels)."""

    sep: bool  # separate prefix and suffix launches (else one launch for both kinds)
    prefix: tuple[int, int, int, int]  # (BLOCK_M rows, BLOCK_N keys, warps, stages) of the prefix units
    suffix: tuple[int, int, int, int]  # the same for the suffix units (one launch: the prefix's keys/warps/stages)
    p_blocks: int  # prefix row blocks (of the N = B*G*L_q rows), or grouped: work items (table rows)
    p_splits: int
    p_per: int  # prefix tiles per split (grouped: per segment, in the kernel)
    s_blocks: int  # suffix row blocks (of one batch row's G*L_q rows)
    s_splits: int
    s_per: int
    fuse_slots: int  # > 0: the suffix launch merges the prefix slots in a tile this wide (power of two); 0: no
    pdl: bool  # the fused suffix launch starts while the prefix launch runs (PDL; a prefix, Hopper+)
    pair: bool  # each fused suffix program streams two batch rows (see KernelConfig.suffix_pair_above)
    rows: int  # batch rows B
    p_slots: int  # prefix partial slots per row: the splits, or grouped: levels x splits

    @property
    def fuse(self) -> bool:
        """The suffix launch merges the prefix slots and writes the output (no merge launch)."""
        return self.fuse_slots > 0

    @property
    def p_units(self) -> int:
        """Prefix programs per KV head."""
        return self.p_blocks * self.p_splits

    @property
    def s_units(self) -> int:
        """Suffix programs per KV head (a pair of batch rows each when ``pair``)."""
        return (cdiv(self.rows, 2) if self.pair else self.rows) * self.s_blocks * self.s_splits

    @property
    def slots(self) -> int:
        """Partial slots per row in scratch: the prefix's, plus the suffix splits' unless the suffix launch merges."""
        return self.p_slots + (0 if self.fuse else self.s_splits)


@functools.lru_cache(maxsize=1024)
def launch_layout(B: int, N: int, G: int, L_q: int, P: int, L_s: int, H_kv: int, D: int, num_sms: int, hopper: bool,
                config: KernelConfig = DEFAULT_CONFIG, groups: tuple[int, int] | None = None) -> LaunchLayout:
    """The launch layout for these sizes on ``num_sms`` SMs (``hopper``: a CUDA device that can PDL); ``groups``:
    ``(levels, segments per level)`` of a grouped prefix (``P`` its packed positions), ``None`` for one prefix."""
    bd = block_d(D)
    block_n, warps, stages = tile_row(config.tiles, bd)
    sep = config.separate_rows[0] <= N <= config.separate_rows[1]  # layout rule: see KernelConfig.separate_rows
    if sep:
        bm, bn, w, st = tile_row(config.prefix_tiles, bd)
        prefix = (block_m(N, bm), bn, w, st)
        suffix = (block_m(G * L_q, config.max_block_m), *tile_row(config.suffix_tiles, bd))
    else:
        prefix = (block_m(N, config.max_block_m), block_n, warps, stages)
        suffix = (block_m(G * L_q, config.max_block_m), block_n, warps, stages)
    s_blocks = cdiv(G * L_q, suffix[0])
    whole = config.separate_split if sep else ()
    if groups is None:
        p_blocks = cdiv(N, prefix[0])
        # the separate layout's prefix launch holds prefix programs only: whole waves of them (separate_split)
        p_splits, p_per = prefix_split_count(P, N, H_kv, prefix[0], prefix[1], num_sms, *whole, whole_waves=sep,
                                      config=config)
        p_slots = p_splits
    else:
        depth, segments = groups
        prefix = (group_block_m(N, D, segments, config), *prefix[1:])
        p_blocks = group_items(N, prefix[0], depth, segments)
        p_splits = group_split_count(P, N, segments, p_blocks, H_kv, prefix[1], num_sms, *whole, whole_waves=sep,
                                     config=config)
        p_per, p_slots = 0, depth * p_splits
    s_splits, s_per = suffix_split_count(L_s, B * s_blocks, H_kv, suffix[1], num_sms, config)
    slot_tile = next_power_of_2(max(p_slots, 1))
    fuse = (sep and s_splits == 1 and p_slots <= config.fused_merge_slots
            and suffix[0] * slot_tile <= config.fused_merge_tile)
    pdl = config.pdl and fuse and P > 0 and hopper
    layout = LaunchLayout(sep, prefix, suffix, p_blocks, p_splits, p_per, s_blocks, s_splits, s_per,
                          slot_tile if fuse else 0, pdl, False, B, p_slots)
    pair = (config.suffix_pair_above is not None and fuse and s_blocks == 1 and layout.p_units * H_kv <= num_sms
            and P >= config.suffix_pair_min_prefix and layout.s_units * H_kv > config.suffix_pair_above * num_sms)
    return layout._replace(pair=pair)


__all__ = ["LaunchLayout", "block_d", "block_m", "cdiv", "group_block_m", "group_items", "group_shape",
           "grouped_launch_shape", "next_power_of_2", "group_split_count", "launch_layout", "prefix_split_count",
           "suffix_split_count"]
