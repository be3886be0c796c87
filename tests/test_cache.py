"""RelayCache: one prefix copy, suffix-only bookkeeping, exact on stock attention too."""

import pytest
import torch

import relay_hf
from relay_hf import RelayCache
from relay_hf.layers import RelayLayer, StaticRelayLayer
from tests.helpers import shared_prefix_batch, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def test_from_prefix_stores_one_copy(model):
    _, _, prefix = shared_prefix_batch()
    cache = RelayCache.from_prefix(model, prefix)
    H, D = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    assert cache.prefix_length == 40 and cache.get_seq_length() == 40
    assert torch.equal(cache.prefix_ids, prefix)
    for lay in cache.layers:
        assert lay.prefix_keys.shape == (1, H, 40, D) and lay.suffix_length == 0
    assert cache.prefix_nbytes() == len(cache.layers) * 2 * H * 40 * D * 4


def test_suffix_ops_leave_the_prefix_alone(model):
    _, _, prefix = shared_prefix_batch()
    cache = RelayCache.from_prefix(model, prefix)
    lay = cache.layers[0]
    k = torch.randn(3, lay.prefix_keys.shape[1], 5, lay.prefix_keys.shape[-1])
    for each in cache.layers:
        each.append(k, k + 1)
    assert cache.get_seq_length() == 45
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert torch.equal(lay.keys[1], k[2]) and lay.prefix_keys.shape[0] == 1
    cache.batch_repeat_interleave(2)
    assert lay.keys.shape[0] == 6
    cache.crop(-2)
    assert cache.get_seq_length() == 43
    with pytest.raises(ValueError, match="never cropped"):
        cache.crop(-10)
    fork = cache.fork()
    assert fork.get_seq_length() == 40 and fork.layers[0].prefix_keys is lay.prefix_keys


def test_relay_cache_on_stock_attention_is_exact(model):
    """Unpatched model + RelayCache: update hands stock attention the concatenated prefix + suffix."""
    ids, mask, prefix = shared_prefix_batch(suffix_lens=(4, 4, 4))
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits[:, 40:]
        cache = RelayCache.from_prefix(model, prefix)
        assert not cache.relay_active
        tail = model(ids[:, 40:], attention_mask=mask, **{relay_hf._compat.cache_kwarg_name(model): cache}).logits
    assert torch.allclose(full, tail, atol=1e-5)


def test_relay_cache_forward_on_patched_model_matches(model):
    ids, mask, prefix = shared_prefix_batch(suffix_lens=(4, 4, 4))
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits[:, 40:]
        relay_hf.patch(model)
        try:
            cache = RelayCache.from_prefix(model, prefix)
            assert cache.relay_active
            kw = {relay_hf._compat.cache_kwarg_name(model): cache}
            tail = model(ids[:, 40:], attention_mask=mask, **kw).logits
        finally:
            relay_hf.unpatch(model)
    assert torch.allclose(full, tail, atol=1e-5)


def test_decode_writes_in_place_and_grows_geometrically():
    lay = RelayLayer(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    lay.reserve(20)
    lay.append(torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8))
    ptr, cap = lay.keys.data_ptr(), lay.capacity
    assert cap == 20
    steps = [torch.randn(3, 2, 1, 8) for _ in range(14)]
    for k in steps:
        lay.append(k, -k)
    assert lay.keys.data_ptr() == ptr and lay.suffix_length == 20  # 14 decode steps, no reallocation
    lay.append(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8))
    assert lay.capacity == 40 and lay.suffix_length == 21  # doubled once, contents kept
    assert torch.equal(lay.keys[:, :, 6:20], torch.cat(steps, 2)) and torch.equal(lay.values[:, :, 6:20],
                                                                                   -torch.cat(steps, 2))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


CALLS = 30  # a leak shows in the tensor count after one call, and in RSS at its per-call rate below
RSS_PER_CALL = 160 * 2**10  # what one call may add to RSS; allocator noise after the warm-up stays well inside it


@pytest.mark.parametrize("static", [False, True])
def test_repeated_generate_calls_keep_memory_flat(static):
    import gc

    model = relay_hf.patch(tiny_model("llama"), min_prefix_length=8)
    ids, mask, _ = shared_prefix_batch(seed=9)
    extra = dict(cache_implementation="static") if static else {}

    def run(n):
        for _ in range(n):
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **extra)
        assert model.relay_last_decision.used and model.relay_last_decision.static == static
        gc.collect()
        # type(), not isinstance: a lazy proxy's __class__ (openai's) would load what it stands for at every count
        return _rss_bytes(), sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())

    run(15)  # warm-up: allocator pools, lazy imports, the prefix store's entry
    rss0, tensors0 = run(CALLS)  # steady state from here: the kept prefix and the pools are in place
    rss1, tensors1 = run(CALLS)
    assert tensors1 <= tensors0, f"{tensors1 - tensors0} tensors leaked over {CALLS} calls"
    assert rss1 - rss0 < CALLS * RSS_PER_CALL, f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over {CALLS} calls"


def _static_layer(B=3, cap=8, pads=(0, 2, 5)):
    lay = StaticRelayLayer(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), cap,
                                    torch.tensor(pads, dtype=torch.int32))
    return lay


def test_static_layer_writes_in_place_and_tracks_extents_on_device():
    lay = _static_layer()
    k, v = lay.relay_update(torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8))
    ptrs = (lay.keys.data_ptr(), lay.end.data_ptr(), lay.row_lengths.data_ptr())
    assert k.suffix.shape == (3, 2, 8, 8) and k.prefix is lay.prefix_keys
    assert int(k.step.suffix_end) == 6 and k.step.suffix_lengths.tolist() == [6, 4, 1]  # padding excluded
    step = torch.randn(3, 2, 1, 8)
    k, v = lay.relay_update(step, -step)
    assert (lay.keys.data_ptr(), lay.end.data_ptr(), lay.row_lengths.data_ptr()) == ptrs
    assert int(k.step.suffix_end) == 7 and k.step.suffix_lengths.tolist() == [7, 5, 2]
    assert torch.equal(k.suffix[:, :, 6:7], step) and torch.equal(v.suffix[:, :, 6:7], -step)
    assert int(lay.get_seq_length()) == 5 + 7
    lay.reset()
    assert int(lay.end) == 0 and lay.row_lengths.tolist() == [0, -2, -5] and lay.keys.abs().sum() == 0


def test_static_cache_refuses_what_it_cannot_do():
    lay = _static_layer()
    with pytest.raises(ValueError, match="patched"):
        lay.update(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8))  # stock's contract
    with pytest.raises(ValueError, match="suffix_padding"):
        _static_layer(pads=(0, 1)).relay_update(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8))
    lay.relay_update(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8))
    with pytest.raises(NotImplementedError, match="cropped"):
        lay.crop(-1)
    with pytest.raises(NotImplementedError, match="batch"):
        lay.batch_repeat_interleave(2)


def test_static_fork_owns_its_prefix_and_refills_in_place():
    config = tiny_model("llama").config
    kv = [(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)) for _ in range(config.num_hidden_layers)]
    base = RelayCache(config, kv, prefix_ids=torch.arange(5))
    with pytest.raises(ValueError, match="prefix"):
        RelayCache(config).fork(max_suffix_length=8)
    static = base.fork(max_suffix_length=8, suffix_padding=torch.zeros(3, dtype=torch.int32))
    assert static.is_static and static.is_compileable and not base.is_compileable
    assert static.layers[0].prefix_keys.data_ptr() != kv[0][0].data_ptr()  # a copy: refill must not touch `base`
    assert not static.can_refill(base, 3, 8)  # not initialised yet
    for lay in static.layers:
        lay.relay_update(torch.randn(3, 2, 2, 8), torch.randn(3, 2, 2, 8))
    other = RelayCache(config, [(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)) for _ in kv], torch.arange(5) + 1)
    assert static.can_refill(other, 3, 8) and not static.can_refill(other, 4, 8) and not static.can_refill(other, 3, 16)
    ptr = static.layers[0].prefix_keys.data_ptr()
    static.refill(other, torch.tensor([0, 1, 0], dtype=torch.int32))
    assert static.layers[0].prefix_keys.data_ptr() == ptr
    assert torch.equal(static.layers[0].prefix_keys, other.layers[0].prefix_keys)
    assert torch.equal(base.layers[0].prefix_keys, kv[0][0])
    assert int(static.layers[0].end) == 0 and static.layers[0].row_lengths.tolist() == [0, -1, 0]


# -- several prefixes ------------------------------------------------------------------------------------------------
def test_from_prefixes_stores_each_shared_part_once_and_matches_a_prefill_of_the_whole(model):
    g = torch.Generator().manual_seed(7)
    system, doc_a, doc_b, other = (torch.randint(3, 200, (n,), generator=g) for n in (20, 6, 9, 11))
    cache = RelayCache.from_prefixes(model, [system, torch.cat([system, doc_a]), torch.cat([system, doc_b]), other])
    assert cache.tree.lengths == (20, 6, 9, 11) and cache.tree.parents == (-1, 0, 0, -1)
    assert cache.prefix_ids is None and cache.prefix_length == 29 and "segments=4" in repr(cache)
    H, D = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    assert cache.prefix_nbytes() == len(cache.layers) * 2 * H * 46 * D * 4  # 20 + 6 + 9 + 11 tokens, once
    whole = RelayCache.from_prefix(model, torch.cat([system, doc_b]))
    for mine, ref in zip(cache.layers, whole.layers):  # doc_b's KV: computed after the system prompt's
        torch.testing.assert_close(mine.prefix_keys[:, :, 26:35], ref.prefix_keys[:, :, 20:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.prefix_values[:, :, :20], ref.prefix_values[:, :, :20])
    with pytest.raises(ValueError, match="fork"):
        cache.fork()
    with pytest.raises(ValueError, match="suffix_padding"):
        cache.fork(paths=[(0,), (3,)])
    fork = cache.fork(paths=[(0, 1), (3,), (0,)], suffix_padding=torch.tensor([0, 2, 1]))
    assert fork.groups.prefix_lengths == (26, 11, 20) and fork.prefix_length == 26 and fork.get_seq_length() == 26
    assert fork.layers[0].prefix_keys is cache.layers[0].prefix_keys  # shared, not copied
    k = torch.randn(3, H, 4, D)
    fork.layers[0].append(k, k)
    fork.reorder_cache(torch.tensor([2, 0, 0]))
    assert fork.groups.paths == ((0,), (0, 1), (0, 1))
    fork.batch_repeat_interleave(2)
    assert fork.groups.rows == 6 and fork.layers[0].keys.shape[0] == 6
    with pytest.raises(ValueError, match="non-empty list"):
        RelayCache.from_prefixes(model, [])


def test_a_static_cache_of_several_prefixes_holds_room_and_is_refilled_for_what_fits(model):
    g = torch.Generator().manual_seed(8)
    a, b, c = (torch.randint(3, 200, (n,), generator=g) for n in (30, 12, 20))
    base = RelayCache.from_prefixes(model, [a, b])
    pads = torch.tensor([0, 1, 2, 0])
    static = base.fork(max_suffix_length=64, suffix_padding=pads, paths=[(0,), (1,), (0,), (1,)])
    lay = static.layers[0]
    assert static.is_static and lay.prefix_keys.shape[2] == 256 and lay.groups.segments_per_level == 4
    k = torch.randn(4, lay.prefix_keys.shape[1], 3, lay.prefix_keys.shape[3])
    lay.relay_update(k, k)  # allocate the suffix buffers
    other = RelayCache.from_prefixes(model, [c, a, b])
    paths = [(2,), (0,), (1,), (0,)]
    assert static.can_refill(other, 4, 64, paths=paths)
    one = RelayCache.from_prefix(model, a)
    assert not static.can_refill(one, 4, 64, paths=[(0,)] * 4)  # one prompt for every row: the ungrouped kernels
    assert not static.can_refill(RelayCache.from_prefixes(model, [a, torch.cat([a, c])]), 4, 64,
                                 paths=[(0, 1), (0,), (0, 1), (0,)])  # two levels
    static.refill(other, pads, paths)
    assert lay.suffix_length == 0 and lay.groups.paths == tuple(paths) and lay.groups.segments_per_level == 4
    torch.testing.assert_close(lay.prefix_keys[:, :, :62], other.layers[0].prefix_keys)


@pytest.mark.parametrize("ids", [[], torch.tensor([], dtype=torch.long), [[]]])
def test_an_empty_prefix_is_refused_as_empty(ids):
    with pytest.raises(ValueError, match="prefix_ids is empty"):
        RelayCache.from_prefix(tiny_model("llama"), ids)


def test_a_used_cache_pickles_and_copies_without_its_kernel_plans():
    """A cache that ran keeps the kernel plans its layers share (compiled launches): pickling and deep copies leave
    them behind, and the copy computes what the original does."""
    import copy
    import pickle

    from relay_hf.attention import relay_attention_forward

    model = tiny_model("llama")
    relay_hf.patch(model)
    base = RelayCache.from_prefix(model, torch.arange(10, 30))
    for fork in (base.fork(suffix_padding=torch.zeros(2, dtype=torch.int32)),
                 base.fork(suffix_padding=torch.zeros(2, dtype=torch.int32), max_suffix_length=16)):
        H, D = model.config.num_key_value_heads, model.config.head_dim
        k, v = fork.update(torch.randn(2, H, 3, D), torch.randn(2, H, 3, D), 0)
        fork._plans.setdefault(None, {})["marker"] = object()  # what a CUDA step would keep there
        attn = model.model.layers[0].self_attn
        q = torch.randn(2, model.config.num_attention_heads, 1, D)
        want, _ = relay_attention_forward(attn, q, k, v, None, scaling=attn.scaling)
        for other in (pickle.loads(pickle.dumps(fork)), copy.deepcopy(fork)):
            assert other._plans == {} and all(getattr(lay, "_step", None) is None for lay in other.layers)
            k2, v2 = other.update(torch.zeros(2, H, 0, D), torch.zeros(2, H, 0, D), 0)
            got, _ = relay_attention_forward(attn, q, k2, v2, None, scaling=attn.scaling)
            assert torch.equal(got, want)
    relay_hf.unpatch(model)
