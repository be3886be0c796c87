"""relay_hf.kept: the prefixes a call takes from the model's prefix store, one way for ``generate`` and the pipeline:
kept where they were, else prefilled and kept; a hit counted per tree that took kept tokens; the store trimmed to its
budget with the call's own segments kept."""

import copy
import gc
import weakref

import pytest
import torch

import relay_hf
import relay_hf.generate as generate
from relay_hf import policy
from relay_hf.cache import RelayCache
from relay_hf.freshness import SegmentCheck, _Replay
from relay_hf.kept import kept_caches, launch_checks, prefix_store, tree_keys
from relay_hf.prefix import PrefixTree
from relay_hf.state import relay_state
from relay_hf.store import PrefixStore
from tests.helpers import VOCAB, tiny_model


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


def test_a_call_under_a_kept_prompt_launches_its_check_before_the_walk(monkeypatch):
    """``generate`` asks for the kept segments' checks once the call is known to read the store, before the walk
    (on CUDA the device then runs them while the host walks; off CUDA nothing is captured, so none is launched);
    not for a call that runs stock or brings its own cache."""
    model = _patched()
    prompt = torch.arange(10, 30)
    relay_hf.pin(model, prompt)
    events = []
    launch, walk = SegmentCheck.launch, policy.walk
    monkeypatch.setattr(SegmentCheck, "launch", lambda self, m, row: events.append("launch") or launch(self, m, row))
    monkeypatch.setattr(policy, "walk", lambda m: events.append("walk") or walk(m))
    ids = torch.cat([prompt, torch.arange(40, 45)])[None]
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    model.generate(ids, **gen)
    assert events == ["launch", "walk"] and model.relay_last_decision.prefix_kept == 20
    # off CUDA nothing is captured, so nothing launched; the call may be routed before its walk only where every
    # segment is kept
    assert launch_checks(model, PrefixTree.from_prefixes([prompt])) == ({}, True)
    assert launch_checks(model, PrefixTree.from_prefixes([torch.arange(50, 70)])) == ({}, False)
    events.clear()
    model.generate(ids, **gen, output_attentions=True)  # stock
    assert not model.relay_last_decision.used
    cache = RelayCache.from_prefixes(model, [prompt])
    model.generate(ids, **gen, past_key_values=cache)  # the caller's cache: the store is not read
    assert model.relay_last_decision.used and events == [], events


def _pinned_turn_on_cuda(seed: int, new_tokens: int):
    """A patched tiny fp32 model on CUDA with a 40-token prompt pinned, an unpatched copy, a two-row turn under the
    prompt (9 own tokens each: a full bucket, so no check row, ``check_row.py``, and its checks are launched early)
    and its greedy ``generate`` arguments."""
    model = tiny_model("llama").cuda()
    stock = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (40,), generator=g)
    own = torch.randint(3, VOCAB, (2, 9), generator=g)
    own[1, 0] = own[0, 0] % (VOCAB - 3) + 3  # the rows part after the prompt
    row = torch.cat([prompt.expand(2, -1), own], 1).cuda()
    relay_hf.patch(model)
    relay_hf.pin(model, prompt)
    return model, stock, row, dict(attention_mask=torch.ones_like(row), max_new_tokens=new_tokens, do_sample=False)


@pytest.mark.gpu
def test_a_turn_launches_its_kept_prompts_check_before_the_walk_on_gpu(monkeypatch):
    """fp32 on CUDA: a two-row turn under a pinned prompt launches the prompt's check before the call walks the
    model, and the verdict reads that launch (the check's forward runs once a call); the tokens are stock's. After a
    write in place the launched check fails and the call runs again on the prompt prefilled anew; after a parameter
    is dropped nothing is launched (what the graph read is gone) and the walk drops the entry. Stock's tokens each
    time (a copy of the model changed the same way)."""
    model, stock, row, gen = _pinned_turn_on_cuda(seed=5, new_tokens=5)
    events = []
    launch, replay, walk = _Replay.launch, _Replay.run, policy.walk

    def spy_launch(self, m):
        head = launch(self, m)
        events.append(("launch", head is not None))
        return head

    monkeypatch.setattr(_Replay, "launch", spy_launch)
    monkeypatch.setattr(_Replay, "run", lambda self, m, head: events.append("replay") or replay(self, m, head))
    monkeypatch.setattr(policy, "walk", lambda m: events.append("walk") or walk(m))

    def turn(expected_events, kept):
        events.clear()
        assert torch.equal(model.generate(row, **gen), stock.generate(row, **gen))
        assert model.relay_last_decision.prefix_kept == kept
        assert events[:len(expected_events)] == expected_events, events

    turn([("launch", True), "walk"], kept=40)
    assert "replay" not in events  # the verdict read the launched check
    for m in (model, stock):
        m.model.layers[-1].self_attn.k_proj.weight.data[3] += 0.1
    stale = relay_state(model).store.stale
    turn([("launch", True), "walk"], kept=0)
    assert relay_state(model).store.stale == stale + 1
    old = weakref.ref(model.model.layers[0].mlp.up_proj.weight)
    for m in (model, stock):
        m.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(m.model.layers[0].mlp.up_proj.weight.detach().clone())
    gc.collect()
    torch.cuda.empty_cache()  # (a graph replayed on what it read would now read memory given back to the driver)
    assert old() is None  # nothing of relay_hf's holds the model's parameters
    turn([("launch", False), "walk"], kept=0)



@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 1])
def test_nothing_between_a_turns_launch_and_its_verdict_waits_for_the_device_on_gpu(monkeypatch, rows):
    """fp32 on CUDA: from the launch of a pinned prompt's check to the reading of its verdict (after the turn's own
    prefill is queued), the host never waits for the device (torch's sync debug mode raises on any wait), so the
    check runs while the host lays the call out; the tokens are stock's. A one-row turn launches no check (its check
    is a row of its prefill, ``check_row.py``), and nothing before its verdict waits either."""
    model, stock, row, gen = _pinned_turn_on_cuda(seed=6, new_tokens=4)
    row = row[:rows]
    gen["attention_mask"] = gen["attention_mask"][:rows]
    expected = stock.generate(row, **gen)
    assert torch.equal(model.generate(row, **gen), expected)  # the first turn records what later turns replay
    launch, settle, seen = generate.launch_checks, PrefixStore.settle, []

    def launch_then_watch(m, tree, check_row):
        launched = launch(m, tree, check_row)
        seen.append(bool(launched[0]))  # (launch_checks answers (launched, whole))
        torch.cuda.set_sync_debug_mode("error")
        return launched

    def stop_watching(self, pending):
        torch.cuda.set_sync_debug_mode(0)
        return settle(self, pending)

    monkeypatch.setattr(generate, "launch_checks", launch_then_watch)
    monkeypatch.setattr(PrefixStore, "settle", stop_watching)
    try:
        for _ in range(2):
            assert torch.equal(model.generate(row, **gen), expected)
            assert model.relay_last_decision.prefix_kept == 40
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert seen == [rows == 2] * 2
