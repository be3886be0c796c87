"""relay_hf.cache_check: a caller's ``RelayCache`` checked against the model and the rows, each row's path in its
prefixes, and a match the caller made already (the pipeline's) taken instead of matching again."""

import pytest
import torch

import relay_hf
from relay_hf import RelayCache
from relay_hf.cache_check import cache_grouping, check_cache, rows_matched
from relay_hf.prefix import left_padding
from tests.helpers import shared_prefix_batch, tiny_model


@pytest.fixture
def setting():
    model = tiny_model("llama")
    relay_hf.patch(model, min_prefix_length=8)
    ids, mask, prefix = shared_prefix_batch()
    return model, RelayCache.from_prefix(model, prefix), ids, left_padding(mask)


def test_each_row_reads_the_prefix_it_starts_with_and_a_stranger_is_named(setting):
    model, cache, ids, n_pad = setting
    grouping = check_cache(model, cache, ids, n_pad)
    assert grouping.tree is cache.tree and grouping.paths == ((0,),) * ids.shape[0]
    stranger = ids.clone()
    stranger[2, int(n_pad[2]) + 5] += 1
    with pytest.raises(ValueError, match="row 2 differs at prefix position 5"):
        cache_grouping(cache, stranger, n_pad)


def test_a_match_the_caller_made_for_these_very_rows_is_taken(setting, monkeypatch):
    model, cache, ids, n_pad = setting
    grouping = cache_grouping(cache, ids, n_pad)
    matched = []
    real = type(cache.tree).match
    monkeypatch.setattr(type(cache.tree), "match", lambda tree, *a, **kw: matched.append(1) or real(tree, *a, **kw))
    with rows_matched(cache, ids, n_pad, grouping):
        assert check_cache(model, cache, ids, n_pad) is grouping and not matched
        assert check_cache(model, cache, ids.clone(), n_pad) is not grouping and matched == [1]  # other rows
        with pytest.raises(ValueError, match="does not match"):  # other padding: matched again, and wrong
            check_cache(model, cache, ids, torch.zeros_like(n_pad))
    assert check_cache(model, cache, ids, n_pad) is not grouping  # the block is over
