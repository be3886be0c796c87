"""Prefix finding and the stock <-> relay row layouts."""

import torch

from relay_hf.prefix import (
    common_prefix_length,
    first_mismatch,
    inverse_permutation,
    left_padding,
    relay_permutation,
    to_stock_layout,
)
from tests.helpers import left_pad


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


def test_permutation_round_trip_and_layout():
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(10, 99, (4,), generator=g)
    rows = [torch.cat([prefix, torch.randint(10, 99, (n,), generator=g)]) for n in (1, 5, 3)]
    ids, mask = left_pad(rows)
    n_pad = left_padding(mask)
    perm = relay_permutation(n_pad, 4, ids.shape[1])
    relay_ids, relay_mask = ids.gather(1, perm), mask.gather(1, perm)
    assert (relay_ids[:, :4] == prefix).all()
    for b, r in enumerate(rows):
        n = len(r) - 4
        assert torch.equal(relay_ids[b, -n:], r[4:])  # suffix right-aligned, as in stock
        assert relay_mask[b].tolist() == [1] * 4 + [0] * (ids.shape[1] - 4 - n) + [1] * n
    assert torch.equal(relay_ids.sort(1).values, ids.sort(1).values)  # same tokens per row
    generated = torch.randint(0, 9, (6, 3), generator=g)
    expanded = torch.cat([relay_ids.repeat_interleave(2, 0), generated], 1)
    back = to_stock_layout(expanded, inverse_permutation(perm))
    assert torch.equal(back, torch.cat([ids.repeat_interleave(2, 0), generated], 1))
