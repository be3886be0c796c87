"""relay_hf.stats: the counters are exact when calls run concurrently, and ``kv_bytes_not_reread`` counts per layer
what stock attention would have read of the shared prefixes and relay did not, sliding windows included."""

import threading

import pytest
import torch
import transformers

import relay_hf
from tests.helpers import VOCAB, grouped_batch, left_pad, shared_prefix_batch, tiny_model

WINDOW = 8


def _delta(before: relay_hf.RelayStats, after: relay_hf.RelayStats) -> dict[str, int]:
    return {name: after.as_dict()[name] - value for name, value in before.as_dict().items()}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Calls of different shapes: ``(ids, mask, new tokens)``; one prompt shared by 2..5 rows of 24..56 tokens,
    several prompts with a second level and a row that shares nothing, and a batch that shares nothing."""
    calls = []
    for i, (prefix, suffixes, new) in enumerate([(40, (3, 9, 1, 6), 6), (24, (2, 5), 4), (56, (4, 1, 7, 2, 3), 5),
                                                 (32, (6, 6, 1), 3)]):
        ids, mask, _ = shared_prefix_batch(prefix, suffixes, seed=40 + i)
        calls.append((ids, mask, new))
    ids, mask, _, _ = grouped_batch(seed=44)
    calls.append((ids, mask, 4))
    g = torch.Generator().manual_seed(45)
    calls.append((*left_pad([torch.randint(3, VOCAB, (n,), generator=g) for n in (9, 14)]), 3))
    return calls


def _generate(model, call) -> None:
    ids, mask, new = call
    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def test_counters_are_exact_when_calls_run_on_several_threads():
    """Each call counts from its own plan: the totals of 4 threads x 6 calls equal the sum of the same calls'
    counts taken one at a time (nothing kept between calls, so no call's counts depend on another's)."""
    model = relay_hf.patch(tiny_model("qwen2", seed=6), min_prefix_length=8, prefix_cache_bytes=0)
    calls = _batches()
    single = []
    for call in calls:
        before = relay_hf.stats(model)
        _generate(model, call)
        single.append(_delta(before, relay_hf.stats(model)))
    assert sum(c["kv_bytes_not_reread"] > 0 for c in single) >= 4 and single[-1]["stock_calls"] == 1
    threads, per_thread = 4, 6
    plan = [[(t + k) % len(calls) for k in range(per_thread)] for t in range(threads)]
    start, errors = threading.Barrier(threads), []

    def work(indices):
        try:
            start.wait()
            for i in indices:
                _generate(model, calls[i])
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    before = relay_hf.stats(model)
    workers = [threading.Thread(target=work, args=(indices,)) for indices in plan]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    want = {name: sum(single[i][name] for indices in plan for i in indices) for name in single[0]}
    assert _delta(before, relay_hf.stats(model)) == want


# -- sliding windows -------------------------------------------------------------------------------------------------
def _gemma2():
    """Gemma 2 of three layers (sliding, full, sliding) with a window of 8 tokens, fp32."""
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                       max_position_embeddings=1024, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def _expected_bytes(cache, config, mask: torch.Tensor, steps: int) -> int:
    """Written from the definitions, by brute force over steps, layers, segments and rows: at each decode step, each
    layer and each shared segment, stock reads per row the tokens of the segment the layer stores that the row's
    query sees (all under full attention, positions ``> t - window`` under a window); relay reads the most any row
    reads, once. The stored lengths, head counts, dims and dtype are the cache's own."""
    groups, tree = cache.groups, cache.tree
    lengths, starts = list(tree.lengths), list(tree.starts())
    paths = groups.paths if groups is not None else [(0,)] * mask.shape[0]
    first = mask.sum(1).tolist()  # each row's prompt length: the position of its first decode query
    total = 0
    for index, layer in enumerate(cache.layers):
        window = WINDOW if config.layer_types[index] == "sliding_attention" else None
        kept = [n if window is None else min(n, window - 1) for n in lengths]
        assert layer.prefix_keys.shape[2] == sum(kept)  # the cache stores exactly that much of each segment
        k, v = layer.prefix_keys, layer.prefix_values
        token_bytes = (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]) * k.element_size()
        for step in range(1, steps + 1):
            for j, (start, n) in enumerate(zip(starts, lengths)):
                stored = range(start + n - kept[j], start + n)
                reads = []
                for b, path in enumerate(paths):
                    if j in path:
                        t = first[b] + step - 1
                        reads.append(sum(1 for p in stored if window is None or p > t - window))
                if reads:
                    total += (sum(reads) - max(reads)) * token_bytes
    return total


@pytest.mark.parametrize("batch", ["one prompt", "several prompts"])
def test_kv_bytes_count_what_each_layer_stores_and_stock_would_read_again(batch):
    """Gemma 2, window 8, a 40-token system prompt: a sliding layer keeps 7 tokens of it, and its rows' windows
    leave the prompt within a few steps; the count is what the definition gives, layer by layer."""
    model = relay_hf.patch(_gemma2(), min_prefix_length=8, prefix_cache_bytes=0)
    if batch == "one prompt":
        ids, mask, _ = shared_prefix_batch(40, (3, 9, 1, 6), seed=31)
    else:
        ids, mask, _, _ = grouped_batch(seed=32)
    new = 10
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True)
    assert model.relay_last_decision.used, model.relay_last_decision
    cache = out.past_key_values
    assert isinstance(cache, relay_hf.RelayCache) and cache.layers[0].prefix_keys.shape[2] < 40
    want = _expected_bytes(cache, model.config, mask, new - 1)
    seen = relay_hf.stats(model)
    assert seen.relay_steps == new - 1 and seen.kv_bytes_not_reread == want


def test_windows_and_bytes_per_layer():
    """Per layer: the window stock and relay attention apply (Gemma 2's alternating layers, Mistral's window on
    every layer, Qwen2's only where it turns it on) and one token's KV bytes; continuous batching counts the
    full-attention layers."""
    from relay_hf.stats import attention_windows, full_layer_kv_bytes, kv_bytes_per_token, layer_kv_bytes

    gemma = _gemma2()
    assert attention_windows(gemma) == [WINDOW, None, WINDOW]
    assert layer_kv_bytes(gemma) == [2 * 2 * 16 * 4] * 3 and full_layer_kv_bytes(gemma) == 2 * 2 * 16 * 4
    assert attention_windows(tiny_model("mistral", sliding_window=24)) == [24, 24]
    assert attention_windows(tiny_model("mistral")) == [None, None]
    qwen2 = tiny_model("qwen2", use_sliding_window=True, sliding_window=24, max_window_layers=1)
    assert attention_windows(qwen2) == [None, 24]
    assert attention_windows(tiny_model("qwen2", sliding_window=24)) == [None, None]
    llama = tiny_model("llama")
    assert full_layer_kv_bytes(llama) == kv_bytes_per_token(llama) == 2 * (4 * 16 * 2) * 4  # 2 layers, fp32


def test_head_shapes_reads_per_layer_configs():
    # Gemma 4's global and sliding layers have other head sizes, and transformers refuses to read them globally
    from relay_hf.stats import head_shape, head_shapes
    from tests.helpers import tiny_config

    gemma4 = tiny_config("gemma4_text").get_text_config(decoder=True)
    shapes = head_shapes(gemma4)
    assert len({shape[2] for shape in shapes}) == 2
    assert shapes == {head_shape(layer) for layer in gemma4.per_layer_config}
    llama = tiny_config("llama")
    assert head_shapes(llama) == {head_shape(llama)}
