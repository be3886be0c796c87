"""relay_hf.kept: the prefixes a call takes from the model's prefix store, one way for ``generate`` and the pipeline:
kept where they were, else prefilled and kept; a hit counted per tree that took kept tokens; the store trimmed to its
budget with the call's own segments kept."""

import torch

import relay_hf
from relay_hf.kept import kept_caches, prefix_store, tree_keys
from relay_hf.prefix import PrefixTree
from relay_hf.state import relay_state
from tests.helpers import tiny_model


def _trees(*ranges) -> list[PrefixTree]:
    return [PrefixTree.from_prefixes([torch.arange(a, b)]) for a, b in ranges]


def _patched(**kwargs):
    model = tiny_model("llama")
    relay_hf.patch(model, min_prefix_length=8, **kwargs)
    return model


def test_a_tree_taken_from_the_store_counts_one_hit_and_the_same_kv():
    model = _patched()
    store, depends = prefix_store(model)
    trees = _trees((10, 30), (40, 52))
    first, keys = kept_caches(model, trees, store, depends)
    assert keys == [k for tree in trees for k in tree_keys(tree)] and all(k in store for k in keys)
    assert relay_hf.stats(model).prefix_hits == 0 and [c.kept_tokens for c in first] == [0, 0]
    (again,), _ = kept_caches(model, trees[:1], *prefix_store(model))
    stats = relay_hf.stats(model)
    assert (stats.prefix_hits, stats.prefill_tokens_saved, again.kept_tokens) == (1, 20, 20)
    assert torch.equal(again.layers[0].prefix_keys, first[0].layers[0].prefix_keys)


def test_without_a_store_nothing_is_kept_or_counted():
    model = _patched(prefix_cache_bytes=0)
    assert prefix_store(model) == (None, None)
    for _ in range(2):
        (cache,), _ = kept_caches(model, _trees((10, 30)), None, None)
        assert cache.kept_tokens == 0
    assert relay_hf.stats(model).prefix_hits == 0 and len(relay_state(model).store) == 0


def test_the_store_is_trimmed_to_its_budget_the_calls_own_segments_kept():
    model = _patched(prefix_cache_bytes=1)  # below any segment: only what the last call took stays
    _, old = kept_caches(model, _trees((10, 30)), *prefix_store(model))
    _, new = kept_caches(model, _trees((40, 52), (60, 80)), *prefix_store(model))
    assert relay_state(model).store.keys() == new and not set(old) & set(new)
