"""Every relay-or-stock rule: when relay pays, and the one frozen plan ``decide`` makes per call."""

import dataclasses

import pytest
import torch

import relay_hf
from relay_hf.policy import CUDA_MIN_SHARED_TOKENS, decide, relay_pays
from tests.helpers import shared_prefix_batch, tiny_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_single_row_and_short_prefix_go_plain():
    assert "single row" in relay_pays(1, 4096, CPU, 32)
    assert "min_prefix_length" in relay_pays(8, 16, CPU, 32)
    assert relay_pays(2, 32, CPU, 32) is None


def test_cuda_needs_enough_shared_tokens():
    assert relay_pays(4, 512, CUDA, 32) is not None  # below the smallest measured win
    assert relay_pays(8, 512, CUDA, 32) is None  # measured: relay 1.06x
    assert relay_pays(32, 512, CUDA, 32) is None  # measured: relay 1.84x
    assert relay_pays(4, CUDA_MIN_SHARED_TOKENS // 4, CUDA, 32) is None


def test_captured_loop_runs_relay_from_one_row_on_cuda_only():
    assert relay_pays(1, 100, CUDA, 32, captured_loop=True) is None  # the loop, not the kernel, decides
    assert relay_pays(2, 100, CUDA, 32, captured_loop=True) is None  # below CUDA_MIN_SHARED_TOKENS
    assert "min_prefix_length" in relay_pays(1, 16, CUDA, 32, captured_loop=True)
    assert "single row" in relay_pays(1, 4096, CPU, 32, captured_loop=True)  # no captured loop on CPU
    assert "single row" in relay_pays(1, 4096, CUDA, 32)


# -- decide: one frozen plan per call ------------------------------------------------------------------------------
def _call(ids, mask, **kw):
    return dict(inputs=ids, attention_mask=mask, **kw)


def test_a_plan_says_what_runs_and_why():
    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch()
    plan = decide(model, _call(ids, mask))
    assert not plan.relay and plan.expected and "not patched" in plan.reason
    relay_hf.patch(model, min_prefix_length=8)
    plan = decide(model, _call(ids, mask, max_new_tokens=5))
    assert plan.relay and (plan.rows, plan.prefix_length, plan.new_tokens) == (4, 40, 5) and not plan.static
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.relay = False
    static = decide(model, _call(ids, mask, max_new_tokens=5, cache_implementation="static"))
    assert static.static and static.fast_decode and static.compile_config is None  # no compile on the CPU
    sampled = decide(model, _call(ids, mask, max_new_tokens=5, cache_implementation="static", do_sample=True))
    assert sampled.static and sampled.fast_decode and sampled.sampler.sample  # the loop samples too
    scored = decide(model, _call(ids, mask, max_new_tokens=5, cache_implementation="static", output_scores=True,
                                 return_dict_in_generate=True))
    assert scored.static and not scored.fast_decode and "return_dict_in_generate" in scored.loop_reason
    assert "decode='graph'" in plan.loop_reason  # off CUDA the default is transformers' loop, and says so
    rep = decide(model, _call(ids, mask, max_new_tokens=5, repetition_penalty=1.2))
    assert not rep.relay and "repetition_penalty" in rep.reason  # off the loop stock's processor reads pad positions
    relay_hf.patch(model, min_prefix_length=8, decode="graph")
    rep = decide(model, _call(ids, mask, max_new_tokens=5, repetition_penalty=1.2))
    assert rep.relay and rep.fast_decode and rep.sampler.penalty == 1.2
    suppress = decide(model, _call(ids, mask, max_new_tokens=5, suppress_tokens=[5]))
    assert suppress.relay and not suppress.fast_decode and "SuppressTokens" in suppress.loop_reason
    assert decide(model, _call(ids[:3], mask[:3], max_new_tokens=5)).static_rows == 4  # rounded up to a bucket
    relay_hf.patch(model, min_prefix_length=8, decode="auto")
    beams = decide(model, _call(ids, mask, num_beams=2, num_return_sequences=2))
    assert beams.relay and beams.rows == 8 and not beams.static
    ngram = decide(model, _call(ids, mask, no_repeat_ngram_size=2))
    assert not ngram.relay and not ngram.expected and "no_repeat_ngram_size" in ngram.reason
    one = decide(model, _call(ids[:1], mask[:1]))
    assert not one.relay and one.expected and "single row" in one.reason
    decision = plan.decision()
    assert (decision.used, decision.prefix_length, decision.rows) == (True, 40, 4)
    model.set_attn_implementation("eager")
    assert "set to 'eager'" in decide(model, _call(ids, mask)).reason
