"""The patched generate never answers differently from stock: fallbacks with a user's RelayCache, processors that read
ids, declined models, concurrent calls, the registered name without patch, foreign caches, config resolution,
pickling and the other edges of the reliability list."""

import io
import logging
import pickle
import threading

import pytest
import torch
from transformers import GenerationConfig

import relay_hf
from relay_hf import RelayCache
from relay_hf._compat import cache_kwarg_name, output_cache
from relay_hf.state import relay_state
from tests.helpers import (
    VOCAB,
    grouped_batch,
    run_relay,
    run_stock,
    shared_prefix_batch,
    stock_and_relay,
    tiny_model,
)


def _cache_state(cache: RelayCache):
    lay = cache.layers[0]
    return lay.suffix_length, lay.prefix_keys.clone(), cache.prefix_length


def _seq(out):
    return out if isinstance(out, torch.Tensor) else out.sequences


@pytest.mark.parametrize("feature", [dict(no_repeat_ngram_size=2), dict(bad_words_ids=[[5, 6]]),
                                     dict(sequence_bias={(7,): -2.0}), dict(use_cache=False),
                                     dict(repetition_penalty=1.5)])
def test_a_fallback_never_sees_the_users_relay_cache(feature):
    model = tiny_model("llama")
    ids, mask, prefix = shared_prefix_batch(seed=21)
    stock = run_stock(model, ids, mask, max_new_tokens=6, do_sample=False, **feature)
    relay_hf.patch(model, min_prefix_length=8)
    cache = RelayCache.from_prefix(model, prefix)
    before = _cache_state(cache)
    for _ in range(2):  # and the cache stays usable
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, past_key_values=cache,
                             **feature)
        assert not model.relay_last_decision.used
        assert torch.equal(_seq(out), stock)
    after = _cache_state(cache)
    assert after[0] == before[0] == 0 and torch.equal(after[1], before[1]) and after[2] == before[2]
    relay = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, past_key_values=cache)
    assert model.relay_last_decision.used and relay.shape[0] == ids.shape[0]


def test_repetition_penalty_scores_equal_stock():
    """transformers >= 5.24 skips each row's leading pads when penalising; the relay layout moves them, so the call
    runs stock (and its scores are stock's)."""
    model = tiny_model("qwen2")
    ids, mask, _ = shared_prefix_batch(seed=22)
    kw = dict(max_new_tokens=5, do_sample=False, repetition_penalty=1.7, output_scores=True,
              return_dict_in_generate=True)
    stock, relay = run_stock(model, ids, mask, **kw), run_relay(model, ids, mask, **kw)
    assert "repetition_penalty" in model.relay_last_decision.reason
    assert torch.equal(stock.sequences, relay.sequences)
    assert all(torch.equal(a, b) for a, b in zip(stock.scores, relay.scores, strict=True))


def test_a_declined_model_given_a_relay_cache_runs_stock_and_keeps_its_attention():
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                          pad_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = FalconForCausalLM(config).eval()
    ids, mask, prefix = shared_prefix_batch(seed=23)
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with pytest.warns(relay_hf.RelayFallbackWarning, match="ALiBi"):
        relay_hf.patch(model)
    cache = RelayCache.from_prefix(model, prefix)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, past_key_values=cache)
    assert torch.equal(out, stock) and model.config._attn_implementation == "eager"
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), stock)


@pytest.mark.parametrize("static", [False, True])
def test_concurrent_calls_equal_stock(static):
    """Threads share one patched model: relay calls (dynamic or static cache) and fallbacks interleave; every answer
    is the stock one."""
    model = tiny_model("llama")
    batches = [shared_prefix_batch(seed=s, suffix_lens=lens)[:2] for s, lens in ((31, (3, 9, 1, 6)), (32, (2, 5)))]
    extra = dict(cache_implementation="static") if static else {}
    calls = [(b, f) for b in range(2) for f in ({}, dict(no_repeat_ngram_size=3))]
    expected = {(b, tuple(f)): model.generate(batches[b][0], attention_mask=batches[b][1], max_new_tokens=6,
                                              do_sample=False, **extra, **f) for b, f in calls}
    relay_hf.patch(model, min_prefix_length=8)
    errors, wrong = [], []

    def work(worker):
        try:
            for i in range(6):
                b, f = calls[(worker + i) % len(calls)]
                ids, mask = batches[b]
                out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **extra, **f)
                if not torch.equal(out, expected[(b, tuple(f))]):
                    wrong.append((worker, i))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong
    assert model.config._attn_implementation == "relay"


def test_registered_name_without_patch_is_exact_or_refuses():
    model = tiny_model("llama")
    ids, mask, prefix = shared_prefix_batch(seed=24, suffix_lens=(4, 4, 4))  # equal lengths: no padding
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    padded_ids, padded_mask, padded_prefix = shared_prefix_batch(seed=24)
    padded_stock = model.generate(padded_ids, attention_mask=padded_mask, max_new_tokens=5, do_sample=False)
    model.set_attn_implementation("relay")
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                             past_key_values=RelayCache.from_prefix(model, prefix))
        assert torch.equal(out, stock)
        with pytest.raises(ValueError, match="padded in front"):
            model.generate(padded_ids, attention_mask=padded_mask, max_new_tokens=5, do_sample=False,
                           past_key_values=RelayCache.from_prefix(model, padded_prefix))
        assert torch.equal(model.generate(padded_ids, attention_mask=padded_mask, max_new_tokens=5,
                                          do_sample=False), padded_stock)  # no RelayCache: the model's own attention
    finally:
        model.set_attn_implementation("sdpa")


def test_a_cache_built_on_another_model_is_refused():
    a, b = relay_hf.patch(tiny_model("llama", seed=0)), relay_hf.patch(tiny_model("llama", seed=1))
    ids, mask, prefix = shared_prefix_batch(seed=25)
    with pytest.raises(ValueError, match="another model"):
        b.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=RelayCache.from_prefix(a, prefix))
    assert "another model" in b.relay_last_decision.reason and not b.relay_last_decision.used


@pytest.mark.parametrize("how", ["nothing", "bare_config", "model_sampling_defaults", "max_length", "static"])
def test_generation_config_is_resolved_as_stock_resolves_it(how):
    model = tiny_model("qwen3")
    ids, mask, _ = shared_prefix_batch(seed=26)
    kw = {}
    if how == "bare_config":
        kw = dict(generation_config=GenerationConfig(do_sample=False))
    elif how == "model_sampling_defaults":
        model.generation_config.do_sample, model.generation_config.top_k = True, 7
    elif how == "max_length":
        kw = dict(max_length=ids.shape[1] + 3)
    elif how == "static":  # relay_hf's own loop on a static cache, no length given either
        kw = dict(cache_implementation="static")
    stock, relay = run_stock(model, ids, mask, seed=4, **kw), run_relay(model, ids, mask, seed=4, **kw)
    assert model.relay_last_decision.used
    assert torch.equal(stock, relay)
    assert model.relay_last_decision.fast_decode == (how == "static")
    if how in ("nothing", "bare_config", "static"):
        assert relay.shape[1] == ids.shape[1] + 20  # stock's default: 20 new tokens


def test_a_pickled_or_saved_patched_model_comes_back_patched():
    model = relay_hf.patch(tiny_model("phi3"), min_prefix_length=8)
    ids, mask, _ = shared_prefix_batch(seed=27)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)):
        assert relay_hf.is_patched(twin) and twin.generate.__self__ is twin
        assert torch.equal(twin.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), out)
        assert twin.relay_last_decision.used


def test_edges_of_the_prefix_and_the_decision():
    model = relay_hf.patch(tiny_model("llama"), min_prefix_length=0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 6), generator=g)
    ids[:, 0] = torch.tensor([5, 6, 7])  # no common prefix at all
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (3, 9) and "common prefix of 0 tokens" in model.relay_last_decision.reason
    with pytest.raises(ValueError):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                       past_key_values=RelayCache(model.config))
    assert model.relay_last_decision.reason.startswith("invalid input")
    with pytest.raises(ValueError, match="min_prefix_length"):
        relay_hf.patch(tiny_model("llama"), min_prefix_length=-1)


def test_a_prefix_beyond_max_position_embeddings_runs_stock():
    model = tiny_model("llama", max_position_embeddings=48)
    ids, mask, _ = shared_prefix_batch(prefix_len=50, suffix_lens=(2, 3))
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    relay_hf.patch(model, min_prefix_length=8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, stock) and "max_position_embeddings" in model.relay_last_decision.reason


def test_an_attention_implementation_set_after_patch_is_respected():
    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=28)
    relay_hf.patch(model, min_prefix_length=8)
    model.set_attn_implementation("eager")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert model.config._attn_implementation == "eager" and "eager" in model.relay_last_decision.reason
    relay_hf.unpatch(model)
    assert model.config._attn_implementation == "eager"
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))


# -- every built-in logits processor and stopping criterion --------------------------------------------------------
def _processor_factories(T: int, B: int):
    """name -> a way to build each built-in processor for a tiny model (vocab VOCAB, eos 2, prompt length T)."""
    import transformers.generation.logits_process as lp

    enc = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(5))
    return {
        "AlternatingCodebooksLogitsProcessor": lambda: lp.AlternatingCodebooksLogitsProcessor(T, 100, 64),
        "BarkEosPrioritizerLogitsProcessor": lambda: lp.BarkEosPrioritizerLogitsProcessor(2, 0.01),
        "ClassifierFreeGuidanceLogitsProcessor": None,  # needs the batch doubled with unconditional rows
        "DiaClassifierFreeGuidanceLogitsProcessor": None,  # Dia's doubled-batch audio layout
        "DiaEOSChannelFilterLogitsProcessor": None,  # Dia's channel-interleaved audio vocabulary
        "DiaEOSDelayPatternLogitsProcessor": None,  # Dia's channel-interleaved audio vocabulary
        "EncoderNoRepeatNGramLogitsProcessor": lambda: lp.EncoderNoRepeatNGramLogitsProcessor(2, enc),
        "EncoderRepetitionPenaltyLogitsProcessor": lambda: lp.EncoderRepetitionPenaltyLogitsProcessor(1.4, enc),
        "EpsilonLogitsWarper": lambda: lp.EpsilonLogitsWarper(0.01),
        "EtaLogitsWarper": lambda: lp.EtaLogitsWarper(0.01),
        "ExponentialDecayLengthPenalty": lambda: lp.ExponentialDecayLengthPenalty((2, 1.5), 2, T),
        "ForcedBOSTokenLogitsProcessor": lambda: lp.ForcedBOSTokenLogitsProcessor(1),
        "ForcedEOSTokenLogitsProcessor": lambda: lp.ForcedEOSTokenLogitsProcessor(T + 4, 2),
        "InfNanRemoveLogitsProcessor": lambda: lp.InfNanRemoveLogitsProcessor(),
        "LogitNormalization": lambda: lp.LogitNormalization(),
        "MinLengthLogitsProcessor": lambda: lp.MinLengthLogitsProcessor(T + 3, 2),
        "MinNewTokensLengthLogitsProcessor": lambda: lp.MinNewTokensLengthLogitsProcessor(T, 3, 2),
        "MinPLogitsWarper": lambda: lp.MinPLogitsWarper(0.05),
        "NoBadWordsLogitsProcessor": lambda: lp.NoBadWordsLogitsProcessor([[5], [9, 11]], 2),
        "NoRepeatNGramLogitsProcessor": lambda: lp.NoRepeatNGramLogitsProcessor(2),
        "PrefixConstrainedLogitsProcessor": lambda: lp.PrefixConstrainedLogitsProcessor(
            lambda b, ids: [int(ids[-1]) % 50 + 3, int(ids[0]) % 50 + 60], 1),
        "RepetitionPenaltyLogitsProcessor": lambda: lp.RepetitionPenaltyLogitsProcessor(1.8),
        "SequenceBiasLogitsProcessor": lambda: lp.SequenceBiasLogitsProcessor([[[7], 3.0], [[9, 11], -4.0]]),
        "SuppressTokensAtBeginLogitsProcessor": lambda: lp.SuppressTokensAtBeginLogitsProcessor([5, 6], T),
        "SuppressTokensLogitsProcessor": lambda: lp.SuppressTokensLogitsProcessor([5, 6]),
        "SynthIDTextWatermarkLogitsProcessor": lambda: lp.SynthIDTextWatermarkLogitsProcessor(
            3, [11, 23, 37], 64, 7, 16, torch.device("cpu")),
        "TemperatureLogitsWarper": lambda: lp.TemperatureLogitsWarper(0.7),
        "TopHLogitsWarper": lambda: lp.TopHLogitsWarper(0.5),
        "TopKLogitsWarper": lambda: lp.TopKLogitsWarper(5),
        "TopPLogitsWarper": lambda: lp.TopPLogitsWarper(0.8),
        "TypicalLogitsWarper": lambda: lp.TypicalLogitsWarper(0.9),
        "UnbatchedClassifierFreeGuidanceLogitsProcessor": "model",
        "WatermarkLogitsProcessor": lambda: lp.WatermarkLogitsProcessor(VOCAB, "cpu", context_width=4),
        "WhisperNoSpeechDetection": None,  # reads Whisper's no-speech token at the decoder's start
        "WhisperTimeStampLogitsProcessor": None,  # needs Whisper's timestamp generation config
    }


def _builtin(module, base) -> list[str]:
    import inspect

    return sorted(n for n, c in vars(module).items() if inspect.isclass(c) and issubclass(c, base) and c is not base
                  and c.__module__ == module.__name__)


def test_every_builtin_logits_processor_given_by_the_user_sees_what_stock_shows_it():
    import transformers.generation.logits_process as lp

    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=29)
    table = _processor_factories(ids.shape[1], ids.shape[0])
    assert _builtin(lp, lp.LogitsProcessor) == sorted(table), "a processor class without a case here"
    for name, make in table.items():
        if make is None:
            continue

        def build(make=make, own=False, name=name):
            p = lp.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, model) if make == "model" else make()
            if own:  # the same processor as a user's own class: relay serves it, showing it the stock layout
                p.__class__ = type("User" + name, (type(p),), {"__module__": __name__})
            return [p]

        kw = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
        for own in (False, True):
            stock = run_stock(model, ids, mask, logits_processor=build(own=own), **kw)
            relay = run_relay(model, ids, mask, logits_processor=build(own=own), **kw)
            assert model.relay_last_decision.used == own, (name, model.relay_last_decision.reason)
            assert torch.equal(stock.sequences, relay.sequences), name
            for a, b in zip(stock.scores, relay.scores, strict=True):
                assert torch.allclose(a, b, atol=1e-5, rtol=1e-5, equal_nan=True), name


def test_every_builtin_stopping_criterion_sees_what_stock_shows_it(smollm2):
    import transformers.generation.stopping_criteria as sc

    model = tiny_model("mistral")
    ids, mask, _ = shared_prefix_batch(seed=30, suffix_lens=(1, 6, 2))
    tokenizer = smollm2[1]
    probe = run_stock(model, ids, mask, max_new_tokens=6, do_sample=False)
    word = tokenizer.convert_ids_to_tokens(int(probe[1, ids.shape[1] + 2]))
    last_prompt = tokenizer.convert_ids_to_tokens(int(ids[0, -1]))
    table = {
        "ConfidenceCriteria": None,  # reads an assistant model's confidence (speculative decoding)
        "EosTokenCriteria": lambda: sc.EosTokenCriteria(int(probe[0, ids.shape[1] + 1])),
        "MaxLengthCriteria": lambda: sc.MaxLengthCriteria(ids.shape[1] + 3),
        "MaxTimeCriteria": lambda: sc.MaxTimeCriteria(60.0),
        # one stop string inside the generated tokens, one that spans the end of row 0's prompt (a 1-token suffix)
        "StopStringCriteria": lambda: sc.StopStringCriteria(tokenizer, [word, last_prompt + "w7"]),
    }
    assert _builtin(sc, sc.StoppingCriteria) == sorted(table), "a criterion class without a case here"
    for name, make in table.items():
        if make is None:
            continue
        for own in (False, True):
            def build(make=make, own=own, name=name):
                c = make()
                if own:  # the same criterion as a user's own class: relay serves it on the stock view
                    c.__class__ = type("User" + name, (type(c),), {"__module__": __name__})
                return [c]

            stock = run_stock(model, ids, mask, max_new_tokens=6, do_sample=False, stopping_criteria=build())
            relay = run_relay(model, ids, mask, max_new_tokens=6, do_sample=False, stopping_criteria=build())
            assert model.relay_last_decision.used == own and torch.equal(stock, relay), name
    for stop in ([word], [last_prompt + "w7"]):  # the same through generation_config.stop_strings
        stock = run_stock(model, ids, mask, max_new_tokens=6, do_sample=False, stop_strings=stop, tokenizer=tokenizer)
        relay = run_relay(model, ids, mask, max_new_tokens=6, do_sample=False, stop_strings=stop, tokenizer=tokenizer)
        assert model.relay_last_decision.used and torch.equal(stock, relay)


@pytest.mark.parametrize("fields", [
    dict(repetition_penalty=1.6), dict(encoder_repetition_penalty=1.4), dict(no_repeat_ngram_size=2),
    dict(encoder_no_repeat_ngram_size=2), dict(bad_words_ids=[[5], [9, 11]]), dict(sequence_bias={(7,): 3.0}),
    dict(min_length=30), dict(min_new_tokens=3), dict(forced_bos_token_id=1), dict(forced_eos_token_id=2),
    dict(exponential_decay_length_penalty=(2, 1.5)), dict(suppress_tokens=[5, 6]), dict(begin_suppress_tokens=[5]),
    dict(renormalize_logits=True), dict(remove_invalid_values=True), dict(max_time=60.0),
    dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9), dict(do_sample=True, min_p=0.05),
    dict(do_sample=True, typical_p=0.9), dict(do_sample=True, epsilon_cutoff=0.01), dict(do_sample=True,
                                                                                         eta_cutoff=0.01),
    dict(watermarking_config=dict(greenlist_ratio=0.3)), dict(guidance_scale=1.5),
], ids=lambda f: ",".join(f))
def test_every_generation_config_processor_equals_stock(fields):
    model = tiny_model("qwen2")
    ids, mask, _ = shared_prefix_batch(seed=33)
    kw = dict(max_new_tokens=5, output_scores=True, return_dict_in_generate=True, **fields)
    stock, relay = run_stock(model, ids, mask, seed=9, **kw), run_relay(model, ids, mask, seed=9, **kw)
    decision = model.relay_last_decision
    assert decision.used or decision.reason
    assert torch.equal(stock.sequences, relay.sequences)
    for a, b in zip(stock.scores, relay.scores, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)


# -- the relay path on five architectures ----------------------------------------------------------------------
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
    """The relay path really goes through relay attention (``kernels.attend``) with one un-expanded prefix copy."""
    import relay_hf.attention as seam

    seen = []
    real = seam.attend

    def spy(step, options, query, prefix_key, *args):
        seen.append((query.shape[0], prefix_key.shape[0], prefix_key.shape[2]))
        return real(step, options, query, prefix_key, *args)

    monkeypatch.setattr(seam, "attend", spy)
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


@pytest.mark.parametrize("window", [12, 512], ids=["reaching_into_the_prefix", "covering_everything"])
def test_a_sliding_window_model_uses_relay(window):
    """A window shorter than the shared prefix is applied by relay attention itself; a longer one changes nothing."""
    model = tiny_model("mistral", sliding_window=window)
    ids, mask, _ = shared_prefix_batch()
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    relay_hf.patch(model, min_prefix_length=8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert model.relay_last_decision.used and torch.equal(out, stock)


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
    assert cache.is_static and cache.is_compileable and int(cache.layers[0].end) == relay.sequences.shape[1] - 41


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
        # max_time runs on transformers' loop; the cache stays the pool's as long as the output does not hand it over
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             max_time=600.0 if hf_loop else None, cache_implementation="static")
        assert torch.equal(stock, out)
        assert model.relay_last_decision.fast_decode != hf_loop
        slot = relay_state(model).idle_static()
        layer = slot.cache.layers[0]
        outs.append((slot.cache, layer.keys.data_ptr(), layer.prefix_keys.data_ptr(), slot.stepper))
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


# -- found by an adversarial sweep ----------------------------------------------------------------------------------
def test_a_model_whose_generation_config_asks_for_a_static_cache():
    model = tiny_model("llama")
    model.generation_config.cache_implementation = "static"
    ids, mask, _ = shared_prefix_batch(seed=34)
    for kw in (dict(do_sample=True), dict(return_dict_in_generate=True, output_scores=True), dict(num_beams=2)):
        stock, relay = run_stock(model, ids, mask, seed=2, max_new_tokens=5, **kw), run_relay(
            model, ids, mask, seed=2, max_new_tokens=5, **kw)
        assert torch.equal(_seq(stock), _seq(relay)), kw


@pytest.mark.parametrize("arch,window", [("mistral", dict(sliding_window=60)),
                                         ("qwen2", dict(use_sliding_window=True, sliding_window=52))])
def test_a_static_cache_within_a_sliding_window(arch, window):
    model = tiny_model(arch, **window)
    ids, mask, _ = shared_prefix_batch(seed=35)
    kw = dict(max_new_tokens=3, do_sample=False, cache_implementation="static")
    stock, relay = run_stock(model, ids, mask, **kw), run_relay(model, ids, mask, **kw)
    assert model.relay_last_decision.used and torch.equal(stock, relay)


def test_a_model_in_training_mode_runs_stock():
    model = tiny_model("phi3", resid_pdrop=0.3, embd_pdrop=0.3).train()
    ids, mask, _ = shared_prefix_batch(seed=36)
    stock, relay = run_stock(model, ids, mask, seed=3, max_new_tokens=4), run_relay(model, ids, mask, seed=3,
                                                                                  max_new_tokens=4)
    assert "training mode" in model.relay_last_decision.reason and torch.equal(stock, relay)


def test_a_copied_eager_model_keeps_its_own_attention():
    import copy

    model = tiny_model("llama", attn_implementation="eager")
    ids, mask, _ = shared_prefix_batch(seed=37)
    kw = dict(max_new_tokens=2, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    stock = model.generate(ids, attention_mask=mask, **kw)
    twin = copy.deepcopy(relay_hf.patch(model, min_prefix_length=8))
    assert twin.config._attn_implementation == "relay_eager"
    out = twin.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(out.sequences, stock.sequences) and len(out.attentions) == len(stock.attentions)
    assert all(torch.equal(a, b) for a, b in zip(out.attentions[0], stock.attentions[0], strict=True))
    relay_hf.unpatch(twin)
    assert twin.config._attn_implementation == "eager"


def test_a_compiled_wrapper_is_refused_by_name():
    with pytest.raises(ValueError, match="torch.compile wrapper"):
        relay_hf.patch(torch.compile(tiny_model("llama")))


# -- several system prompts in one batch ----------------------------------------------------------------------------
def test_several_system_prompts_a_second_level_and_rows_with_none_give_stock_tokens(arch_model):
    ids, mask, systems, block = grouped_batch(seed=40)
    gen = dict(max_new_tokens=6, do_sample=False, output_scores=True)
    stock, relay = stock_and_relay(arch_model, ids, mask, **gen)
    decision = arch_model.relay_last_decision
    assert decision.used and decision.prefix_length == 52
    # (level, rows, tokens) per shared segment: three prompts, the block under the first, the row with none reads none
    assert sorted(decision.groups) == sorted([(0, 3, 40), (0, 2, 24), (0, 2, 16), (1, 2, 12)])
    assert torch.equal(stock.sequences, relay.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(stock.scores, relay.scores, strict=True))
    cache = output_cache(relay)
    assert cache.groups is not None and cache.groups.depth == 2
    assert cache.layers[0].prefix_keys.shape[2] == 40 + 24 + 16 + 12  # every segment stored once


@pytest.mark.parametrize("gen", [dict(num_beams=2, num_return_sequences=2), dict(do_sample=True, top_k=8),
                                 dict(do_sample=True, num_return_sequences=2), dict(max_length=60, min_length=50),
                                 dict(min_new_tokens=4, max_new_tokens=5)],
                         ids=["beams", "sampling", "return_sequences", "max_and_min_length", "min_new_tokens"])
def test_groups_with_beams_sampling_and_total_lengths_give_stock_tokens(gen):
    """Rows of several prefix lengths lay out in more columns than the stock prompt: a total ``max_length`` /
    ``min_length`` still means what it means to stock; beams reorder the rows' groups with their suffixes."""
    model = tiny_model("qwen2")
    ids, mask, _, _ = grouped_batch(seed=41)
    stock, relay = run_stock(model, ids, mask, seed=5, **gen), run_relay(model, ids, mask, seed=5, **gen)
    assert model.relay_last_decision.used and len(model.relay_last_decision.groups) == 4
    assert torch.equal(stock, relay)


def test_user_processor_streamer_and_criteria_see_stock_layout_with_groups():
    from transformers import LogitsProcessor, StoppingCriteria

    seen = {"stock": [], "relay": []}
    streamed = {"stock": [], "relay": []}

    class Watch(LogitsProcessor):
        def __init__(self, key):
            self.key = key

        def __call__(self, input_ids, scores):
            seen[self.key].append(input_ids.clone())
            return scores

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    class Streamer:
        def __init__(self, key):
            self.key = key

        def put(self, value):
            streamed[self.key].append(value.clone())

        def end(self):
            pass

    model = tiny_model("llama")
    ids, mask, _, _ = grouped_batch(seed=42)
    for key, run in (("stock", run_stock), ("relay", run_relay)):
        run(model, ids, mask, max_new_tokens=4, do_sample=False, logits_processor=[Watch(key)],
            stopping_criteria=[Never()], streamer=Streamer(key))
    assert model.relay_last_decision.used
    assert len(seen["relay"]) == 4 and all(torch.equal(a, b) for a, b in zip(seen["stock"], seen["relay"]))
    assert all(torch.equal(a, b) for a, b in zip(streamed["stock"], streamed["relay"], strict=True))


def test_a_cache_of_several_prefixes_serves_each_row_its_longest_and_refuses_a_row_with_none():
    model = tiny_model("phi3")
    ids, mask, systems, block = grouped_batch(seed=43, none=0)
    stock = run_stock(model, ids, mask, max_new_tokens=5, do_sample=False)
    relay_hf.patch(model, min_prefix_length=8)
    cache = RelayCache.from_prefixes(model, [systems[0], torch.cat([systems[0], block]), systems[1], systems[2]])
    assert cache.tree.parents == (-1, 0, -1, -1) and cache.prefix_ids is None
    assert cache.layers[0].prefix_keys.shape[2] == 40 + 12 + 24 + 16
    before = cache.layers[0].prefix_keys.clone()
    for _ in range(2):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, past_key_values=cache)
        assert torch.equal(out, stock) and model.relay_last_decision.used
    assert torch.equal(cache.layers[0].prefix_keys, before) and cache.layers[0].suffix_length == 0
    with_none, none_mask, _, _ = grouped_batch(seed=43, none=1)
    with pytest.raises(ValueError, match="starts with none of the RelayCache's 4 prefixes"):
        model.generate(with_none, attention_mask=none_mask, max_new_tokens=5, past_key_values=cache)
    assert model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False).shape == stock.shape
    combined = RelayCache.combine([RelayCache.from_prefix(model, s) for s in systems])
    assert combined.tree.lengths == (40, 24, 16)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, past_key_values=combined)
    assert torch.equal(out, stock)


def test_an_unpatched_model_reads_a_fork_of_several_prefixes_exactly():
    """A fork whose rows read different prefixes, handed to a model's plain forward without relay attention, gives
    each row its own prefix (gathered), so stock attention computes the same logits."""
    model = tiny_model("llama")
    ids, mask, systems, block = grouped_batch(seed=44, none=0)
    relay_hf.patch(model, min_prefix_length=8)
    cache = RelayCache.from_prefixes(model, [systems[0], torch.cat([systems[0], block]), systems[1], systems[2]])
    relay_hf.unpatch(model)
    from relay_hf.prefix import left_padding, relay_layout

    n_pad = left_padding(mask)
    paths = cache.tree.match(ids, n_pad)
    lengths = [sum(cache.tree.lengths[j] for j in p) for p in paths]
    layout = relay_layout(ids, mask, n_pad, lengths)
    fork = cache.fork(suffix_padding=layout.suffix_padding, paths=paths)
    positions = (layout.mask.cumsum(-1) - 1).clamp(min=0)
    P = layout.prefix_columns
    with torch.no_grad():
        relay = model(layout.ids[:, P:], attention_mask=layout.mask, position_ids=positions[:, P:],
                      past_key_values=fork).logits[:, -1]
        stock = model(ids, attention_mask=mask).logits[:, -1]
    torch.testing.assert_close(relay, stock, atol=1e-5, rtol=1e-4)


def _continue(model, ids, mask, **first_gen):
    """Generate, then continue the returned sequences plus 3 new tokens per row from the returned cache (as one
    continues with stock's ``DynamicCache``)."""
    first = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                           **first_gen)
    more = torch.randint(3, 256, (ids.shape[0], 3), generator=torch.Generator().manual_seed(5))
    ids2 = torch.cat([first.sequences, more], 1)
    mask2 = torch.cat([mask, torch.ones(ids.shape[0], 7, dtype=mask.dtype)], 1)
    out = model.generate(ids2, attention_mask=mask2, max_new_tokens=4, do_sample=False,
                         **{cache_kwarg_name(model): output_cache(first)})
    return out, output_cache(first)


@pytest.mark.parametrize("batch", ["one prompt", "several prompts and a row with none"])
@pytest.mark.parametrize("first_gen", [{}, dict(cache_implementation="static")], ids=["dynamic", "static"])
def test_a_call_continues_from_the_cache_the_last_call_returned(batch, first_gen):
    model = tiny_model("llama")
    ids, mask, *_ = shared_prefix_batch() if batch == "one prompt" else grouped_batch()
    relay_hf.unpatch(model)
    stock, _ = _continue(model, ids, mask)
    relay_hf.patch(model, min_prefix_length=8)
    out, returned = _continue(model, ids, mask, **first_gen)
    assert model.relay_last_decision.used, model.relay_last_decision
    assert torch.equal(out, stock)
    # a static cache handed to the caller is the caller's: no later call refills it under their continuation
    slot = relay_state(model).idle_static()
    assert slot is None or slot.cache is not returned
