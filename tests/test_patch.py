"""patch/unpatch on tiny random models of five architectures: relay generate equals stock generate."""

import logging

import pytest
import torch

import relay_hf
from relay_hf._compat import output_cache
from relay_hf.cache import ATTN_NAME
from tests.tiny import ARCHS, shared_prefix_batch, tiny_model


def stock_and_relay(model, ids, mask, seed=0, **gen):
    """Run the same generate call stock, then patched; returns both outputs (model left patched)."""
    relay_hf.unpatch(model)
    torch.manual_seed(seed)
    stock = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **gen)
    relay_hf.patch(model, min_prefix_length=8)
    torch.manual_seed(seed)
    relay = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **gen)
    return stock, relay


@pytest.fixture(params=list(ARCHS))
def arch_model(request):
    model = tiny_model(request.param)
    yield model
    relay_hf.unpatch(model)


def test_greedy_logits_and_tokens_match(arch_model):
    ids, mask, _ = shared_prefix_batch()
    stock, relay = stock_and_relay(arch_model, ids, mask, max_new_tokens=10, do_sample=False, output_logits=True)
    assert arch_model.relay_last_decision.used and arch_model.relay_last_decision.prefix_length == 40
    assert len(relay.logits) == len(stock.logits) == 10  # prefill + 9 decode steps
    for step, (a, b) in enumerate(zip(stock.logits, relay.logits, strict=False)):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), f"logits differ at step {step}"
    assert torch.equal(stock.sequences, relay.sequences)
    cache = output_cache(relay)
    assert isinstance(cache, relay_hf.RelayCache) and cache.prefix_length == 40


def test_sampling_with_seed_matches(arch_model):
    ids, mask, _ = shared_prefix_batch(seed=1)
    stock, relay = stock_and_relay(arch_model, ids, mask, seed=7, max_new_tokens=10, do_sample=True, top_k=20)
    assert arch_model.relay_last_decision.used
    assert torch.equal(stock.sequences, relay.sequences)


def test_num_return_sequences_matches(arch_model):
    ids, mask, _ = shared_prefix_batch(seed=2, suffix_lens=(4, 2))
    stock, relay = stock_and_relay(arch_model, ids, mask, seed=3, max_new_tokens=8, do_sample=True,
                                   num_return_sequences=4)
    assert arch_model.relay_last_decision.rows == 8
    assert relay.sequences.shape[0] == 8
    assert torch.equal(stock.sequences, relay.sequences)


def test_beam_search_matches(arch_model):
    ids, mask, _ = shared_prefix_batch(seed=3, suffix_lens=(5, 2, 7))
    stock, relay = stock_and_relay(arch_model, ids, mask, max_new_tokens=8, num_beams=4, num_return_sequences=2,
                                   do_sample=False, output_scores=True)
    assert arch_model.relay_last_decision.used
    assert torch.equal(stock.sequences, relay.sequences)
    assert torch.allclose(stock.sequences_scores, relay.sequences_scores, atol=1e-5)


def test_relay_kernel_is_what_runs(monkeypatch):
    """The relay path really goes through relay_attention with one un-expanded prefix copy."""
    import relay_hf.attention as seam

    seen = []
    real = seam.relay_attention

    def spy(query, prefix_key, *args, **kwargs):
        seen.append((query.shape[0], prefix_key.shape[0], prefix_key.shape[2]))
        return real(query, prefix_key, *args, **kwargs)

    monkeypatch.setattr(seam, "relay_attention", spy)
    model = relay_hf.patch(tiny_model("llama"), min_prefix_length=8)
    seen.clear()  # patch's probe forward ran relay too
    ids, mask, _ = shared_prefix_batch()
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    # 2 layers x (suffix prefill + 2 decode steps), batch 4 against a batch-1 prefix of 40 tokens
    assert seen == [(4, 1, 40)] * 6


def test_streamer_and_stopping_criteria_see_stock_layout():
    from transformers import StoppingCriteria
    from transformers.generation.streamers import BaseStreamer

    class Record(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.chunks.append("end")

    class StopAfter(StoppingCriteria):
        def __init__(self):
            self.prompts = []

        def __call__(self, input_ids, scores, **kwargs):
            self.prompts.append(input_ids[:, :ids.shape[1]].clone())
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 4, dtype=torch.bool)

    model = tiny_model("qwen2")
    ids, mask, _ = shared_prefix_batch(seed=4)
    runs = []
    for patched in (False, True):
        if patched:
            relay_hf.patch(model, min_prefix_length=8)
        streamer, stop = Record(), StopAfter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, streamer=streamer,
                             stopping_criteria=[stop])
        runs.append((out, streamer, stop))
    (s_out, s_streamer, s_stop), (r_out, r_streamer, r_stop) = runs
    assert model.relay_last_decision.used
    assert torch.equal(s_out, r_out) and r_out.shape[1] == ids.shape[1] + 4
    assert torch.equal(r_streamer.chunks[0], ids)  # the prompt, in stock layout
    assert len(s_streamer.chunks) == len(r_streamer.chunks) and r_streamer.chunks[-1] == "end"
    assert all(torch.equal(a, b) for a, b in zip(s_streamer.chunks[:-1], r_streamer.chunks[:-1], strict=False))
    assert all(torch.equal(p, ids) for p in r_stop.prompts) and len(r_stop.prompts) == len(s_stop.prompts)


def test_user_logits_processor_sees_stock_layout():
    from transformers import LogitsProcessor

    class BanFirstPromptToken(LogitsProcessor):
        """Order-sensitive on purpose: reads column 0 of every row (a pad in stock layout, the prefix in relay's)."""

        def __init__(self):
            self.first_columns = []

        def __call__(self, input_ids, scores):
            self.first_columns.append(input_ids[:, 0].clone())
            return scores.scatter(1, input_ids[:, :1], float("-inf"))

    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=10)
    outs, procs = [], []
    for patched in (False, True):
        if patched:
            relay_hf.patch(model, min_prefix_length=8)
        procs.append(BanFirstPromptToken())
        outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                   logits_processor=[procs[-1]]))
    assert model.relay_last_decision.used
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(c, ids[:, 0]) for c in procs[1].first_columns)


def test_user_relay_cache_is_reused_not_mutated():
    model = relay_hf.patch(tiny_model("llama"), min_prefix_length=8)
    ids, mask, prefix = shared_prefix_batch(seed=5)
    cache = relay_hf.RelayCache.from_prefix(model, prefix)
    before = [(lay.prefix_keys.clone(), lay.suffix_length) for lay in cache.layers]
    auto = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    for _ in range(2):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, past_key_values=cache)
        assert torch.equal(out, auto)
        assert model.relay_last_decision.used and model.relay_last_decision.prefix_length == 40
    for lay, (k, n) in zip(cache.layers, before, strict=False):
        assert torch.equal(lay.prefix_keys, k) and lay.suffix_length == n == 0


def test_user_relay_cache_works_at_batch_one():
    model = tiny_model("mistral")
    ids, mask, prefix = shared_prefix_batch(seed=6, suffix_lens=(5,))
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    relay_hf.patch(model)
    cache = relay_hf.RelayCache.from_prefix(model, prefix)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, past_key_values=cache)
    assert model.relay_last_decision.used
    assert torch.equal(out, stock)


def test_batch_of_one_and_short_prefix_take_the_stock_path(caplog):
    model = relay_hf.patch(tiny_model("llama"), min_prefix_length=8)
    ids, mask, _ = shared_prefix_batch(suffix_lens=(4,))
    with caplog.at_level(logging.DEBUG, logger="relay_hf"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert not model.relay_last_decision.used and "single row" in model.relay_last_decision.reason
    assert any("stock generate" in r.message for r in caplog.records)
    ids, mask, _ = shared_prefix_batch(prefix_len=5)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert not model.relay_last_decision.used and "min_prefix_length" in model.relay_last_decision.reason


def test_unpatch_restores_stock():
    model = tiny_model("qwen3")
    original_attn = model.config._attn_implementation
    relay_hf.patch(model)
    assert model.config._attn_implementation == ATTN_NAME and relay_hf.is_patched(model)
    relay_hf.unpatch(model)
    assert model.config._attn_implementation == original_attn and not relay_hf.is_patched(model)
    assert "generate" not in model.__dict__ and not hasattr(model, "relay_last_decision")
    ids, mask, _ = shared_prefix_batch()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert type(output_cache(out)).__name__ == "DynamicCache"


def test_patched_forward_without_relay_cache_is_sdpa():
    model = tiny_model("phi3")
    ids, mask, _ = shared_prefix_batch()
    with torch.no_grad():
        stock = model(ids, attention_mask=mask).logits
        relay_hf.patch(model)
        patched = model(ids, attention_mask=mask).logits
    assert torch.equal(stock, patched)


def test_sliding_window_reaching_into_the_prefix_falls_back_with_a_warning(caplog):
    model = tiny_model("mistral", sliding_window=48)
    ids, mask, _ = shared_prefix_batch()
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    relay_hf.patch(model, min_prefix_length=8)
    with caplog.at_level(logging.WARNING, logger="relay_hf"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert any("sliding window" in r.getMessage() for r in caplog.records)
    assert not model.relay_last_decision.used
    assert torch.equal(out, stock)


def test_sliding_window_that_covers_everything_uses_relay():
    model = tiny_model("mistral", sliding_window=512)
    ids, mask, _ = shared_prefix_batch()
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    relay_hf.patch(model, min_prefix_length=8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert model.relay_last_decision.used and torch.equal(out, stock)


def test_softcapping_model_falls_back_at_patch_time():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
                          attn_implementation="eager")
    model = Gemma2ForCausalLM(config).eval()
    with pytest.warns(relay_hf.RelayFallbackWarning, match="softcapping"):
        relay_hf.patch(model)
    assert model.config._attn_implementation == "eager"
    ids, mask, _ = shared_prefix_batch()
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert not model.relay_last_decision.used and "softcapping" in model.relay_last_decision.reason


@pytest.mark.parametrize("cls,kwargs,reason", [
    ("GptOssConfig", dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_local_experts=2, num_experts_per_tok=1), "sinks"),
    ("FalconConfig", dict(hidden_size=64, num_attention_heads=4, alibi=True), "ALiBi"),
    ("BloomConfig", dict(hidden_size=64, n_head=4), "AttentionInterface"),
])
def test_sinks_alibi_and_foreign_attention_fall_back(cls, kwargs, reason):
    import transformers

    config = getattr(transformers, cls)(vocab_size=256, num_hidden_layers=2, pad_token_id=0, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    attn = model.config._attn_implementation
    with pytest.warns(relay_hf.RelayFallbackWarning, match=reason):
        relay_hf.patch(model)
    assert model.config._attn_implementation == attn
    ids, mask, _ = shared_prefix_batch()
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert not model.relay_last_decision.used and reason in model.relay_last_decision.reason


def test_bad_cache_raises_and_model_stays_usable():
    model = relay_hf.patch(tiny_model("llama"), min_prefix_length=8)
    ids, mask, prefix = shared_prefix_batch(seed=8)
    wrong = prefix.clone()
    wrong[7] = (wrong[7] + 1) % 250 + 3
    cache = relay_hf.RelayCache.from_prefix(model, wrong)
    with pytest.raises(ValueError, match="does not match the input: row 0 differs at prefix position 7"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=cache)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        relay_hf.RelayCache.from_prefix(model, torch.randint(3, 200, (1025,)))
    with pytest.raises(ValueError, match="integer token ids"):
        relay_hf.RelayCache.from_prefix(model, torch.rand(10))
    half = relay_hf.RelayCache.from_prefix(model, prefix)
    for lay in half.layers:
        lay.prefix_keys, lay.prefix_values = lay.prefix_keys.half(), lay.prefix_values.half()
    with pytest.raises(ValueError, match="dtype"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=half)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)  # still works
    assert model.relay_last_decision.used and out.shape == (4, ids.shape[1] + 2)


# -- static (compileable) RelayCache: cache_implementation="static" / compile_config ----------------------------------
def test_static_relay_cache_matches_stock_static(arch_model):
    ids, mask, _ = shared_prefix_batch(seed=5)
    stock, relay = stock_and_relay(arch_model, ids, mask, max_new_tokens=10, do_sample=False, output_logits=True,
                                   cache_implementation="static")
    decision = arch_model.relay_last_decision
    assert decision.used and decision.static and decision.prefix_length == 40
    for step, (a, b) in enumerate(zip(stock.logits, relay.logits, strict=True)):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), f"logits differ at step {step}"
    assert torch.equal(stock.sequences, relay.sequences)
    cache = output_cache(relay)
    assert cache.is_static and cache.is_compileable and int(cache.layers[0]._end) == relay.sequences.shape[1] - 41


@pytest.mark.parametrize("hf_loop", [True, False])
def test_static_cache_is_refilled_in_place_by_the_next_call(hf_loop):
    """Same shapes, new prompts: the same buffers and (relay_hf's loop) the same captured step, so compiled CUDA graphs
    replay; still the stock answer."""
    model = tiny_model("llama")
    batches = [shared_prefix_batch(seed=seed)[:2] for seed in (6, 7)]
    stocks = [model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False) for ids, mask in batches]
    relay_hf.patch(model, min_prefix_length=8)
    outs = []
    for (ids, mask), stock in zip(batches, stocks, strict=True):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             return_dict_in_generate=hf_loop, cache_implementation="static")
        assert torch.equal(stock, out.sequences if hf_loop else out)
        assert model.relay_last_decision.fast_decode != hf_loop
        slot = model._relay_state.idle_static()
        assert not hf_loop or output_cache(out) is slot.cache
        layer = slot.cache.layers[0]
        outs.append((slot.cache, layer._kbuf.data_ptr(), layer.prefix_keys.data_ptr(), slot.stepper))
    assert outs[0] == outs[1]
    assert (outs[0][3] is None) == hf_loop


def test_static_sampling_with_several_return_sequences_matches():
    model = tiny_model("qwen3")
    ids, mask, _ = shared_prefix_batch(seed=8, suffix_lens=(4, 2))
    stock, relay = stock_and_relay(model, ids, mask, seed=3, max_new_tokens=8, do_sample=True, num_return_sequences=3,
                                   cache_implementation="static")
    assert model.relay_last_decision.static and model.relay_last_decision.rows == 6
    assert torch.equal(stock.sequences, relay.sequences)


def test_stock_fallback_with_a_static_cache_runs_the_models_own_attention():
    """A call relay does not serve (one row) asking for transformers' static cache: exactly stock, and the model is
    back on relay attention afterwards."""
    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=10)
    ids, mask = ids[:1], mask[:1]
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static")
    relay_hf.patch(model, min_prefix_length=8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert not model.relay_last_decision.used
    assert torch.equal(stock, out)
    assert model.config._attn_implementation == "relay"
