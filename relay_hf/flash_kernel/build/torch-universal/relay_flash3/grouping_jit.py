"""``grouping.share_groups`` as one Triton program: a step's first layer derives its groups in one launch.

The PyTorch formulation (``grouping.share_groups_torch``) is some 40 small tensor operations, two sorts among them:
inside a CUDA graph each is a launch, about 0.3 ms a step at 128 requests on an H200 (``python -m benchmarks.paged``,
``paged_first`` against ``paged``). This kernel computes the same tables in one program (grid ``(1,)``): every stage
is a loop over chunks of rows (``CHUNK`` at a time) that compares them with every row or table column, and the
stages hand on their results through a scratch buffer ``WORK [10, B]`` int32, with a barrier between stages (one
program: its threads see each other's stores after ``tl.debug_barrier``). ``[B, B]`` comparisons and ``[B, M]``
reads, as the PyTorch formulation; no sort (a member's place is a count of the rows before it).

Outputs as ``grouping.Groups`` documents them; tiles past the live ones are zero rows (``count = 0``). One program
does ``[B, B]`` work, so past ``MAX_ROWS`` rows the PyTorch formulation (whose ``[B, B]`` operations spread over the
GPU) takes over.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - without Triton, grouping.py runs its PyTorch formulation
    from types import SimpleNamespace

    triton, tl = SimpleNamespace(jit=lambda fn: fn), SimpleNamespace(constexpr=lambda value: value)
    HAS_TRITON = False

MAX_ROWS = 256  # the most rows one program groups (module docstring)
CHUNK, COLUMNS = 64, 16  # rows compared at a time; block-table columns read at a time
ROWS = 10  # of WORK, one per quantity below
_COMPLETE, _KEY1, _LEAD1, _PAGES, _SHARED1, _SIZE1, _KEY2, _LEAD2, _SHARED2, _SIZE2 = (tl.constexpr(i)
                                                                                      for i in range(ROWS))


@triton.jit
def _leaders(WORK, B, KEY: tl.constexpr, SAME: tl.constexpr, OUT: tl.constexpr, LEVEL2: tl.constexpr,
             CHUNK: tl.constexpr):
    """``WORK[OUT, b]``: the first row ``a`` with ``WORK[KEY, a] == WORK[KEY, b]`` (and, for ``LEVEL2``, the same
    ``WORK[SAME, .]``: a level-2 group lies inside a level-1 group). Row ``b`` itself matches, so one always exists."""
    r = tl.arange(0, CHUNK)
    for b0 in range(0, B, CHUNK):
        b = b0 + r
        b_ok = b < B
        key_b = tl.load(WORK + KEY * B + b, mask=b_ok, other=0)
        same_b = tl.load(WORK + SAME * B + b, mask=b_ok, other=0)
        best = b
        for a0 in range(0, B, CHUNK):
            a = a0 + r
            a_ok = a < B
            match = (tl.load(WORK + KEY * B + a, mask=a_ok, other=0)[None, :] == key_b[:, None]) & a_ok[None, :]
            if LEVEL2:
                match = match & (tl.load(WORK + SAME * B + a, mask=a_ok, other=0)[None, :] == same_b[:, None])
            best = tl.minimum(best, tl.min(tl.where(match, a[None, :], B), 1))
        tl.store(WORK + OUT * B + b, best, mask=b_ok)


@triton.jit
def _pages_shared(WORK, BT, bt_b, B, M, LEAD: tl.constexpr, CHUNK: tl.constexpr, COLUMNS: tl.constexpr):
    """``WORK[_PAGES, b]``: leading pages row ``b`` shares with its leader ``WORK[LEAD, b]`` (identical ids, complete
    in both)."""
    r = tl.arange(0, CHUNK)
    c = tl.arange(0, COLUMNS)
    for b0 in range(0, B, CHUNK):
        b = b0 + r
        b_ok = b < B
        lead = tl.load(WORK + LEAD * B + b, mask=b_ok, other=0)
        limit = tl.minimum(tl.load(WORK + _COMPLETE * B + b, mask=b_ok, other=0),
                           tl.load(WORK + _COMPLETE * B + lead, mask=b_ok, other=0))
        first = tl.minimum(limit, M)
        for j0 in range(0, M, COLUMNS):
            j = j0 + c
            ok = b_ok[:, None] & (j < M)[None, :]
            mine = tl.load(BT + b.to(tl.int64)[:, None] * bt_b + j[None, :], mask=ok, other=0)
            theirs = tl.load(BT + lead.to(tl.int64)[:, None] * bt_b + j[None, :], mask=ok, other=0)
            differs = ok & (mine != theirs)
            first = tl.minimum(first, tl.min(tl.where(differs, j[None, :], M), 1))
        tl.store(WORK + _PAGES * B + b, first, mask=b_ok)


@triton.jit
def _group_min(WORK, B, LEAD: tl.constexpr, OUT_MIN: tl.constexpr, OUT_SIZE: tl.constexpr, CHUNK: tl.constexpr):
    """Per row: the least ``WORK[_PAGES, .]`` over the rows with its leader (``WORK[OUT_MIN]``), and how many rows
    that is (``WORK[OUT_SIZE]``)."""
    r = tl.arange(0, CHUNK)
    for b0 in range(0, B, CHUNK):
        b = b0 + r
        b_ok = b < B
        lead_b = tl.load(WORK + LEAD * B + b, mask=b_ok, other=-1)
        least = tl.full([CHUNK], 2147483647, tl.int32)
        size = tl.zeros([CHUNK], tl.int32)
        for a0 in range(0, B, CHUNK):
            a = a0 + r
            a_ok = a < B
            same = (tl.load(WORK + LEAD * B + a, mask=a_ok, other=-2)[None, :] == lead_b[:, None]) & a_ok[None, :]
            pages = tl.load(WORK + _PAGES * B + a, mask=a_ok, other=0)
            least = tl.minimum(least, tl.min(tl.where(same, pages[None, :], 2147483647), 1))
            size += tl.sum(same.to(tl.int32), 1)
        tl.store(WORK + OUT_MIN * B + b, least, mask=b_ok)
        tl.store(WORK + OUT_SIZE * B + b, size, mask=b_ok)


@triton.jit
def _level(WORK, BT, bt_b, B, M, KEY: tl.constexpr, SAME: tl.constexpr, LEAD: tl.constexpr, SHARED: tl.constexpr,
           SIZE: tl.constexpr, LEVEL2: tl.constexpr, CHUNK: tl.constexpr, COLUMNS: tl.constexpr):
    """One level's groups from its keys ``WORK[KEY]``: leaders, then pages shared with them, then each group's least
    shared run (``WORK[SHARED]``) and size (``WORK[SIZE]``); a barrier before and after each stage."""
    tl.debug_barrier()
    _leaders(WORK, B, KEY, SAME, LEAD, LEVEL2=LEVEL2, CHUNK=CHUNK)
    tl.debug_barrier()
    _pages_shared(WORK, BT, bt_b, B, M, LEAD, CHUNK=CHUNK, COLUMNS=COLUMNS)
    tl.debug_barrier()
    _group_min(WORK, B, LEAD, SHARED, SIZE, CHUNK=CHUNK)
    tl.debug_barrier()


@triton.jit
def _group_tiles(WORK, B, rows, ok, rows_per_tile, LEVEL: tl.constexpr, LEAD: tl.constexpr, SIZE: tl.constexpr):
    """``(leader, group size, tiles)`` of ``rows`` (``ok``: the real ones) at ``LEVEL``: a group's tiles are counted
    at its leader (0 elsewhere, and for a group of one or without pages of its level)."""
    lead = tl.load(WORK + LEAD * B + rows, mask=ok, other=0)
    size = tl.load(WORK + SIZE * B + rows, mask=ok, other=0)
    pages = tl.load(WORK + _SHARED1 * B + rows, mask=ok, other=0)
    if LEVEL == 2:  # a level-2 group's pages are those past the level-1 prefix
        pages = tl.load(WORK + _SHARED2 * B + rows, mask=ok, other=0) - pages
    count = tl.where(ok & (lead == rows) & (size >= 2) & (pages > 0), (size + rows_per_tile - 1) // rows_per_tile, 0)
    return lead, size, count


@triton.jit
def _tiles(WORK, TILES, COUNTS, MEMBERS, B, rows_per_tile, LEVEL: tl.constexpr, LEAD: tl.constexpr,
           SIZE: tl.constexpr, CHUNK: tl.constexpr):
    """One level's tiles (rows ``(LEVEL - 1) * B ..`` of ``TILES``), its members in leader order and its count of live
    tiles, from its leaders ``WORK[LEAD]`` and group sizes ``WORK[SIZE]`` (0 for a row in no group of that level); a
    level-2 group's pages are those past the level-1 prefix."""
    r = tl.arange(0, CHUNK)
    live = tl.zeros([CHUNK], tl.int32)
    for b0 in range(0, B, CHUNK):
        b = b0 + r
        b_ok = b < B
        lead_b, size_b, count_b = _group_tiles(WORK, B, b, b_ok, rows_per_tile, LEVEL, LEAD, SIZE)
        before = tl.zeros([CHUNK], tl.int32)  # rows whose leader comes before b's: where b's group starts
        earlier = tl.zeros([CHUNK], tl.int32)  # b's fellow members before it
        tiles_before = tl.zeros([CHUNK], tl.int32)  # tiles of the groups whose leader comes before b
        for a0 in range(0, B, CHUNK):
            a = a0 + r
            a_ok = a < B
            lead_a, _, count_a = _group_tiles(WORK, B, a, a_ok, rows_per_tile, LEVEL, LEAD, SIZE)
            ahead = a_ok[None, :] & (lead_a[None, :] < lead_b[:, None])
            before += tl.sum(ahead.to(tl.int32), 1)
            earlier += tl.sum((a_ok[None, :] & (lead_a[None, :] == lead_b[:, None]) & (a[None, :] < b[:, None])
                               ).to(tl.int32), 1)
            tiles_before += tl.sum(tl.where(a_ok[None, :] & (a[None, :] < b[:, None]), count_a[None, :], 0), 1)
        tl.store(MEMBERS + (LEVEL - 1) * B + before + earlier, b, mask=b_ok)
        live += count_b
        for t in range(0, tl.max(count_b, 0)):  # a leader's tiles: chunks of rows_per_tile of its members
            at = ((LEVEL - 1) * B + tiles_before + t) * 4
            on = b_ok & (t < count_b)
            tl.store(TILES + at, tl.zeros([CHUNK], tl.int32) + LEVEL, mask=on)
            tl.store(TILES + at + 1, b, mask=on)
            tl.store(TILES + at + 2, before + t * rows_per_tile, mask=on)
            tl.store(TILES + at + 3, tl.minimum(size_b - t * rows_per_tile, rows_per_tile), mask=on)
    tl.store(COUNTS + LEVEL - 1, tl.sum(live, 0))


@triton.jit
def _groups_kernel(BT, PAST, WORK, TILES, COUNTS, MEMBERS, BOUNDS, bt_b, B, M, page_size, rows_per_tile,
                   CHUNK: tl.constexpr, COLUMNS: tl.constexpr):
    """``grouping.share_groups`` in one program (module docstring)."""
    r = tl.arange(0, CHUNK)
    for b0 in range(0, B, CHUNK):  # pages complete before the step; level 1's key: the first page, if complete
        b = b0 + r
        b_ok = b < B
        for j in tl.static_range(4):  # no stale tile rows: the live ones are written below
            tl.store(TILES + b * 4 + j, tl.zeros([CHUNK], tl.int32), mask=b_ok)
            tl.store(TILES + (B + b) * 4 + j, tl.zeros([CHUNK], tl.int32), mask=b_ok)
        past = tl.load(PAST + b, mask=b_ok, other=-1)
        complete = tl.where(past >= 0, past // page_size, 0)
        tl.store(WORK + _COMPLETE * B + b, complete, mask=b_ok)
        first = tl.load(BT + b.to(tl.int64) * bt_b, mask=b_ok, other=0)
        tl.store(WORK + _KEY1 * B + b, tl.where(complete >= 1, first, -1 - b), mask=b_ok)
    _level(WORK, BT, bt_b, B, M, _KEY1, _KEY1, _LEAD1, _SHARED1, _SIZE1, LEVEL2=False, CHUNK=CHUNK, COLUMNS=COLUMNS)
    # the two stages below rewrite rows of WORK they read: each warp loads its own copy of a chunk, so a warp may
    # read a value another already rewrote; both rewrites are idempotent (keep them so)
    for b0 in range(0, B, CHUNK):  # a group of one shares nothing; level 2's key: the page after the prefix
        b = b0 + r
        b_ok = b < B
        shared = tl.load(WORK + _SHARED1 * B + b, mask=b_ok, other=0)
        shared = tl.where(tl.load(WORK + _SIZE1 * B + b, mask=b_ok, other=0) >= 2, shared, 0)
        tl.store(WORK + _SHARED1 * B + b, shared, mask=b_ok)
        at = tl.load(BT + b.to(tl.int64) * bt_b + tl.minimum(shared, M - 1), mask=b_ok, other=0)
        complete = tl.load(WORK + _COMPLETE * B + b, mask=b_ok, other=0)
        tl.store(WORK + _KEY2 * B + b, tl.where(complete > shared, at, -1 - b), mask=b_ok)
    _level(WORK, BT, bt_b, B, M, _KEY2, _LEAD1, _LEAD2, _SHARED2, _SIZE2, LEVEL2=True, CHUNK=CHUNK, COLUMNS=COLUMNS)
    for b0 in range(0, B, CHUNK):  # rows in no level-2 group keep the level-1 prefix
        b = b0 + r
        b_ok = b < B
        size = tl.load(WORK + _SIZE2 * B + b, mask=b_ok, other=0)
        shared1 = tl.load(WORK + _SHARED1 * B + b, mask=b_ok, other=0)
        shared2 = tl.where(size >= 2, tl.load(WORK + _SHARED2 * B + b, mask=b_ok, other=0), shared1)
        tl.store(WORK + _SHARED2 * B + b, shared2, mask=b_ok)
        tl.store(WORK + _SIZE2 * B + b, tl.where(size >= 2, size, 0), mask=b_ok)
        tl.store(BOUNDS + b * 3, shared1, mask=b_ok)
        tl.store(BOUNDS + b * 3 + 1, shared2, mask=b_ok)
        tl.store(BOUNDS + b * 3 + 2, shared2, mask=b_ok)
    tl.debug_barrier()
    _tiles(WORK, TILES, COUNTS, MEMBERS, B, rows_per_tile, LEVEL=1, LEAD=_LEAD1, SIZE=_SIZE1, CHUNK=CHUNK)
    _tiles(WORK, TILES, COUNTS, MEMBERS, B, rows_per_tile, LEVEL=2, LEAD=_LEAD2, SIZE=_SIZE2, CHUNK=CHUNK)
