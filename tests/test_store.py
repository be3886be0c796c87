"""relay_hf.store: the prefix store on its own (no model), and what a kept prefix's KV depends on (tiny models)."""

import threading
import time

import pytest
import torch

from relay_hf.dependencies import kv_dependencies
from relay_hf.store import PrefixKey, PrefixStore, StaleKept
from tests.helpers import tiny_model


def _store(budget=100):
    return PrefixStore(budget, nbytes=len)  # values are byte strings: their length is what they hold


def test_a_miss_builds_a_hit_does_not():
    store, built = _store(), []
    assert store.get("a", 0, lambda: built.append("a") or b"x" * 10) == b"x" * 10
    assert store.get("a", 0, lambda: built.append("again") or b"y") == b"x" * 10
    assert built == ["a"] and (store.hits, store.misses) == (1, 1)


def test_built_under_names_the_signature_the_kept_entries_were_built_under():
    store = _store()
    store.get("a", ("s", 1), lambda: b"x")
    assert store.built_under(("s", 1)) and not store.built_under(("s", 2))
    store.get("a", ("s", 2), lambda: b"y")  # another signature drops the entries first
    assert store.built_under(("s", 2)) and store.keys() == ["a"]


def test_launch_runs_for_kept_values_only_and_changes_nothing():
    """``launch`` starts the checks of the kept values among ``keys`` (a call's segments, before ``get``), merging
    what each returns; the LRU order and the counters stay as they were."""
    store = _store()
    store.get("a", 0, lambda: b"x" * 10)
    store.get("b", 0, lambda: b"y" * 20)
    seen = []
    assert store.launch(["b", "c", "a"], lambda v: seen.append(v) or {len(v): v}) == {20: b"y" * 20, 10: b"x" * 10}
    assert seen == [b"y" * 20, b"x" * 10]
    assert store.keys() == ["a", "b"] and (store.hits, store.misses) == (0, 2)


def test_least_recently_used_go_first_down_to_the_budget():
    store = _store(100)
    for key in "abc":
        store.get(key, 0, lambda: b"x" * 40)
    store.trim()
    assert store.keys() == ["b", "c"] and store.nbytes() == 80
    store.get("b", 0, lambda: b"")  # b is now the most recent
    store.get("d", 0, lambda: b"x" * 40)
    store.trim()
    assert store.keys() == ["b", "d"]


def test_entries_within_the_budget_stay_whatever_a_call_uses():
    store = _store(100)
    store.get("a", 0, lambda: b"x" * 30)
    store.get("b", 0, lambda: b"x" * 30)
    store.trim(keep=["b"])
    assert store.keys() == ["a", "b"]  # a is not used by this call, but fits: kept


def test_kept_and_held_entries_outlive_the_budget_until_let_go():
    store = _store(50)
    store.get("a", 0, lambda: b"x" * 40)
    with store.holding(["a"]):
        store.get("b", 0, lambda: b"x" * 40)
        store.trim(keep=["b"])
        assert store.keys() == ["a", "b"]  # over budget while both are in use
    assert store.keys() == ["b"]  # a let go: the least recent out, b fits


def test_a_verdict_left_unread_serves_the_value_until_settle_reads_it():
    """With ``pending``, a hit whose check answers with an unread verdict (a tensor) is served at once; ``settle``
    reads it: a check that held changes nothing, one that failed drops the entry as a failed check read at once does
    (counted stale, its hit not counted) and raises ``StaleKept``. A ``bool`` verdict, or no ``pending``, is read
    at once."""
    store, built = _store(), []
    store.get("a", 0, lambda: b"a" * 10)
    held, failed = (lambda value: torch.tensor(True)), (lambda value: torch.tensor(False))
    pending = []
    assert store.get("a", 0, lambda: built.append(1) or b"new", held, pending) == b"a" * 10
    store.settle(pending)
    assert pending == [] and store.keys() == ["a"] and (store.hits, store.misses, store.stale) == (1, 1, 0)
    assert store.get("a", 0, lambda: built.append(1) or b"new", failed, pending) == b"a" * 10  # served, unread
    assert store.keys() == ["a"] and len(pending) == 1
    with pytest.raises(StaleKept):
        store.settle(pending)
    assert pending == [] and store.keys() == [] and (store.hits, store.misses, store.stale) == (1, 1, 1)
    store.get("a", 0, lambda: b"b" * 10)
    assert store.get("a", 0, lambda: built.append(1) or b"new", lambda value: False, pending) == b"new"
    assert store.get("a", 0, lambda: built.append(2) or b"newer", failed) == b"newer"  # no pending: read at once
    assert built == [1, 2] and pending == [] and store.stale == 3
    store.get("a", 0, lambda: b"", failed, pending)
    store.get("a", 1, lambda: b"rebuilt")  # the model changed meanwhile: another call built it again
    with pytest.raises(StaleKept):
        store.settle(pending)
    assert store.values() == [b"rebuilt"] and store.stale == 3  # the new entry stays; the old went uncounted


def test_entries_built_under_other_dependencies_are_dropped():
    store, built = _store(), []
    store.get("a", "weights v1", lambda: b"old")
    assert store.get("a", "weights v2", lambda: built.append(1) or b"new") == b"new"
    assert built == [1] and store.values() == [b"new"]


def test_a_zero_budget_keeps_nothing_between_calls_and_bad_budgets_are_refused():
    store = _store(0)
    store.get("a", 0, lambda: b"x")
    store.trim()
    assert len(store) == 0
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="budget"):
            PrefixStore(bad, len)
        with pytest.raises(ValueError, match="prefix_cache_bytes"):
            store.budget_bytes = bad
    assert store.budget_bytes == 0  # a refused budget leaves the one set


def test_threads_asking_for_one_key_build_it_once():
    store, built = _store(), []

    def build():
        built.append(1)
        time.sleep(0.05)
        return b"x"

    threads = [threading.Thread(target=store.get, args=("a", 0, build)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [1]


def test_a_packing_is_kept_while_its_entries_are():
    store, packs = _store(100), []
    pack = lambda values: packs.append(values) or b"".join(values)  # noqa: E731
    store.get("a", 0, lambda: b"a" * 40)
    store.get("b", 0, lambda: b"b" * 40)
    assert store.packed(["a", "b"], pack) is store.packed(["a", "b"], pack) and len(packs) == 1
    store.get("c", 0, lambda: b"c" * 40)
    store.trim(keep=["b", "c"])  # a goes, and with it the packing that holds its bytes
    assert store.keys() == ["b", "c"]
    store.packed(["b", "c"], pack)
    store.get("b", 1, lambda: b"B" * 40)  # the model changed: entries and packing are rebuilt
    store.packed(["b"], pack)
    assert packs[-1] == [b"B" * 40] and len(packs) == 3
    assert store.packed(["b", "a"], pack) is None and len(packs) == 3  # a key dropped since: nothing to pack from


def test_building_a_segment_drops_what_was_kept_under_its_last_value():
    # a prompt evicted while a document kept under it stays: the prompt prefilled anew drops the document, whose KV
    # followed the prompt's old KV (a change only the prompt's tokens see passes the document's own check)
    store = _store(1000)
    ids = torch.arange(10, 30)
    prompt, document, other = PrefixKey.of(0, ids[:12]), PrefixKey.of(12, ids), PrefixKey.of(0, ids[1:12])
    store.resize(100)
    for key in (prompt, document, other):  # a parent is read before its child: least recently used, it goes first
        store.get(key, 0, lambda: b"x" * 40)
    store.trim()
    assert store.keys() == [document, other]
    store.get(prompt, 0, lambda: b"y" * 40)
    assert store.keys() == [other, prompt] and store.stale == 0
    store.get(document, 0, lambda: b"z" * 40)
    assert store.misses == 5 and store.hits == 0


def test_the_store_holds_the_models_signature_not_its_modules():
    import gc
    import weakref

    # (the call's walk holds the modules naming their layer, for that call: the store keeps only what it compares)
    model = tiny_model("llama")
    store = _store(1000)
    store.get("a", kv_dependencies(model), lambda: b"a")
    weight = weakref.ref(model.model.layers[0].self_attn.k_proj.weight)
    del model
    gc.collect()
    assert weight() is None and store.get("a", 0, lambda: b"b") == b"b"  # another model's signature: rebuilt


def test_a_prefix_key_holds_its_start_and_ids_and_equals_the_plain_tuple():
    ids = torch.tensor([5, 7, 11], dtype=torch.int64)
    key = PrefixKey.of(4, ids)
    assert (key.start, key.tokens) == (4, 3) and torch.equal(key.ids(), ids)
    assert key == (4, ids.numpy().tobytes()) and hash(key) == hash((4, ids.numpy().tobytes()))
    assert key != PrefixKey.of(0, ids)  # a child and a root of the same ids are different entries
    key.ids()[0] = 99  # a copy: the key stays as it is
    assert torch.equal(key.ids(), ids)
    assert PrefixKey.of(4, ids.to(torch.int32)) == key  # int32 input_ids find what int64 ones kept


def test_resize_validates_then_drops_down_to_the_new_budget():
    store = _store(100)
    for key in "abc":
        store.get(key, 0, lambda: b"x" * 30)
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        store.resize(-1)
    assert store.budget_bytes == 100 and store.keys() == ["a", "b", "c"]  # refused: nothing changed
    with store.holding(["a"]):
        store.resize(40)
        assert store.budget_bytes == 40 and store.keys() == ["a"]  # held stays, the others go down to the budget


def test_a_key_extends_only_the_keys_its_full_prefix_continues():
    ids = torch.arange(10, 30)
    prompt, document = PrefixKey.of(0, ids[:12]), PrefixKey.of(12, ids)
    assert document.extends(prompt) and not prompt.extends(document) and not prompt.extends(prompt)
    assert PrefixKey.of(0, ids).extends(prompt)  # one root segment holding both: its KV follows the prompt's too
    assert not PrefixKey.of(12, torch.cat([ids[:11], ids[12:]])).extends(prompt)
    assert not document.extends((0, ids[:12].numpy().tobytes()))  # a plain tuple is no kept segment's key
