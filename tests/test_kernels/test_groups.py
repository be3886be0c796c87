"""Several shared prefixes in one batch (``PrefixGroups``): the description's checks, and relay attention over grouped
prefixes (PyTorch reference; Triton kernels on the CPU interpreter and on CUDA) against a float64 oracle that gives
each row the segments of its path, concatenated, then its own suffix."""

import dataclasses

import pytest
import torch

from relay_hf.kernels import PrefixGroups, relay_attention, relay_attention_torch, triton_relay
from tests.helpers import oracle_attention, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-6, torch.float16: 1e-2, torch.bfloat16: 1e-2}
KERNEL_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}

# name -> (segment lengths, per-row paths): unequal groups, a group read by no row (segment 2 below), one-row
# groups, empty segments, rows with no prefix, two levels
LAYOUTS = {
    "three_unequal": ([11, 5, 8], [(0,), (0,), (1,), (2,), (2,), (2,), (0,)]),
    "unread_and_one_row": ([6, 9, 4], [(0,), (1,), (0,), (0,)]),
    "empty_segment": ([0, 7], [(0,), (1,), (0,), (1,)]),
    "rows_with_none": ([10, 3], [(), (0,), (1,), (), (0,)]),
    "two_levels": ([9, 4, 6, 12, 0], [(0, 1), (0, 2), (0,), (3,), (3, 4), (0, 1), ()]),
}


def _inputs(paths, lengths, L_q=1, L_s=6, H_kv=2, G=3, D=16, dtype=torch.float32, spare=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, P = len(paths), sum(lengths) + spare  # the packed prefix may hold more than its segments
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    lens = torch.randint(0, L_s + 1, (B,), generator=g).clamp(min=min(L_q, L_s))
    lens[0] = L_s
    return (rnd(B, H_kv * G, L_q, D), rnd(1, H_kv, P, D), rnd(1, H_kv, P, D), rnd(B, H_kv, L_s, D),
            rnd(B, H_kv, L_s, D), lens.to(DEVICE))


# -- the description ---------------------------------------------------------------------------------------------
def test_derived_positions_follow_the_tree():
    groups = PrefixGroups([9, 4, 6, 12, 0], LAYOUTS["two_levels"][1])
    assert groups.depth == 2 and groups.rows == 7 and groups.packed_length == 31
    assert groups.offsets == (0, 9, 13, 19, 31)
    assert groups.bases == (0, 9, 9, 0, 12)  # a child starts where its parent ends
    assert groups.prefix_lengths == (13, 15, 9, 12, 12, 13, 0)
    assert groups.levels == (0, 1, 1, 0, 1) and groups.parents == (-1, 0, 0, -1, 3)
    assert groups.segment_rows == ((0, 1, 2, 5), (0, 5), (1,), (3, 4), (4,))
    # level 1: three segments and the rows that read none there
    assert groups.segments_per_level == 4
    assert groups.summary() == ((0, 4, 9), (1, 2, 4), (1, 1, 6), (0, 2, 12), (1, 1, 0))


def test_from_groups_reads_per_row_indices():
    one = PrefixGroups.from_groups([5, 7], torch.tensor([1, 0, -1, 1]))
    assert one.paths == ((1,), (0,), (), (1,))
    two = PrefixGroups.from_groups([5, 7, 3], [[0, 2], [0, -1], [1, -1]])
    assert two.paths == ((0, 2), (0,), (1,)) and two.bases[2] == 5


@pytest.mark.parametrize("kwargs, match", [
    (dict(lengths=[3, -1], paths=[(0,)]), "non-negative"),
    (dict(lengths=[3], paths=[(1,)]), "outside"),
    (dict(lengths=[3, 4], paths=[(0, 0)]), "twice"),
    (dict(lengths=[3, 4, 5], paths=[(0, 1), (2, 1)]), "tree"),
    (dict(lengths=[3, 4], paths=[(0,), (1, 0)]), "tree"),
    (dict(lengths=[3, 4], paths=[(0,), (1,)], segments_per_level=1), "segments_per_level"),
])
def test_a_layout_that_is_no_tree_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefixGroups(**kwargs)


def test_bad_per_row_groups_and_bad_fits_are_refused():
    with pytest.raises(ValueError, match="after a -1"):
        PrefixGroups.from_groups([5, 7], [[-1, 1], [0, 1]])
    with pytest.raises(ValueError, match="integer"):
        PrefixGroups.from_groups([5], torch.zeros(3))
    groups = PrefixGroups([5, 7], [(0,), (1,)])
    q, pk, pv, sk, sv, lens = _inputs(groups.paths, groups.lengths)
    with pytest.raises(ValueError, match="rows"):
        relay_attention(q[:1], pk, pv, sk[:1], sv[:1], prefix_groups=groups)
    with pytest.raises(ValueError, match="holds only"):
        relay_attention(q, pk[:, :, :10], pv[:, :, :10], sk, sv, prefix_groups=groups)
    with pytest.raises(ValueError, match="PrefixGroups"):
        relay_attention(q, pk, pv, sk, sv, prefix_groups=[(0,), (1,)])


def test_work_items_cover_every_row_once_per_level_and_pad_to_capacity():
    groups = PrefixGroups([9, 4, 6, 12, 0], LAYOUTS["two_levels"][1])
    items, rows = groups.items(block_m=4, folded=3, capacity=16)
    assert len(items) == 16 and sorted(rows[:7]) == list(range(7)) and sorted(rows[7:]) == list(range(7))
    real = [it for it in items if it[4]]
    for level in (0, 1):  # every folded row of every row, once per level
        covered = sum(min(4, it[4] - it[5]) for it in real if it[6] == level)
        assert covered == 7 * 3
    assert all(it == [0] * 7 for it in items[len(real):])
    with pytest.raises(ValueError, match="exceed"):
        groups.items(block_m=4, folded=3, capacity=len(real) - 1)


# -- the reference -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L_q", [1, 3])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reference_matches_the_float64_oracle(layout, L_q, dtype):
    lengths, paths = LAYOUTS[layout]
    groups = PrefixGroups(lengths, paths)
    q, pk, pv, sk, sv, lens = _inputs(paths, lengths, L_q=L_q, dtype=dtype, seed=L_q)
    q, pk, pv, sk, sv, lens = (t.cpu() for t in (q, pk, pv, sk, sv, lens))
    out = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lens, prefix_groups=groups)
    ref = oracle_attention(q, pk, pv, sk, sv, lens, groups=groups)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


def test_one_group_of_every_row_is_the_ungrouped_call():
    q, pk, pv, sk, sv, lens = (t.cpu() for t in _inputs([(0,)] * 4, [20], spare=0, seed=3))
    grouped = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lens,
                                    prefix_groups=PrefixGroups([20], [(0,)] * 4))
    torch.testing.assert_close(grouped, relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lens))


# -- the Triton kernels ------------------------------------------------------------------------------------------
needs_triton = pytest.mark.skipif(not triton_relay.triton_available(), reason="triton cannot run here")
KERNEL_LAYOUTS = {"one_launch": dict(separate_rows=(0, -1)),
                  "separate_fused_merge": dict(separate_rows=(1, 1 << 30), fused_merge_slots=32,
                                               fused_merge_tile=1 << 30),
                  "separate_merge_launch": dict(separate_rows=(1, 1 << 30), fused_merge_slots=0)}


def _kernel(q, pk, pv, sk, sv, lens, groups, config=None, end=None):
    B, H_q, L_q, D = q.shape
    out = torch.full((B, L_q, H_q, D), float("nan"), dtype=q.dtype, device=q.device).transpose(1, 2)
    return triton_relay.relay_attention_triton(q, pk, pv, sk, sv, suffix_lengths=lens, suffix_end=end,
                                               prefix_groups=groups, out=out, config=config)


@needs_triton
@pytest.mark.parametrize("launch", sorted(KERNEL_LAYOUTS))
@pytest.mark.parametrize("layout,dtype,L_q", [("two_levels", torch.float32, 1), ("three_unequal", torch.bfloat16, 2),
                                              ("rows_with_none", torch.float16, 1),
                                              ("unread_and_one_row", torch.float32, 1),
                                              ("empty_segment", torch.bfloat16, 1)])
def test_kernel_matches_the_float64_oracle(layout, dtype, L_q, launch):
    lengths, paths = LAYOUTS[layout]
    groups = PrefixGroups(lengths, paths)
    q, pk, pv, sk, sv, lens = _inputs(paths, lengths, L_q=L_q, dtype=dtype, D=64, seed=len(layout))
    config = dataclasses.replace(triton_relay.DEFAULT_CONFIG, **KERNEL_LAYOUTS[launch])
    out = _kernel(q, pk, pv, sk, sv, lens, groups, config)
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite output"
    assert rel_err(out, oracle_attention(q, pk, pv, sk, sv, lens, groups=groups)) < KERNEL_TOL[dtype]


@needs_triton
def test_tables_pinned_in_place_serve_any_layout_of_the_planned_capacity():
    """A static cache plans for a capacity and writes each call's layout into the same buffers (a CUDA graph replays
    them): the kernels follow whatever layout the buffers hold."""
    lengths = [12, 7, 9]
    first = PrefixGroups(lengths, [(0,), (1,), (2,), (0,), (1,)], segments_per_level=4)
    second = PrefixGroups(lengths, [(2,), (2,), (0,), (), (2,)], segments_per_level=4)
    q, pk, pv, sk, sv, lens = _inputs(first.paths, lengths, D=64, seed=9)
    N, folded = q.shape[0] * 3, 3
    block_m, capacity = triton_relay.grouped_launch_shape(N, 64, first)
    assert triton_relay.grouped_launch_shape(N, 64, second) == (block_m, capacity)  # one plan for both
    buffers = (torch.zeros(capacity, 7, dtype=torch.int32, device=DEVICE),
               torch.zeros(first.depth * 5, dtype=torch.int32, device=DEVICE),
               torch.zeros(5, dtype=torch.int32, device=DEVICE))
    for groups in (first, second):
        groups.pin(torch.device(DEVICE), block_m, folded, capacity, buffers)
        out = _kernel(q, pk, pv, sk, sv, lens, groups)
        assert groups.tables(torch.device(DEVICE), block_m, folded, capacity)[0].data_ptr() == buffers[0].data_ptr()
        assert rel_err(out, oracle_attention(q, pk, pv, sk, sv, lens, groups=groups)) < KERNEL_TOL[torch.float32]


@needs_triton
def test_static_suffix_with_groups_reads_only_up_to_its_end():
    lengths, paths = LAYOUTS["two_levels"]
    groups = PrefixGroups(lengths, paths)
    q, pk, pv, sk, sv, _ = _inputs(paths, lengths, L_s=12, D=64, seed=4)
    end = torch.tensor([7], device=DEVICE)
    lens = torch.tensor([7, 3, 1, 7, 5, 2, 7], device=DEVICE)
    sk[:, :, 7:], sv[:, :, 7:] = float("nan"), float("nan")
    out = _kernel(q, pk, pv, sk, sv, lens, groups, end=end)
    assert rel_err(out, oracle_attention(q, pk, pv, sk, sv, lens, end=end, groups=groups)) < 1e-4
