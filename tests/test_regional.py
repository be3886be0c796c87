"""Regional compilation of the decode step (relay_hf/regional.py): one compiled graph for every decoder layer, batch
bucket and prompt length, the user's model untouched. CPU CI compiles with a backend that counts the graphs dynamo
hands it (what dynamo traces is what could recompile per layer); the GPU test runs inductor and CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

import relay_hf
from relay_hf.regional import LayerCacheView, decode_view, decoder_layers, region_function
from relay_hf.state import relay_state
from tests.helpers import VOCAB, left_pad, run_stock, shared_prefix_batch, tiny_model


def _counting_config(traced: list) -> CompileConfig:
    def backend(gm, example_inputs):  # backend="eager", counting the graphs it is handed
        traced.append(gm)
        return gm.forward

    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told otherwise
    return config


def _batch(prefix_len: int, suffix_lens, seed: int):
    ids, mask, _ = shared_prefix_batch(prefix_len=prefix_len, suffix_lens=suffix_lens, seed=seed)
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_decoder_layers_finds_the_layer_list_and_its_path(arch):
    model = tiny_model(arch, num_hidden_layers=3)
    path, layers = decoder_layers(model)
    assert model.get_submodule(".".join(path)) is layers and len(layers) == 3


def test_decoder_layers_declines_a_layer_whose_index_is_not_its_position():
    """A layer that names another layer's cache entry cannot be handed a view of its own: no regional compile."""
    model = tiny_model("llama", num_hidden_layers=3)
    model.model.layers[1].self_attn.layer_idx = 2
    assert decoder_layers(model) is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_one_graph_serves_every_layer_bucket_and_prompt_length(arch):
    """Four layers, two batch buckets (2 and 4 rows: the second a new static cache, whose step is made after its first
    prefill created the buffers the region marks dynamic), two prompt lengths, two token budgets: dynamo traces the
    decoder layer once, and every call is stock's tokens."""
    traced: list = []
    config = _counting_config(traced)
    model = tiny_model(arch, num_hidden_layers=4)
    calls = [(_batch(40, (5, 2), seed=2), 6), (_batch(40, (3, 9, 1, 6), seed=1), 6), (_batch(56, (4, 7, 2), seed=3), 9)]
    stock = [run_stock(model, ids, mask, max_new_tokens=n, do_sample=False) for (ids, mask), n in calls]
    relay_hf.patch(model, min_prefix_length=8)
    torch._dynamo.reset()
    for ((ids, mask), n), expected in zip(calls, stock, strict=True):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, compile_config=config)
        assert model.relay_last_decision.fast_decode
        assert torch.equal(out, expected)
    step = relay_state(model).idle_static().stepper
    assert step.compiled and step.runner is not model  # the regional view ran
    assert len(traced) == 1, f"{len(traced)} graphs: the region recompiled per layer, bucket or length"


def test_the_users_model_is_untouched_by_the_regional_view():
    model = tiny_model("llama", num_hidden_layers=3)
    layers = list(model.model.layers)
    modules = dict(model.named_modules())
    params = {name: p.data_ptr() for name, p in model.named_parameters()}
    relay_hf.patch(model, min_prefix_length=8)
    ids, mask = _batch(40, (3, 9, 1, 6), seed=4)
    model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, compile_config=_counting_config([]))
    view = relay_state(model).idle_static().stepper.runner
    assert view is not model and view.model is not model.model and view.model.layers is not model.model.layers
    assert list(model.model.layers) == layers and dict(model.named_modules()) == modules
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == params
    # the view runs the model's own layers and parameters
    assert [w.__dict__["layer"] for w in view.model.layers] == layers
    assert view.lm_head is model.lm_head and view.model.embed_tokens is model.model.embed_tokens
    relay_hf.unpatch(model)
    assert list(model.model.layers) == layers


def test_layer_cache_view_writes_its_own_entry_whatever_index_it_is_given():
    model = relay_hf.patch(tiny_model("llama", num_hidden_layers=2), min_prefix_length=8)
    ids, mask = _batch(24, (3, 5), seed=5)
    cache = relay_hf.RelayCache.from_prefix(model, ids[0, :24].unsqueeze(0))
    view = LayerCacheView(cache, 1)
    assert view.entry is cache.layers[1] and view.get_seq_length() == cache.get_seq_length()
    calls = []
    cache.update_layer = lambda entry, k, v: calls.append(entry) or (k, v)
    view.update(torch.zeros(1), torch.zeros(1), 0)
    assert calls == [cache.layers[1]]


def test_region_functions_are_distinct_code_objects():
    """Each model (and compile settings) compiles its own copy, so two models never share one code object's graphs
    and recompile limit."""
    a, b = region_function(), region_function()
    assert a.__code__ is not b.__code__ and a(lambda *x, **k: (x, k), (1,), {"z": 2}) == ((1,), {"z": 2})


def test_decode_view_of_a_path_replaces_only_that_list():
    model = relay_hf.patch(tiny_model("qwen3", num_hidden_layers=2), min_prefix_length=8)
    path, layers = decoder_layers(model)
    cache = relay_hf.RelayCache.from_prefix(model, torch.arange(3, 27).unsqueeze(0))
    view = decode_view(model, path, cache, region=lambda layer, args, kwargs: layer(*args, **kwargs))
    assert view.model.norm is model.model.norm and view.config is model.config
    assert view.model.layers[0].self_attn is layers[0].self_attn  # attributes read through the wrapper
    assert model.model.layers is layers


def test_cpu_auto_decode_compiles_nothing():
    """``compiled_by_default`` holds on CUDA for 16-bit models only: on CPU the default loop stays uncompiled."""
    from relay_hf.loop_rules import compiled_by_default

    model = relay_hf.patch(tiny_model("llama").to(torch.bfloat16), min_prefix_length=8)
    assert not compiled_by_default(model)


@pytest.mark.gpu
def test_on_cuda_the_default_16bit_step_is_one_compiled_region_captured_for_every_bucket():
    model = relay_hf.patch(tiny_model("llama", num_hidden_layers=4).to("cuda", torch.bfloat16), min_prefix_length=8)
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, VOCAB, (48,), generator=g)
    for rows in (3, 6):
        ids, mask = left_pad([torch.cat([prefix, torch.randint(3, VOCAB, (n + 2,), generator=g)])
                              for n in range(rows)])
        model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=8, do_sample=False)
        step = relay_state(model).idle_static().stepper
        assert model.relay_last_decision.fast_decode and step.compiled and step.runner is not model
        assert type(step.state).__name__ == "Captured"
    regions = relay_state(model)._regions
    assert len(regions) == 1


def test_a_region_that_fails_after_some_layers_ran_puts_their_positions_back():
    """Gemma 2 alternates sliding and full layers: two graphs. A backend that compiles the first and fails on the
    second fails the step after layer 0 wrote its keys; the eager rerun must not write them twice."""
    from tests.helpers import TYPE_PREFIX, tiny_model_of_type, type_batch

    model = tiny_model_of_type("gemma2")
    ids, mask, pad = type_batch(model)
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=pad)
    stock = model.generate(ids, **gen)
    seen = []

    def second_fails(gm, example_inputs):
        seen.append(gm)
        if len(seen) >= 2:
            raise RuntimeError("this layer variant does not compile")
        return gm.forward

    config = CompileConfig(backend=second_fails, mode=None)
    config._compile_all_devices = True
    relay_hf.patch(model, min_prefix_length=TYPE_PREFIX)
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="compiling the decode step failed"):
        out = model.generate(ids, compile_config=config, **gen)
    assert len(seen) == 2 and torch.equal(out, stock)
    ends = {int(layer.end) for layer in relay_state(model).idle_static().cache.layers}
    assert len(ends) == 1  # every layer holds the same number of positions


def test_decoder_layers_takes_the_text_decoder_not_a_vision_tower():
    """Gemma 3's vision encoder layers are also named in ``_no_split_modules``; a tower deeper than the decoder must
    not be taken for it (its layers name no cache entry)."""
    import transformers

    from tests.helpers import tiny_config

    config = tiny_config("gemma3")
    config.vision_config.num_hidden_layers = config.text_config.num_hidden_layers + 1
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path, layers = decoder_layers(model)
    assert len(layers) == config.text_config.num_hidden_layers and "vision" not in ".".join(path)


def test_decoder_layers_declines_a_model_whose_forward_is_replaced_on_the_instance():
    """accelerate's hooks set ``forward`` on the instance, bound to the module itself: a shallow copy would call the
    original layers, uncompiled."""
    model = tiny_model("llama")
    original = model.model.forward
    model.model.forward = lambda *args, **kwargs: original(*args, **kwargs)
    assert decoder_layers(model) is None
