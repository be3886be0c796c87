"""patch / unpatch: what patch switches, what it declines, and what unpatch restores."""

import gc
import weakref

import pytest
import torch

import relay_hf
from relay_hf._compat import output_cache
from relay_hf.names import ATTN_NAME
from relay_hf.state import relay_state
from tests.helpers import shared_prefix_batch, tiny_model


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


@pytest.mark.parametrize("cls,kwargs,reason", [
    ("FalconConfig", dict(hidden_size=64, num_attention_heads=4, alibi=True), "ALiBi"),
    ("BloomConfig", dict(hidden_size=64, n_head=4), "AttentionInterface"),
])
def test_alibi_and_foreign_attention_fall_back(cls, kwargs, reason):
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


@pytest.mark.parametrize("call", [relay_hf.patch, relay_hf.unpatch])
@pytest.mark.parametrize("thing", ["not a model", None, torch.nn.Linear(2, 2)])
def test_what_is_not_a_model_is_refused_by_name(call, thing):
    with pytest.raises(TypeError, match=f"relay_hf.{call.__name__} takes a transformers model.*got "
                                        f"{type(thing).__name__}"):
        call(thing)
    assert not relay_hf.is_patched(thing)


@pytest.mark.gpu
def test_a_second_model_of_a_head_size_compiles_no_kernel_again_on_gpu():
    """The first patch of a head size compiles relay's Triton kernels (its probe runs them); another model of that
    head size, and a patch after unpatch, compile nothing again in this process."""
    import triton

    compiled = []
    knobs = triton.knobs.runtime
    previous = knobs.jit_post_compile_hook
    knobs.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(1)
    try:
        first, second = (tiny_model("llama", seed=s, head_dim=80).cuda() for s in (0, 1))
        relay_hf.patch(first)
        assert relay_hf.is_patched(first) and relay_state(first).declined is None
        compiled.clear()
        relay_hf.patch(second)
        relay_hf.unpatch(first)
        relay_hf.patch(first)
        assert compiled == []
    finally:
        knobs.jit_post_compile_hook = previous


def _refs(model) -> tuple:
    """Weak references to ``model`` and every parameter and buffer of it (``_gone`` once all are freed): relay's
    per-layer state (attention options, compiled regions, captured steps) would hold a layer's tensors, not the
    model object."""
    return weakref.ref(model), *(weakref.ref(t) for t in (*model.parameters(), *model.buffers()))


def _gone(refs: tuple) -> bool:
    return all(ref() is None for ref in refs)


CAPTURED = pytest.param("cuda", torch.float32, "auto", marks=pytest.mark.gpu)  # the eager step captured
COMPILED = pytest.param("cuda", torch.bfloat16, "auto", marks=pytest.mark.gpu)  # the decoder-layer region compiled


@pytest.mark.parametrize("device,dtype,decode", [("cpu", torch.float32, "auto"), ("cpu", torch.float32, "graph"),
                                                 CAPTURED, COMPILED])
def test_a_patched_model_is_released_with_its_weights(device, dtype, decode):
    """What patch and its calls keep on the model (its generate, its state, the prefix store, the decode loop's
    static caches; on CUDA its captured steps, compiled regions, prefills and kept-prefix checks) holds nothing
    outside it: ``del model; gc.collect()`` frees it as it frees a stock one."""
    model = tiny_model("llama").to(device, dtype)
    relay_hf.patch(model, decode=decode)
    ids, mask, _ = (t.to(device) for t in shared_prefix_batch())
    for _ in range(2):  # the second call takes the kept prefix (and the idle static cache)
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert model.relay_last_decision.used and (device == "cpu" or model.relay_last_decision.fast_decode)
    refs = _refs(model)
    del model
    gc.collect()
    assert _gone(refs)


@pytest.mark.parametrize("device,dtype,decode", [("cpu", torch.float32, "graph"), CAPTURED])
def test_an_unpatched_model_is_released_at_del(device, dtype, decode):
    """``unpatch`` takes off every object patch put on the instance, the ones that refer back to the model
    included (on CUDA the captured steps and checks go with its state): the model is then freed by reference
    counting alone, as a stock one is. (Not after a compiled step: torch.compile's tracing leaves cycles of its own
    that hold parameters until the collector runs, as it does for a stock model compiled.)"""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        model = tiny_model("llama").to(device, dtype)
        relay_hf.patch(model, decode=decode)
        ids, mask, _ = (t.to(device) for t in shared_prefix_batch())
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        relay_hf.unpatch(model)
        refs = _refs(model)
        del model
        assert _gone(refs)
    finally:
        if was_enabled:
            gc.enable()


def test_a_generate_kept_after_del_still_runs():
    """``model.generate`` holds its model as a bound method does: kept alone, it still generates."""
    model = tiny_model("llama")
    relay_hf.patch(model)
    generate = model.generate
    ids, mask, _ = shared_prefix_batch()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    del model
    gc.collect()
    assert torch.equal(generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False), expected)
