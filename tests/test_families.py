"""Model families whose attention relay computes with options: Gemma 2 (logit softcapping, sliding layers), Gemma 3
(sliding and global layers), gpt-oss (attention sinks, sliding layers), Mistral and Qwen2 with sliding windows. Tiny
random fp32 models whose window (8 tokens) is far shorter than the shared prefix (40): greedy generation is stock's
token for token on transformers' loop and on relay_hf's loop."""

import pytest
import torch
import transformers

import relay_hf
from relay_hf._compat import cache_kwarg_name
from relay_hf.policy import model_reason
from relay_hf.state import relay_state
from tests.helpers import VOCAB, grouped_batch, run_stock, shared_prefix_batch

WINDOW = 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=1024)
FAMILIES = {
    # a cap near the tiny model's score scale, so that capping changes its tokens (checked below)
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=2, sliding_window=WINDOW, attn_logit_softcapping=0.01,
                                    attn_implementation="eager")),
    "gemma3_text": ("Gemma3TextConfig", dict(num_hidden_layers=3, sliding_window=WINDOW, attn_implementation="eager",
                                             layer_types=["sliding_attention", "sliding_attention",
                                                          "full_attention"])),
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=2, sliding_window=WINDOW, num_local_experts=2,
                                     num_experts_per_tok=1, attn_implementation="eager")),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW, attn_implementation="sdpa")),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=1, attn_implementation="sdpa")),
}


def _model(family: str):
    cls, kwargs = FAMILIES[family]
    config = getattr(transformers, cls)(**{**COMMON, **kwargs})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("decode", ["auto", "graph"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_relay_gives_stock_tokens_with_a_window_shorter_than_the_prefix(family, decode):
    model = _model(family)
    ids, mask, _ = shared_prefix_batch(seed=31)
    gen = dict(max_new_tokens=10, do_sample=False)
    stock = run_stock(model, ids, mask, **gen)
    relay_hf.patch(model, min_prefix_length=8, decode=decode)
    assert model_reason(model) is None, model_reason(model)  # patched, not declined, on relay attention
    out = model.generate(ids, attention_mask=mask, **gen)
    decision = model.relay_last_decision
    assert decision.used and decision.fast_decode == (decode == "graph"), decision
    assert torch.equal(out, stock)


@pytest.mark.parametrize("decode", ["auto", "graph"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_several_prompts_under_a_short_window_give_stock_tokens(family, decode):
    """Rows under three prompts (40, 24 and 16 tokens), a second level and a row with none: each row's window is
    applied at its own absolute positions, in every segment it reads."""
    model = _model(family)
    ids, mask, _, _ = grouped_batch(seed=33)
    gen = dict(max_new_tokens=8, do_sample=False)
    stock = run_stock(model, ids, mask, **gen)
    relay_hf.patch(model, min_prefix_length=8, decode=decode)
    out = model.generate(ids, attention_mask=mask, **gen)
    decision = model.relay_last_decision
    assert decision.used and len(decision.groups) == 4 and decision.fast_decode == (decode == "graph"), decision
    assert torch.equal(out, stock)


def test_sampling_with_sinks_and_a_window_on_relay_hf_loop():
    model = _model("gpt_oss")
    ids, mask, _ = shared_prefix_batch(seed=32)
    gen = dict(max_new_tokens=8, do_sample=True, top_k=20)
    stock, draw = run_stock(model, ids, mask, seed=3, **gen), torch.rand(3)
    relay_hf.patch(model, min_prefix_length=8, decode="graph")
    torch.manual_seed(3)
    out = model.generate(ids, attention_mask=mask, **gen)
    assert model.relay_last_decision.fast_decode and torch.equal(out, stock) and torch.equal(torch.rand(3), draw)


def test_the_options_change_what_stock_computes_here():
    """Relay ignoring an option would show: stock's logits depend on each one at these sizes (the patch-time probe
    compares logits, and the cases above assert it accepted the model)."""
    ids, mask, _ = shared_prefix_batch(seed=31)
    for family, attr, value in (("gemma2", "attn_logit_softcapping", None), ("mistral", "sliding_window", None),
                                ("gpt_oss", "sinks", -1e4)):
        model, plain = _model(family), _model(family)
        for layer in plain.model.layers:
            if attr == "sinks":
                layer.self_attn.sinks.data.fill_(value)
            else:
                setattr(layer.self_attn, attr, value)
                setattr(plain.config, attr, value)
        with torch.no_grad():
            a = model(ids, attention_mask=mask).logits[:, -1]
            b = plain(ids, attention_mask=mask).logits[:, -1]
        assert (a - b).abs().max() > 1e-3 * a.abs().max(), family


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_runs_relay_in_the_kernels_on_the_captured_loop_on_gpu(family):
    """fp32 on CUDA: the softcap, the sinks and the windows run in the Triton kernels (no call falls back to stock
    attention), one prompt and several, and greedy tokens are stock's."""
    model = _model(family).cuda()
    for ids, mask in (shared_prefix_batch(seed=34)[:2], grouped_batch(seed=35)[:2]):
        ids, mask = ids.cuda(), mask.cuda()
        gen = dict(max_new_tokens=24, do_sample=False)
        stock = run_stock(model, ids, mask, **gen)
        relay_hf.patch(model, min_prefix_length=8)
        out = model.generate(ids, attention_mask=mask, **gen)
        decision = model.relay_last_decision
        assert decision.used and decision.fast_decode, decision
        assert torch.equal(out, stock)
        step = relay_state(model).idle_static().stepper
        assert step.graph is not None, f"{family}: the decode step ran uncaptured ({step.state})"


def test_sliding_layers_store_what_a_window_can_see_and_global_layers_all():
    """Gemma 3 (sliding, sliding, global): each sliding layer keeps of every prefix only its last window - 1
    tokens; Mistral passes its window from the config at call time, so its layers keep the whole prefix (exact
    either way: the kernels apply the window)."""
    ids, mask, systems, block = grouped_batch(seed=36, none=0)
    model = _model("gemma3_text")
    relay_hf.patch(model, min_prefix_length=8)
    cache = relay_hf.RelayCache.from_prefixes(model, [systems[0], torch.cat([systems[0], block]), *systems[1:]])
    stored = [lay.prefix_keys.shape[2] for lay in cache.layers]
    assert stored == [4 * (WINDOW - 1), 4 * (WINDOW - 1), 40 + 12 + 24 + 16]
    assert [lay.window for lay in cache.layers] == [WINDOW, WINDOW, None]
    stock = run_stock(model, ids, mask, max_new_tokens=8, do_sample=False)
    relay_hf.patch(model, min_prefix_length=8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert torch.equal(out, stock)
    mistral = relay_hf.RelayCache.from_prefix(_model("mistral"), systems[0])
    assert all(lay.window is None and lay.prefix_keys.shape[2] == 40 for lay in mistral.layers)


def test_a_trimmed_layer_refuses_a_window_that_changed_since_the_cache_was_built():
    ids, mask, prefix = shared_prefix_batch(seed=37)
    model = relay_hf.patch(_model("qwen2"), min_prefix_length=8)
    cache = relay_hf.RelayCache.from_prefix(model, prefix)
    assert cache.layers[0].window is None and cache.layers[1].window == WINDOW  # from max_window_layers=1 on
    model.model.layers[1].self_attn.sliding_window = 4 * WINDOW
    with pytest.raises(ValueError, match="sliding window of 8 tokens"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=cache)
    model.model.layers[1].self_attn.sliding_window = WINDOW
    out = model.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=cache)
    assert out.shape[1] == ids.shape[1] + 2


def test_caches_of_one_model_combine_whatever_their_layers_trimmed():
    """A prompt longer than the window is trimmed in the sliding layers and a short one is not: packed together
    (as the pipeline does for a batch under both), the short one is trimmed on the way, and tokens are stock's."""
    model = relay_hf.patch(_model("gemma2"), min_prefix_length=4)
    g = torch.Generator().manual_seed(38)
    long, short = torch.randint(3, VOCAB, (30,), generator=g), torch.randint(3, VOCAB, (5,), generator=g)
    a, b = relay_hf.RelayCache.from_prefix(model, long), relay_hf.RelayCache.from_prefix(model, short)
    assert a.layers[0].window == WINDOW and b.layers[0].window is None
    both = relay_hf.RelayCache.combine([a, b])
    assert both.layers[0].prefix_keys.shape[2] == WINDOW - 1 + 5 and both.layers[0].window == WINDOW
    rows = [torch.cat([long, torch.randint(3, VOCAB, (n,), generator=g)]) for n in (2, 4)]
    rows += [torch.cat([short, torch.randint(3, VOCAB, (n,), generator=g)]) for n in (3, 1)]
    from tests.helpers import left_pad

    ids, mask = left_pad(rows)
    stock = run_stock(model, ids, mask, max_new_tokens=6, do_sample=False)
    relay_hf.patch(model, min_prefix_length=4)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, past_key_values=both)
    assert model.relay_last_decision.used and torch.equal(out, stock)


@pytest.mark.gpu
def test_a_static_slot_replayed_for_longer_prompts_keeps_the_window_on_gpu():
    """A captured step first recorded for prompts short enough that no key falls out of the window, then replayed
    for a longer prompt: the window must be in the recorded launches (a static cache always passes it)."""
    config = transformers.MistralConfig(**{**COMMON, "sliding_window": 320, "num_hidden_layers": 2})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().cuda()
    model.generation_config.pad_token_id = 0
    from tests.helpers import left_pad

    g = torch.Generator().manual_seed(39)
    rand = lambda n: torch.randint(3, VOCAB, (n,), generator=g)  # noqa: E731
    short = [rand(60) for _ in range(4)]
    first = left_pad([torch.cat([p, rand(5)]) for p in short for _ in range(2)])
    long_a, long_b = rand(200), rand(40)
    second = left_pad([torch.cat([p, rand(5)]) for p in (long_a, long_b) for _ in range(4)])
    gen = dict(max_new_tokens=150, do_sample=False)
    stock = [run_stock(model, ids.cuda(), mask.cuda(), **gen) for ids, mask in (first, second)]
    relay_hf.patch(model, min_prefix_length=8)
    for (ids, mask), expected in zip((first, second), stock):
        out = model.generate(ids.cuda(), attention_mask=mask.cuda(), **gen)
        assert model.relay_last_decision.fast_decode and torch.equal(out, expected)


# -- calls that run stock on a patched model, past the window -------------------------------------------------------
def _rows_past_the_window(B: int, shared: int = 0, seed: int = 7):
    """``B`` unpadded rows of ``2.5 * WINDOW`` tokens (the first ``shared`` common to all), so every layer's window
    fills during prefill and keeps sliding while decoding."""
    g = torch.Generator().manual_seed(seed)
    T = int(2.5 * WINDOW)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    ids[:, :shared] = ids[0, :shared]
    return ids, torch.ones_like(ids)


def _dynamic(model):
    return {cache_kwarg_name(model): transformers.DynamicCache(config=model.config)}


# each road runs stock generate on the patched model; the windows of stock's caches report offsets past the window
STOCK_ROADS = {
    "one row": (1, {}),
    "rows that share nothing": (2, {}),
    "no_repeat_ngram_size": (2, dict(no_repeat_ngram_size=2)),
    "repetition_penalty off the loop": (2, dict(repetition_penalty=1.3)),
    "training mode": (2, "train"),
    "a user DynamicCache": (2, _dynamic),
    "cache_implementation dynamic": (2, dict(cache_implementation="dynamic")),
    "cache_implementation sliding_window": (2, dict(cache_implementation="sliding_window")),
}


@pytest.mark.parametrize("road", STOCK_ROADS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_calls_that_run_stock_past_the_window_give_stock_tokens(family, road):
    rows, extra = STOCK_ROADS[road]
    model = _model(family)
    ids, mask = _rows_past_the_window(rows, shared=WINDOW if road == "repetition_penalty off the loop" else 0)
    gen = dict(max_new_tokens=4, do_sample=False)  # the prompt alone is past the window

    def call():
        torch.manual_seed(0)
        kwargs = extra(model) if callable(extra) else {} if extra == "train" else extra
        return model.generate(ids, attention_mask=mask, **gen, **kwargs)

    if extra == "train":
        model.train()
    stock = call()
    relay_hf.patch(model, min_prefix_length=WINDOW)
    out = call()
    assert not model.relay_last_decision.used, model.relay_last_decision
    assert torch.equal(out, stock)
