"""What rows share (``find_groups``, ``PrefixTree``) and the stock <-> relay row layouts."""

import pytest
import torch

from relay_hf.prefix import (
    PrefixTree,
    common_prefix_length,
    find_groups,
    first_mismatch,
    left_padding,
    relay_layout,
    token_order,
)
from tests.helpers import left_pad

G = torch.Generator().manual_seed(0)


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(10, 99, (n,), generator=G)


def test_left_padding_detects_layouts():
    assert left_padding(torch.tensor([[0, 1, 1], [1, 1, 1]])).tolist() == [1, 0]
    assert left_padding(torch.tensor([[1, 1, 0], [1, 1, 1]])) is None  # right padding
    assert left_padding(torch.tensor([[0, 0, 0], [1, 1, 1]])) is None  # empty row
    assert left_padding(torch.tensor([[1, 0, 1]])) is None


def test_common_prefix_leaves_a_token_per_row():
    ids, mask = left_pad([torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7, 9, 4])])
    n_pad = left_padding(mask)
    assert common_prefix_length(ids, n_pad) == 2  # row 1 needs one token after the prefix
    ids, mask = left_pad([torch.tensor([5, 6, 1, 8]), torch.tensor([5, 6, 2, 8])])
    assert common_prefix_length(ids, left_padding(mask)) == 2
    ids, mask = left_pad([torch.tensor([5]), torch.tensor([5, 6])])
    assert common_prefix_length(ids, left_padding(mask)) == 0


def test_first_mismatch_names_row_and_position():
    ids, mask = left_pad([torch.tensor([5, 6, 7, 8]), torch.tensor([5, 9, 7, 1, 2])])
    n_pad = left_padding(mask)
    assert first_mismatch(ids, n_pad, torch.tensor([5, 6])) == (1, 1)
    assert first_mismatch(ids, n_pad, torch.tensor([5])) is None
    assert first_mismatch(ids, n_pad, torch.tensor([5, 6, 7, 8])) == (0, 4)  # nothing after the prefix


# -- find_groups -------------------------------------------------------------------------------------------------
SYS_A, SYS_B, SYS_C, DOC_1, DOC_2 = _tokens(40), _tokens(50), _tokens(35), _tokens(33), _tokens(36)
MIXED = [torch.cat([SYS_A, _tokens(5)]), torch.cat([SYS_B, _tokens(3)]), torch.cat([SYS_A, _tokens(7)]),
         torch.cat([SYS_B, DOC_1, _tokens(4)]), torch.cat([SYS_B, DOC_1, _tokens(2)]), _tokens(20),
         torch.cat([SYS_C, _tokens(1)]), torch.cat([SYS_C, _tokens(6)]), torch.cat([SYS_B, DOC_2, _tokens(3)]),
         torch.cat([SYS_B, DOC_2, _tokens(3)])]


def _check_grouping(rows, grouping, min_length):
    """Every row reads exactly its own first tokens, keeps one token after them, every segment is long enough
    and read by two rows."""
    tree = grouping.tree
    for b, path in enumerate(grouping.paths):
        prefix = torch.cat([tree.ids[j] for j in path]) if path else torch.zeros(0, dtype=torch.long)
        assert torch.equal(rows[b][:prefix.numel()], prefix) and prefix.numel() < len(rows[b])
        assert [tree.parents[j] for j in path] == [-1, *path[:-1]][:len(path)]
    for j, seg in enumerate(tree.ids):
        assert seg.numel() >= min_length and sum(j in p for p in grouping.paths) >= 2


def test_three_system_prompts_two_documents_and_a_row_with_none():
    ids, mask = left_pad(MIXED)
    grouping = find_groups(ids, left_padding(mask), min_length=32)
    _check_grouping(MIXED, grouping, 32)
    lengths = grouping.prefix_lengths()
    assert lengths == [40, 50, 40, 83, 83, 0, 35, 35, 86, 86]  # the documents are a second level under SYS_B
    assert grouping.paths[5] == () and not grouping.single
    assert sorted(grouping.tree.lengths) == sorted([40, 50, 35, 33, 36])
    one_level = find_groups(ids, left_padding(mask), min_length=32, levels=1)
    assert one_level.prefix_lengths() == [40, 50, 40, 50, 50, 0, 35, 35, 50, 50]


def test_a_block_shorter_than_min_length_is_not_a_level():
    ids, mask = left_pad(MIXED)
    grouping = find_groups(ids, left_padding(mask), min_length=34)  # DOC_1 (33 tokens) no longer pays
    assert grouping.prefix_lengths()[3:5] == [50, 50] and grouping.prefix_lengths()[8:] == [86, 86]
    _check_grouping(MIXED, grouping, 34)


def test_one_common_prefix_is_the_single_ungrouped_call_and_nothing_shared_is_none():
    rows = [torch.cat([SYS_A, _tokens(n)]) for n in (3, 5, 1)]
    ids, mask = left_pad(rows)
    grouping = find_groups(ids, left_padding(mask), 32)
    assert grouping.single and grouping.tree.lengths == (40,)
    ids, mask = left_pad([_tokens(40), _tokens(45)])
    assert find_groups(ids, left_padding(mask), 32) is None
    assert find_groups(ids[:1], left_padding(mask[:1]), 32) is None  # one row shares nothing


def test_common_prefix_and_pairs_below_it_pick_the_larger_saving():
    """All rows share 40 tokens and pairs share 40 more: both levels save reads (39x40 + 20x40 > 20x80)."""
    rows = []
    for _ in range(20):
        pair = _tokens(40)
        rows += [torch.cat([SYS_A, pair, _tokens(2)]), torch.cat([SYS_A, pair, _tokens(3)])]
    ids, mask = left_pad(rows)
    grouping = find_groups(ids, left_padding(mask), 32)
    _check_grouping(rows, grouping, 32)
    assert grouping.tree.lengths[0] == 40 and len(grouping.tree.ids) == 21
    capped = find_groups(ids, left_padding(mask), 32, max_segments=5)
    assert len(capped.tree.ids) == 5 and capped.tree.lengths[0] == 40  # inner segments dropped first
    _check_grouping(rows, capped, 32)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_give_valid_groupings_at_least_as_good_as_the_common_prefix(seed):
    g = torch.Generator().manual_seed(seed)
    stems = [torch.randint(10, 99, (int(n),), generator=g) for n in torch.randint(0, 60, (4,), generator=g)]
    rows = []
    for _ in range(int(torch.randint(2, 12, (1,), generator=g))):
        stem = stems[int(torch.randint(0, 4, (1,), generator=g))]
        rows.append(torch.cat([stem, torch.randint(10, 99, (int(torch.randint(1, 20, (1,), generator=g)),),
                                                   generator=g)]))
    ids, mask = left_pad(rows)
    n_pad = left_padding(mask)
    grouping = find_groups(ids, n_pad, 8)
    P = common_prefix_length(ids, n_pad)
    if grouping is None:
        assert P < 8
        return
    _check_grouping(rows, grouping, 8)
    saved = sum((sum(j in p for p in grouping.paths) - 1) * n
                for j, n in enumerate(grouping.tree.lengths))
    assert saved >= (len(rows) - 1) * P


@pytest.mark.parametrize("seed", range(4))
def test_rows_are_ordered_as_their_token_lists_are(seed):
    """``token_order`` (``find_groups``' row order) is ``sorted`` over the rows' token lists: ids across byte
    boundaries, negative and past 2**31 included, a row before the rows it is a prefix of, equal rows as given."""
    g = torch.Generator().manual_seed(seed)
    alphabet = torch.tensor([-2**40, -256, -1, 0, 1, 255, 256, 511, 65535, 65536, 2**31 - 1, 2**40])
    stems = [alphabet[torch.randint(0, 12, (int(n),), generator=g)] for n in torch.randint(0, 6, (5,), generator=g)]
    rows = []
    for _ in range(200):
        stem = stems[int(torch.randint(0, 5, (1,), generator=g))]
        rows.append(torch.cat([stem, alphabet[torch.randint(0, 12, (int(torch.randint(0, 4, (1,), generator=g)),),
                                                            generator=g)]]))
    expected = sorted(range(len(rows)), key=lambda b: rows[b].tolist())
    assert token_order([r.numpy() for r in rows]) == expected
    narrow = [r.clamp(-2**31, 2**31 - 1).int() for r in rows]  # int32 ids order as their int64 values
    assert token_order([r.numpy() for r in narrow]) == sorted(range(len(rows)), key=lambda b: narrow[b].tolist())


def test_int32_ids_group_as_int64_ids_into_int64_segments():
    rows = [torch.cat([SYS_A, _tokens(3)]), torch.cat([SYS_A, _tokens(2)]), torch.cat([SYS_B, _tokens(4)]),
            torch.cat([SYS_B, _tokens(1)])]
    ids, mask = left_pad(rows)
    wide, narrow = find_groups(ids, left_padding(mask), 32), find_groups(ids.int(), left_padding(mask), 32)
    _check_grouping(rows, narrow, 32)
    assert narrow.paths == wide.paths and all(torch.equal(a, b) for a, b in zip(narrow.tree.ids, wide.tree.ids))
    assert all(s.dtype == torch.int64 for s in narrow.tree.ids)


# -- PrefixTree --------------------------------------------------------------------------------------------------
def test_a_tree_from_prefixes_stores_shared_parts_once_and_rows_read_the_deepest_match():
    tree = PrefixTree.from_prefixes([torch.cat([SYS_B, DOC_1]), SYS_B, SYS_A, torch.cat([SYS_B, DOC_2])])
    assert tree.parents == (1, -1, -1, 1) and tree.lengths == (33, 50, 40, 36)
    assert torch.equal(tree.full_ids(0), torch.cat([SYS_B, DOC_1])) and tree.starts() == (50, 0, 0, 50)
    ids, mask = left_pad([MIXED[1], MIXED[3], MIXED[0], MIXED[8]])
    assert tree.match(ids, left_padding(mask)) == [(1,), (1, 0), (2,), (1, 3)]
    ids, mask = left_pad([MIXED[1], MIXED[5]])
    with pytest.raises(ValueError, match="row 1 starts with none"):
        tree.match(ids, left_padding(mask))
    with pytest.raises(ValueError, match="twice"):
        PrefixTree.from_prefixes([SYS_A, SYS_A])
    single = PrefixTree.from_prefixes([SYS_A])
    with pytest.raises(ValueError, match="row 0 differs at prefix position 0"):
        single.match(ids, left_padding(mask))


# -- the relay layout ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [0, 7])
def test_relay_layout_puts_each_prefix_first_and_maps_back(extra):
    """Also at more suffix columns than the longest suffix needs (a recorded prefill's length): masked ones."""
    ids, mask = left_pad(MIXED)
    n_pad = left_padding(mask)
    grouping = find_groups(ids, n_pad, 32)
    lengths = grouping.prefix_lengths()
    longest = max(len(r) - p for r, p in zip(MIXED, lengths))
    layout = relay_layout(ids, mask, n_pad, lengths, suffix_columns=longest + extra - 3 * (not extra))
    P, cols = layout.prefix_columns, layout.columns
    assert P == max(lengths) and cols == P + longest + extra
    for b, (row, p) in enumerate(zip(MIXED, lengths)):
        s = len(row) - p
        assert torch.equal(layout.ids[b, :p], row[:p]) and torch.equal(layout.ids[b, cols - s:], row[p:])
        assert layout.mask[b].tolist() == [1] * p + [0] * (cols - p - s) + [1] * s
        assert int(layout.suffix_padding[b]) == cols - P - s
        positions = (layout.mask[b].cumsum(0) - 1)[cols - s:]
        assert positions.tolist() == list(range(p, len(row)))  # stock's positions: the suffix follows its prefix
    generated = torch.randint(0, 9, (20, 3), generator=G)
    back = layout.to_stock(torch.cat([layout.ids.repeat_interleave(2, 0), generated], 1))
    assert torch.equal(back, torch.cat([ids.repeat_interleave(2, 0), generated], 1))


def test_one_prefix_layout_keeps_the_columns_of_stock():
    rows = [torch.cat([SYS_A, _tokens(n)]) for n in (1, 5, 3)]
    ids, mask = left_pad(rows)
    layout = relay_layout(ids, mask, left_padding(mask), 40)
    assert layout.columns == ids.shape[1] and (layout.ids[:, :40] == SYS_A).all()
    assert torch.equal(layout.ids.sort(1).values, ids.sort(1).values)  # same tokens per row (pads included)


def test_a_deep_tree_needs_no_recursion():
    """Rows that each extend the previous one by a token: an LCP tree as deep as the batch is wide."""
    rows = [torch.tensor([7] * i + [2, 3]) for i in range(1, 301)]
    ids, mask = left_pad(rows)
    grouping = find_groups(ids, left_padding(mask), min_length=4)
    _check_grouping(rows, grouping, 4)
