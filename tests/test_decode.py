"""relay_hf's own decode loop (``relay_hf/decode.py``, its step ``step.py`` and token choice ``sampling.py``), forced
on the CPU with ``patch(model, decode="graph")``: token for token, streamer put for streamer put and RNG draw for RNG
draw what stock ``generate`` gives (greedy, sampling, repetition penalty, EOS per row, minimum lengths, return
sequences, stop strings), on five architectures; calls it cannot serve go to transformers' loop and say why."""

import contextlib
import copy
import functools
import warnings

import pytest
import torch
from transformers import (
    CompileConfig,
    GenerationConfig,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TopKLogitsWarper,
)

import relay_hf
from relay_hf.graphs import Captured, Eager, Pending, Warming
from relay_hf.policy import decide
from relay_hf.state import relay_state
from relay_hf.step import DEFAULT_DECODE, WARM_UP_STEPS, DecodeConfig
from tests.helpers import VOCAB, RecordingStreamer, grouped_batch, run_stock, shared_prefix_batch, tiny_model

GRAPH = dict(min_prefix_length=8, decode="graph")


def _loop(model, ids, mask, seed=0, **gen):
    """The call on relay_hf's loop (``decode="graph"``; the model stays patched), after seeding torch's RNG."""
    relay_hf.patch(model, **GRAPH)
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, **gen)


def _stock_and_loop(model, ids, mask, **gen):
    """``(stock, loop)`` outputs of one call, each followed by a ``torch.rand(3)`` draw: ``(out, draw)`` pairs."""
    stock = run_stock(model, ids, mask, **gen)
    stock_draw = torch.rand(3)
    loop = _loop(model, ids, mask, **gen)
    return (stock, stock_draw), (loop, torch.rand(3))


def _assert_loop_equals_stock(model, ids, mask, **gen) -> torch.Tensor:
    """Runs both, checks the loop ran and gave stock's tokens and left the RNG where stock did; returns stock's."""
    (stock, stock_draw), (loop, loop_draw) = _stock_and_loop(model, ids, mask, **gen)
    decision = model.relay_last_decision
    assert decision.used and decision.fast_decode, decision
    assert loop.shape == stock.shape and torch.equal(loop, stock)
    assert torch.equal(loop_draw, stock_draw)
    return stock


def _row_eos(model, ids, mask) -> list[int]:
    """EOS ids, one a row: a token that row generates early (greedy), so the rows stop at different steps."""
    relay_hf.unpatch(model)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    return sorted({int(out[r, ids.shape[1] + 2 + 2 * r]) for r in range(ids.shape[0])})


def _sampled_row_eos(model, ids, mask, **gen) -> list[int]:
    """The same for a seeded sampled call: tokens that call draws early, at a different step per row."""
    out = run_stock(model, ids, mask, max_new_tokens=12, **gen)
    return sorted({int(out[r, ids.shape[1] + 1 + r % 10]) for r in range(out.shape[0])})


@contextlib.contextmanager
def _relay_warnings():
    """The messages of the ``relay_hf:`` warnings raised inside the block (a list, filled when it ends)."""
    found = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
    found += [str(w.message) for w in caught if str(w.message).startswith("relay_hf:")]


def _finish_steps(out: torch.Tensor, T: int, eos: list[int]) -> list[int]:
    """The step at which each row first made an EOS (-1: never)."""
    hit = torch.isin(out[:, T:], torch.tensor(eos))
    return [int(h.nonzero()[0]) if bool(h.any()) else -1 for h in hit]


# -- the loop against stock, on every architecture -------------------------------------------------------------------
CORE = {
    "default_length": lambda T, eos: dict(),  # nothing given: stock's 20 new tokens, greedy
    "max_new_tokens": lambda T, eos: dict(max_new_tokens=12, do_sample=False),
    "eos_per_row": lambda T, eos: dict(max_new_tokens=40, eos_token_id=eos, do_sample=False),
    "min_new_tokens": lambda T, eos: dict(max_new_tokens=40, eos_token_id=eos, min_new_tokens=7, do_sample=False),
    "max_length_min_length": lambda T, eos: dict(max_length=T + 9, eos_token_id=eos, min_length=T + 5,
                                                 do_sample=False),
    "sampled": lambda T, eos: dict(max_new_tokens=16, do_sample=True, temperature=0.8, top_k=40, top_p=0.9),
    "sampled_eos_per_row": lambda T, eos: dict(max_new_tokens=30, eos_token_id=eos, do_sample=True, top_k=20),
    "sampled_min_p": lambda T, eos: dict(max_new_tokens=16, do_sample=True, top_k=0, min_p=0.05,
                                         repetition_penalty=1.3),
}


@pytest.mark.parametrize("case", list(CORE))
def test_loop_gives_stock_tokens(arch_model, case):
    """Stock's tokens and its next RNG draw; EOS ids chosen so that the rows stop at different steps."""
    ids, mask, _ = shared_prefix_batch(seed=11)
    T = ids.shape[1]
    eos = _row_eos(arch_model, ids, mask)
    gen = CORE[case](T, eos)
    stock = _assert_loop_equals_stock(arch_model, ids, mask, **gen)
    if case == "default_length":
        assert stock.shape[1] == T + 20
    if case == "eos_per_row":  # the case really stops on EOS, the rows at different steps
        steps = _finish_steps(stock, T, eos)
        assert stock.shape[1] < T + 40 and len(set(steps)) > 1, steps
    if case == "min_new_tokens":  # EOS banned for the first 7 tokens, made after them
        steps = [s for s in _finish_steps(stock, T, eos) if s >= 0]
        assert steps and min(steps) >= 7 - 1, steps


@pytest.mark.parametrize("gen", [
    dict(temperature=0.6),
    dict(top_k=5),
    dict(top_k=0, top_p=0.7),
    dict(top_k=0, min_p=0.1),
    dict(top_k=0, typical_p=0.8),
    dict(top_k=0, epsilon_cutoff=3e-3),
    dict(temperature=1.4, top_k=30, top_p=0.95, min_p=0.02, typical_p=0.9, epsilon_cutoff=1e-4,
         renormalize_logits=True),
], ids=lambda gen: "-".join(gen))
def test_sampling_warpers_give_stock_tokens(gen):
    model = tiny_model("qwen2")
    ids, mask, _ = shared_prefix_batch(seed=21)
    _assert_loop_equals_stock(model, ids, mask, max_new_tokens=12, do_sample=True, **gen)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_gives_stock_tokens(do_sample, penalty):
    """Stock's processor penalises the prompt's tokens, pads included (read off the processor), then each new one."""
    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=22)
    gen = dict(max_new_tokens=16, do_sample=do_sample)
    stock = _assert_loop_equals_stock(model, ids, mask, repetition_penalty=penalty, **gen)
    assert not torch.equal(stock, run_stock(model, ids, mask, **gen))  # the penalty changes the tokens


def test_a_bare_generation_config_gives_stock_tokens():
    model = tiny_model("mistral")
    ids, mask, _ = shared_prefix_batch(seed=23)
    _assert_loop_equals_stock(model, ids, mask, generation_config=GenerationConfig())
    _assert_loop_equals_stock(model, ids, mask, generation_config=GenerationConfig(max_new_tokens=6, do_sample=True,
                                                                                    top_k=9))


def test_a_model_whose_generation_config_samples_gives_stock_tokens():
    model = tiny_model("phi3")
    ids, mask, _ = shared_prefix_batch(seed=24)
    greedy = run_stock(model, ids, mask, max_new_tokens=12)
    model.generation_config.do_sample, model.generation_config.top_k = True, 7
    model.generation_config.temperature = 1.2
    sampled = _assert_loop_equals_stock(model, ids, mask, max_new_tokens=12)
    assert not torch.equal(sampled, greedy)


def test_sampled_return_sequences_give_stock_tokens():
    model = tiny_model("qwen3")
    ids, mask, _ = shared_prefix_batch(seed=25)
    T, n = ids.shape[1], 3
    gen = dict(do_sample=True, top_k=30, num_return_sequences=n)
    eos = _sampled_row_eos(model, ids, mask, **gen)
    out = _assert_loop_equals_stock(model, ids, mask, max_new_tokens=24, eos_token_id=eos, **gen)
    assert out.shape[0] == n * ids.shape[0]
    assert len(set(_finish_steps(out, T, eos))) > 1
    assert not torch.equal(out[0], out[1])  # one input's sequences are drawn apart


def test_greedy_return_sequences_fail_as_stock_does():
    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=26)
    with pytest.raises(ValueError) as stock:
        run_stock(model, ids, mask, max_new_tokens=4, do_sample=False, num_return_sequences=3)
    with pytest.raises(ValueError) as loop:
        _loop(model, ids, mask, max_new_tokens=4, do_sample=False, num_return_sequences=3)
    assert str(loop.value) == str(stock.value)
    assert torch.equal(_loop(model, ids, mask, max_new_tokens=4), run_stock(model, ids, mask, max_new_tokens=4))


def test_seeded_sampling_leaves_the_rng_where_stock_does():
    """The draw after a seeded sampled call that stops on EOS before its last step is stock's next draw."""
    model = tiny_model("mistral")
    ids, mask, _ = shared_prefix_batch(seed=27)
    gen = dict(do_sample=True, top_p=0.9)
    eos = _sampled_row_eos(model, ids, mask, **gen)
    (stock, stock_draw), (loop, loop_draw) = _stock_and_loop(model, ids, mask, max_new_tokens=30, eos_token_id=eos,
                                                             **gen)
    assert model.relay_last_decision.fast_decode and torch.equal(loop, stock)
    assert stock.shape[1] < ids.shape[1] + 30  # it stopped early
    assert torch.equal(loop_draw, stock_draw)
    torch.manual_seed(0)
    assert not torch.equal(torch.rand(3), stock_draw)  # the calls drew from the generator at all


# -- stop strings ----------------------------------------------------------------------------------------------------
@functools.cache
def _char_tokenizer():
    """A tokenizer over the tiny models' ``VOCAB`` ids, built offline: ids 0-2 pad / bos / eos, then one character
    each (``a``-``f`` among them, which ``StopStringCriteria`` tokenizes to clean the vocabulary); decoding
    concatenates, so a stop string can span tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(0x21, 0x7F)]
    chars += [chr(c) for c in range(0x100, 0x100 + VOCAB - 3 - len(chars))]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(chars)}}
    backend = Tokenizer(models.BPE(vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>")
    assert len(tokenizer) == VOCAB and tokenizer.decode([70, 71]) == "de"
    return tokenizer


def _stop_strings(model, ids, mask, tokenizer) -> list[str]:
    """Two two-token strings that rows 0 and 2 make (greedy) at different steps."""
    out = run_stock(model, ids, mask, max_new_tokens=12, do_sample=False)
    T = ids.shape[1]
    return [tokenizer.decode(out[0, T + 2:T + 4]), tokenizer.decode(out[2, T + 5:T + 7])]


@pytest.mark.parametrize("eos", [
    "model's",
    "none",
])
def test_stop_strings_give_stock_tokens(eos):
    model = tiny_model("llama")
    tokenizer = _char_tokenizer()
    ids, mask, _ = shared_prefix_batch(seed=11)
    stops = _stop_strings(model, ids, mask, tokenizer)
    if eos == "none":
        model.generation_config.eos_token_id = None
    gen = dict(max_new_tokens=12, do_sample=False, stop_strings=stops, tokenizer=tokenizer)
    stock = _assert_loop_equals_stock(model, ids, mask, **gen)
    T = ids.shape[1]
    if eos != "none":  # rows 0 and 2 stopped on their strings (or earlier), padded after them
        assert not stock[0, T + 4:].any() and not stock[2, T + 7:].any()


def test_sampled_stop_strings_with_return_sequences_give_stock_tokens():
    model = tiny_model("qwen2")
    tokenizer = _char_tokenizer()
    ids, mask, _ = shared_prefix_batch(seed=11)
    stops = _stop_strings(model, ids, mask, tokenizer)
    _assert_loop_equals_stock(model, ids, mask, max_new_tokens=12, do_sample=True, top_k=3, num_return_sequences=3,
                              stop_strings=stops, tokenizer=tokenizer)


# -- streamers -------------------------------------------------------------------------------------------------------

STREAMED = {
    "eos_per_row": lambda model, ids, mask: dict(max_new_tokens=40, eos_token_id=_row_eos(model, ids, mask),
                                                 do_sample=False),
    "stop_strings": lambda model, ids, mask: dict(max_new_tokens=12, do_sample=False, tokenizer=_char_tokenizer(),
                                                  stop_strings=_stop_strings(model, ids, mask, _char_tokenizer())),
    "return_sequences": lambda model, ids, mask: dict(max_new_tokens=6, do_sample=True, num_return_sequences=3),
}


@pytest.mark.parametrize("case", [
    "eos_per_row", "stop_strings",
    "return_sequences",
])
def test_streamer_gets_what_stock_streams(case):
    model = tiny_model("qwen2")
    ids, mask, _ = shared_prefix_batch(seed=12)
    gen = STREAMED[case](model, ids, mask)
    stock_rec, loop_rec = RecordingStreamer(), RecordingStreamer()
    stock = run_stock(model, ids, mask, streamer=stock_rec, **gen)
    loop = _loop(model, ids, mask, streamer=loop_rec, **gen)
    assert model.relay_last_decision.fast_decode and torch.equal(stock, loop)
    assert stock_rec.ends == loop_rec.ends == 1
    assert len(loop_rec.puts) == len(stock_rec.puts) == 1 + stock.shape[1] - ids.shape[1]
    for a, b in zip(stock_rec.puts, loop_rec.puts, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


# -- batch buckets ---------------------------------------------------------------------------------------------------
def test_batch_sizes_share_the_static_slot_of_their_bucket():
    """3 rows, 4 rows (the same bucket: the same slot and step), 5 rows (the next bucket: a new slot), 3 rows again
    (the idle 8-row slot serves it: up to twice the bucket), 2 rows (the 4-row slot, still idle beside the 8-row
    one). The static cache holds at least ``DecodeConfig.bucket(rows)`` rows (the extra ones dropped) and the tokens
    and the RNG are stock's every time."""
    model = tiny_model("qwen2")
    gen = dict(max_new_tokens=8, do_sample=True, top_k=20)
    batches = [shared_prefix_batch(suffix_lens=s, seed=5)[:2] for s in [(3, 9, 1), (3, 9, 1, 6), (3, 9, 1, 6, 2),
                                                                        (4, 2, 7), (5, 2)]]
    stock = [(run_stock(model, ids, mask, **gen), torch.rand(3)) for ids, mask in batches]  # unpatch drops the slot
    slots = []
    for (ids, mask), (out, draw) in zip(batches, stock, strict=True):
        assert torch.equal(_loop(model, ids, mask, **gen), out) and torch.equal(torch.rand(3), draw)
        assert model.relay_last_decision.fast_decode
        slot = relay_state(model).idle_static()
        rows = slot.cache.layers[0].keys.shape[0]
        assert DEFAULT_DECODE.bucket(ids.shape[0]) <= rows <= 2 * DEFAULT_DECODE.bucket(ids.shape[0])
        slots.append((slot, slot.stepper, rows))
    assert slots[1][0] is slots[0][0] and slots[1][1] is slots[0][1]  # refilled in place, the step kept
    assert slots[2][0] is not slots[1][0] and slots[2][2] == 8
    assert slots[3][0] is slots[2][0] and slots[3][1] is slots[2][1]  # 3 rows replay the 8-row step
    assert slots[4][0] is slots[0][0] and slots[4][1] is slots[0][1] and len(relay_state(model).idle_slots()) == 2


def test_decode_config_bucket_is_the_smallest_capture_size_that_holds_the_rows():
    decode = DEFAULT_DECODE
    assert [decode.bucket(r) for r in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    last = decode.row_buckets[-1]
    for rows in range(1, 3 * last):
        size = decode.bucket(rows)
        if rows <= last:
            assert size == min(b for b in decode.row_buckets if b >= rows)
        else:  # beyond the buckets: the next multiple of row_step
            assert size % decode.row_step == 0 and size - decode.row_step < rows <= size
    custom = DecodeConfig(row_buckets=(4,), row_step=10)
    assert [custom.bucket(r) for r in (1, 4, 5, 10, 11)] == [4, 4, 10, 10, 20]


# -- modes -----------------------------------------------------------------------------------------------------------
def test_an_unknown_decode_mode_is_refused_and_leaves_the_model_usable():
    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=31)
    stock = run_stock(model, ids, mask, max_new_tokens=6)
    with pytest.raises(ValueError, match="decode must be one of .*'nope'"):
        relay_hf.patch(model, min_prefix_length=8, decode="nope")
    assert not relay_hf.is_patched(model)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6), stock)
    relay_hf.patch(model, **GRAPH)
    with pytest.raises(ValueError, match="'nope'"):
        relay_hf.patch(model, decode="nope")
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6), stock)
    assert model.relay_last_decision.fast_decode  # the patched model keeps its mode


def test_eager_mode_decodes_on_transformers_loop():
    model = relay_hf.patch(tiny_model("phi3"), min_prefix_length=8, decode="eager")
    ids, mask, _ = shared_prefix_batch(seed=32)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    decision = model.relay_last_decision
    assert decision.used and not decision.fast_decode and "decode='eager'" in decision.loop_reason
    assert torch.equal(out, run_stock(model, ids, mask, max_new_tokens=8, do_sample=False))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default mode runs relay_hf's loop on CUDA")
def test_auto_mode_off_cuda_decodes_on_transformers_loop_unless_a_static_cache_is_asked_for():
    model = tiny_model("qwen3")
    ids, mask, _ = shared_prefix_batch(seed=33)
    stock = run_stock(model, ids, mask, max_new_tokens=8, do_sample=False)
    relay_hf.patch(model, min_prefix_length=8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    decision = model.relay_last_decision
    assert decision.used and not decision.fast_decode and "decode='graph'" in decision.loop_reason
    assert torch.equal(out, stock)
    static = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                            cache_implementation="static")
    decision = model.relay_last_decision
    assert decision.used and decision.static and decision.fast_decode and torch.equal(static, stock)
    # off CUDA transformers compiles nothing unless told to, so neither does the loop
    assert not relay_state(model).idle_static().stepper.compiled


def test_off_cuda_the_step_and_its_choice_run_eagerly_and_say_why():
    """No CUDA graphs off CUDA: the forward and the choice are ``Eager`` from the first step, with the reason, and
    stay so for the next calls that replay the kept step."""
    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=35)
    stock = run_stock(model, ids, mask, max_new_tokens=6, do_sample=False)
    for _ in range(2):
        assert torch.equal(_loop(model, ids, mask, max_new_tokens=6, do_sample=False), stock)
        step = relay_state(model).idle_static().stepper
        assert isinstance(step.state, Eager) and "CUDA" in step.state.reason
        assert step.choice.state == step.state and not step.captures and step.graph is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="decode='compile' compiles on CUDA")
def test_compile_mode_off_cuda_warns_and_says_its_steps_run_eager_ops():
    """transformers compiles a decode step on CUDA only, unless a ``CompileConfig`` says every device, and so does
    the loop: off CUDA ``decode="compile"`` runs eager ops, warns, and the decision names the step that ran."""
    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=36)
    gen = dict(max_new_tokens=6, do_sample=False)
    stock = run_stock(model, ids, mask, **gen)
    gen["attention_mask"] = mask
    relay_hf.patch(model, min_prefix_length=8, decode="compile")
    with pytest.warns(UserWarning, match="decode='compile' compiles the decode step on CUDA only"):
        out = model.generate(ids, **gen)
    decision = model.relay_last_decision
    assert decision.used and decision.fast_decode and decision.decode_step == "eager ops", decision
    step = relay_state(model).idle_static().stepper
    assert not step.compiled and step.kind == "eager ops" and torch.equal(out, stock)
    with _relay_warnings() as found:  # a call that turns compiling off asked for eager steps
        model.generate(ids, disable_compile=True, **gen)
    assert not found and model.relay_last_decision.decode_step == "eager ops"
    config = CompileConfig()
    config._compile_all_devices = True  # every device, as transformers allows: then the loop compiles here too
    with _relay_warnings() as found:
        plan = decide(model, dict(inputs=ids, compile_config=config, **gen))
    assert not found and plan.decision().decode_step == "compiled"
    for decode, step in (("graph", "eager ops"), ("auto", "")):  # "auto" decodes on transformers' loop here
        relay_hf.patch(model, min_prefix_length=8, decode=decode)
        with _relay_warnings() as found:
            model.generate(ids, **gen)
        assert not found and model.relay_last_decision.decode_step == step, (decode, model.relay_last_decision)


# -- calls the loop cannot serve ------------------------------------------------------------------------------------
class _UserTopK(TopKLogitsWarper):
    """A user's own processor class (transformers' built-ins given by the user run stock generate)."""


class _NeverStop(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("gen, reason", [
    (dict(num_beams=2), "num_beams"),
    (dict(return_dict_in_generate=True, output_logits=True), "return_dict_in_generate"),
    (dict(return_dict_in_generate=True, output_scores=True, do_sample=True), "return_dict_in_generate"),
    (dict(output_scores=True), "output_scores"),
    (dict(max_time=60.0), "max_time"),
    (dict(logits_processor=LogitsProcessorList([_UserTopK(5)])), "logits_processor"),
    (dict(stopping_criteria=StoppingCriteriaList([_NeverStop()])), "stopping_criteria"),
    (dict(suppress_tokens=[5, 6], do_sample=True), "suppress_tokens"),
    (dict(forced_eos_token_id=2), "forced_eos_token_id"),
    (dict(do_sample=True, top_k=0, eta_cutoff=1e-3), "EtaLogitsWarper"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_calls_the_loop_cannot_serve_run_on_transformers_loop(gen, reason):
    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=13)
    (stock, stock_draw), (loop, loop_draw) = _stock_and_loop(model, ids, mask, max_new_tokens=8, **gen)
    decision = model.relay_last_decision
    assert decision.used and not decision.fast_decode and reason in decision.loop_reason, decision
    seq = (lambda o: o if isinstance(o, torch.Tensor) else o.sequences)
    assert torch.equal(seq(stock), seq(loop)) and torch.equal(stock_draw, loop_draw)


@pytest.mark.parametrize("gen", [dict(num_beams=2), dict(do_sample=True, num_return_sequences=2)],
                         ids=["beams", "return_sequences"])
def test_repetition_penalty_off_the_loop_runs_stock_generate(gen):
    """On transformers' loop the penalty would read the relay layout's pads: stock generate runs the call."""
    model = tiny_model("mistral")
    ids, mask, _ = shared_prefix_batch(seed=34)
    (stock, stock_draw), (loop, loop_draw) = _stock_and_loop(model, ids, mask, max_new_tokens=8,
                                                             repetition_penalty=1.3, **gen)
    decision = model.relay_last_decision
    assert not decision.used and "repetition_penalty" in decision.reason
    assert torch.equal(stock, loop) and torch.equal(stock_draw, loop_draw)


# -- the compiled forward --------------------------------------------------------------------------------------------
def test_compiled_forward_traces_as_one_graph_and_matches_eager():
    """A ``compile_config`` call compiles the loop's forward with ``fullgraph=True``. CPU CI uses an eager backend
    that counts the graphs dynamo hands it (tracing is what can break); on the GPU inductor compiles it and a CUDA
    graph captures it."""
    traced = []

    def eager_backend(gm, example_inputs):  # what backend="eager" does, counting the graphs it is handed
        traced.append(gm)
        return gm.forward

    model = relay_hf.patch(tiny_model("llama"), min_prefix_length=8)
    ids, mask, _ = shared_prefix_batch(seed=14)
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    config = CompileConfig(fullgraph=True, backend=eager_backend, mode=None)
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told otherwise
    torch._dynamo.reset()
    compiled = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, compile_config=config)
    assert model.relay_last_decision.fast_decode
    assert traced and relay_state(model).idle_static().stepper.compiled  # the compiled forward ran
    assert torch.equal(eager, compiled)
    assert model.config._attn_implementation == "relay"


def test_a_forward_that_fails_to_compile_decodes_eagerly_with_a_warning():
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    model = relay_hf.patch(tiny_model("mistral"), min_prefix_length=8)
    ids, mask, _ = shared_prefix_batch(seed=15)
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    config = CompileConfig(fullgraph=True, backend=broken_backend, mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="compiling the decode step failed"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, compile_config=config)
    assert model.relay_last_decision.fast_decode and torch.equal(eager, out)
    step = relay_state(model).idle_static().stepper
    assert not step.compiled and step.runner is model  # the regional view is dropped with the compiled region
    assert step.kind == ("cuda graph" if model.device.type == "cuda" else "eager ops")
    with _relay_warnings() as found:  # the same settings replay the kept step: uncompiled, not compiled again
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, compile_config=config)
    assert relay_state(model).idle_static().stepper is step and torch.equal(eager, out) and not found
    again = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(eager, again)  # the model stays usable


def test_a_patched_model_with_a_kept_step_can_be_deep_copied():
    model = relay_hf.patch(tiny_model("qwen3"), **GRAPH)
    ids, mask, _ = shared_prefix_batch(seed=16)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    slot = relay_state(model).idle_static()
    assert slot.stepper is not None
    assert copy.deepcopy(slot).stepper is None  # a graph cannot be copied: a copied cache captures its own step
    twin = copy.deepcopy(model)
    assert relay_state(twin).idle_static() is None and relay_hf.is_patched(twin)
    assert torch.equal(out, twin.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    assert twin.relay_last_decision.fast_decode  # the copy keeps the mode


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, None])
def test_capture_blas_preference_is_scoped(dtype):
    """The decode graph's cuBLASLt preference holds only inside the capture, only for 16-bit models (fp32 steps keep
    the GEMMs the eager path uses), and a build without cuBLASLt (the CPU one) just keeps what it has."""
    from relay_hf.step import preferred_blas

    before = torch.backends.cuda.preferred_blas_library()
    with preferred_blas(DEFAULT_DECODE.capture_blas, dtype):
        inside = torch.backends.cuda.preferred_blas_library()
    assert torch.backends.cuda.preferred_blas_library() == before
    if dtype in (torch.bfloat16, torch.float16) and torch.cuda.is_available() and not torch.version.hip:
        assert inside.name.lower() == DEFAULT_DECODE.capture_blas
    else:
        assert inside == before


def test_forward_compile_arguments_add_combo_kernels_on_cuda_under_the_users_options():
    """Inductor on CUDA gets the decode config's step options with the mode's own options spelled out (torch.compile
    takes a mode or options, not both); the user's options win; other backends and the CPU get the user's settings
    unchanged."""
    from relay_hf.step import step_compile_kwargs

    cuda = step_compile_kwargs(CompileConfig(fullgraph=True), "cuda")
    assert cuda == dict(fullgraph=True, backend="inductor", mode=None, options={"combo_kernels": True})
    tuned = step_compile_kwargs(CompileConfig(mode="max-autotune"), "cuda")
    assert tuned["mode"] is None and tuned["options"]["max_autotune"] and tuned["options"]["combo_kernels"]
    assert "triton.cudagraphs" not in tuned["options"]  # the loop captures its own graph
    off = step_compile_kwargs(CompileConfig(mode=None, options={"combo_kernels": False}), "cuda")
    assert off["options"] == {"combo_kernels": False}
    assert step_compile_kwargs(CompileConfig(), "cpu") == dict(fullgraph=False, backend="inductor", mode=None,
                                                               options=None)
    eager = step_compile_kwargs(CompileConfig(backend="eager", mode=None), "cuda")
    assert eager["backend"] == "eager" and eager["options"] is None
    torch.compile(lambda x: x + 1, dynamic=False, **cuda)  # a combination torch.compile accepts


def test_forward_options_this_torch_does_not_know_are_left_out():
    from relay_hf.step import step_compile_kwargs

    options = (("combo_kernels", True), ("no_such_inductor_option", 1))
    assert step_compile_kwargs(CompileConfig(), "cuda", options)["options"] == {"combo_kernels": True}
    assert step_compile_kwargs(CompileConfig(), "cuda", ())["options"] is None


# -- on CUDA: the captured loop (default mode), chunked host looks, the generator rewound -------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_captured_loop_gives_stock_tokens_and_rng_on_gpu(arch):
    """fp32 on CUDA, ``decode="auto"``: the loop replays CUDA graphs and looks at the host every
    ``DecodeConfig.chunk`` steps, so rows that stop on EOS mid-chunk make it draw past stock's last step; the
    generator is rewound, so the next CUDA draw is stock's next draw."""
    model = tiny_model(arch).cuda()
    ids, mask, _ = shared_prefix_batch(suffix_lens=(3, 9, 1), seed=41)
    ids, mask = ids.cuda(), mask.cuda()
    gen = dict(do_sample=True, top_k=20)
    eos = _sampled_row_eos(model, ids, mask, **gen)
    calls = [dict(max_new_tokens=40, eos_token_id=eos, **gen), dict(max_new_tokens=24, do_sample=False),
             dict(max_new_tokens=40, eos_token_id=eos, repetition_penalty=1.3, **gen)]
    for i, call in enumerate(calls):
        stock = run_stock(model, ids, mask, **call)
        stock_draw = torch.rand(3, device="cuda")
        relay_hf.patch(model, min_prefix_length=8)
        torch.manual_seed(0)
        loop = model.generate(ids, attention_mask=mask, **call)
        loop_draw = torch.rand(3, device="cuda")
        assert model.relay_last_decision.fast_decode, model.relay_last_decision
        assert torch.equal(loop, stock) and torch.equal(loop_draw, stock_draw), call
        if i == 0:  # stopped on EOS inside a chunk: the loop drew past stock's last step
            assert (stock.shape[1] - ids.shape[1]) % DEFAULT_DECODE.chunk != 0 and stock.shape[1] < ids.shape[1] + 40


@pytest.mark.gpu
def test_captured_loop_with_several_prompts_replays_each_calls_layout_on_gpu():
    """fp32 on CUDA: calls under different prompts (same levels, within the slot's planned segments) replay one
    captured step whose kernel tables are rewritten in place per call; tokens and the next draw are stock's each
    time, greedy and sampled."""
    model = tiny_model("llama").cuda()
    batches = [grouped_batch(seed=60)[:2], grouped_batch(seed=61, prompts=(30, 20, 10), rows=(3, 2, 2))[:2],
               grouped_batch(seed=62, prompts=(44, 18), rows=(3, 3), none=2)[:2]]
    batches = [(ids.cuda(), mask.cuda()) for ids, mask in batches]
    calls = [dict(max_new_tokens=24, do_sample=False), dict(max_new_tokens=24, do_sample=True, top_k=20)]
    stock = [(run_stock(model, ids, mask, **call), torch.rand(3, device="cuda"))  # unpatch drops the slots
             for ids, mask in batches for call in calls]
    relay_hf.patch(model, min_prefix_length=8)
    slots = []
    for b, (ids, mask) in enumerate(batches):
        for c, call in enumerate(calls):
            torch.manual_seed(0)
            loop = model.generate(ids, attention_mask=mask, **call)
            loop_draw = torch.rand(3, device="cuda")
            decision = model.relay_last_decision
            assert decision.fast_decode and len(decision.groups) >= 3, decision
            out, draw = stock[2 * b + c]
            assert torch.equal(loop, out) and torch.equal(loop_draw, draw), call
        slot = relay_state(model).idle_static()
        assert isinstance(slot.stepper.state, Captured)  # captured, and replayed by the next batches
        slots.append((slot, slot.stepper))
    assert slots[1] == slots[0] and slots[2] == slots[0]


def _count_captures(monkeypatch, fail: tuple[int, ...] = ()) -> list[dict]:
    """Records the keyword arguments of each CUDA graph capture (``torch.cuda.graph``) from now on; the captures
    numbered in ``fail`` (from 1) fail before recording anything."""
    real, calls = torch.cuda.graph, []

    def graph(cuda_graph, **kwargs):
        calls.append(kwargs)
        if len(calls) in fail:
            raise RuntimeError("no capture here")
        return real(cuda_graph, **kwargs)

    monkeypatch.setattr(torch.cuda, "graph", graph)
    return calls


@pytest.mark.gpu
def test_the_step_warms_up_then_captures_its_forward_and_choice_once_on_gpu(monkeypatch):
    """fp32 on CUDA: the rows' own tokens are prefilled and that prefill recorded in the first call (its suffix fits
    ``DecodeConfig.prefill_lengths``); the forward runs ``WARM_UP_STEPS`` eager steps (a call of that many steps
    captures no step), then the next step captures the forward and its choice, each in thread-local error mode;
    later calls with the same settings replay all three, and a new sampler gets a choice of its own, captured in its
    first step."""
    model = tiny_model("llama").cuda()
    ids, mask, _ = shared_prefix_batch(seed=42)
    ids, mask = ids.cuda(), mask.cuda()
    calls = [dict(max_new_tokens=1 + WARM_UP_STEPS, do_sample=False), dict(max_new_tokens=6, do_sample=False),
             dict(max_new_tokens=6, do_sample=False), dict(max_new_tokens=6, do_sample=True, top_k=20)]
    stock = [run_stock(model, ids, mask, **call) for call in calls]
    relay_hf.patch(model, **GRAPH, prefix_cache_bytes=0)  # no kept prefixes: their check captures a graph of its own
    captures = _count_captures(monkeypatch)
    seen = []
    for call, out in zip(calls, stock, strict=True):
        assert torch.equal(_loop(model, ids, mask, **call), out)
        slot = relay_state(model).idle_static()
        step = slot.stepper
        seen.append(dict(step=step, forward=step.state, choice=step.choice, chosen=step.choice.state,
                         captures=len(captures), prefills=dict(slot.prefill.graphs)))
    warm, first, again, other = seen
    assert warm["forward"] == Warming(0) and warm["chosen"] == Pending() and warm["captures"] == 1
    assert len(warm["prefills"]) == 1 and all(p.__class__ is not Eager for p in warm["prefills"].values())
    assert first["step"] is warm["step"] and first["captures"] == 3 and first["prefills"] == warm["prefills"]
    assert isinstance(first["forward"], Captured) and isinstance(first["chosen"], Captured)
    assert again["step"] is first["step"] and again["forward"] is first["forward"]
    assert again["choice"] is first["choice"] and again["chosen"] is first["chosen"] and again["captures"] == 3
    assert other["step"] is first["step"] and other["forward"] is first["forward"]
    assert other["choice"] is not first["choice"] and isinstance(other["chosen"], Captured) and other["captures"] == 4
    assert all(kwargs["capture_error_mode"] == "thread_local" for kwargs in captures)


@pytest.mark.gpu
@pytest.mark.parametrize("what, fail", [("prefill", 1), ("step", 2), ("choice", 3)])
def test_a_capture_that_fails_is_warned_once_and_not_retried_on_gpu(monkeypatch, what, fail):
    """fp32 on CUDA, the ``fail``-th capture failing (the suffix prefill's, the forward's, or the choice's after the
    forward was captured): that part runs as eager ops, with stock's tokens and RNG; one warning, and the next call on
    the kept slot neither captures it again nor warns."""
    model = tiny_model("qwen2").cuda()
    ids, mask, _ = shared_prefix_batch(seed=43)
    ids, mask = ids.cuda(), mask.cuda()
    gen = dict(max_new_tokens=12, do_sample=True, top_k=20)
    stock, draw = run_stock(model, ids, mask, **gen), torch.rand(3, device="cuda")
    relay_hf.patch(model, **GRAPH, prefix_cache_bytes=0)  # no kept prefixes: their check captures a graph of its own
    captures = _count_captures(monkeypatch, (fail,))
    for call in range(2):
        with _relay_warnings() as found:
            out = _loop(model, ids, mask, **gen)
        assert torch.equal(out, stock) and torch.equal(torch.rand(3, device="cuda"), draw)
        assert model.relay_last_decision.fast_decode
        slot = relay_state(model).idle_static()
        step, (prefill,) = slot.stepper, slot.prefill.graphs.values()
        assert (prefill.__class__ is Eager) == (what == "prefill")
        assert (relay_state(model).prefill_eager is not None) == (what == "prefill")  # no later call is widened
        if what == "step":  # the choice follows its eager forward
            assert isinstance(step.state, Eager) and step.choice.state == step.state and not step.captures
        else:
            assert isinstance(step.state, Captured)
            assert isinstance(step.choice.state, Eager) == (what == "choice")
        failed = {"prefill": prefill, "step": step.state, "choice": step.choice.state}[what]
        assert "no capture here" in failed.reason
        assert len(captures) == 3 - (what == "step")  # each tried once, in the first call (no choice after a step)
        if call == 0:
            name = "suffix prefill" if what == "prefill" else f"decode {what}"
            assert len(found) == 1 and f"capturing the {name} failed" in found[0], found
        else:
            assert not found


@pytest.mark.gpu
def test_a_captured_16_bit_call_leaves_the_blas_preference_as_it_was_on_gpu():
    """The step warms up and is captured under ``DecodeConfig.capture_blas`` for a bf16 model; the process-wide
    preference is back to what it was once the call returns."""
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    ids, mask, _ = shared_prefix_batch(seed=44)
    before = torch.backends.cuda.preferred_blas_library()
    _loop(model, ids.cuda(), mask.cuda(), max_new_tokens=8, do_sample=False)
    assert isinstance(relay_state(model).idle_static().stepper.state, Captured)
    assert torch.backends.cuda.preferred_blas_library() == before


@pytest.mark.parametrize("gen", [
    dict(min_new_tokens=2, min_length=10),  # min_new_tokens wins, as stock's _prepare_generated_length says
    dict(eos_token_id=[2, 10_000], min_new_tokens=3),  # an EOS id beyond the vocabulary never matches
    dict(eos_token_id=[2, -1], min_new_tokens=3),  # nor a negative one (stock warns, and never bans token V - 1)
], ids=["min_new_tokens_and_min_length", "eos_beyond_vocab", "negative_eos"])
def test_eos_ban_and_eos_ids_follow_stock(gen):
    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=21)
    gen = dict(gen, max_new_tokens=24, do_sample=False)
    if "min_length" in gen:
        gen["min_length"] += ids.shape[1]
        gen["eos_token_id"] = _row_eos(model, ids, mask)
    stock, draw = run_stock(model, ids, mask, **gen), torch.rand(3)
    assert torch.equal(_loop(model, ids, mask, **gen), stock) and torch.equal(torch.rand(3), draw)
    assert model.relay_last_decision.fast_decode


# -- several system prompts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("gen", [dict(max_new_tokens=8, do_sample=False),
                                 dict(max_new_tokens=8, do_sample=True, top_p=0.9, temperature=0.8),
                                 dict(max_new_tokens=6, do_sample=True, num_return_sequences=2)],
                         ids=["greedy", "sampled", "return_sequences"])
def test_the_loop_serves_several_prompts_with_stock_tokens_and_rng(arch_model, gen):
    ids, mask, _, _ = grouped_batch(seed=50)
    _assert_loop_equals_stock(arch_model, ids, mask, **gen)
    assert len(arch_model.relay_last_decision.groups) == 4
    assert relay_state(arch_model).idle_static().cache.groups.depth == 2


def test_one_static_slot_serves_the_next_grouping_that_fits_it():
    """Calls whose rows read other prompts (as many levels, no more segments per level than the slot planned for)
    refill the same static cache and replay its step: packed prefixes and kernel tables are rewritten in place. A
    call of one prompt runs the ungrouped kernels, on a slot of its own."""
    model = tiny_model("llama")
    gen = dict(max_new_tokens=6, do_sample=False)
    batches = [grouped_batch(seed=51)[:2], grouped_batch(seed=52, prompts=(30, 20, 10), rows=(3, 2, 2))[:2],
               grouped_batch(seed=53, prompts=(44, 18), rows=(3, 3), none=2)[:2]]
    stock = [run_stock(model, ids, mask, **gen) for ids, mask in batches]
    slots = []
    for (ids, mask), out in zip(batches, stock, strict=True):
        assert torch.equal(_loop(model, ids, mask, **gen), out)
        slot = relay_state(model).idle_static()
        slots.append((slot, slot.stepper))
    assert slots[1] == slots[0] and slots[2] == slots[0]
    ids, mask, _ = shared_prefix_batch(seed=54, suffix_lens=(3, 9, 1, 6, 2))
    _assert_loop_equals_stock(model, ids, mask, **gen)  # one prompt again: an ungrouped slot of its own
    assert relay_state(model).idle_static() is not slots[0][0]
