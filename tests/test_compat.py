"""The few places where transformers versions differ: answered by looking at the installed version."""

import inspect

import torch
from transformers import GenerationConfig

from relay_hf import _compat
from tests.helpers import tiny_model


def test_cache_keyword_is_the_one_forward_takes():
    model = tiny_model("llama")
    name = _compat.cache_kwarg_name(model)
    assert name in inspect.signature(model.base_model.forward).parameters


def test_generation_config_resolution_is_stocks():
    model = tiny_model("qwen2")
    model.generation_config.top_k = 7
    gen, model_kwargs = _compat.resolve_generation_config(model, GenerationConfig(temperature=0.5),
                                                          {"max_new_tokens": 3, "attention_mask": torch.ones(1, 2)})
    assert (gen.top_k, gen.temperature, gen.max_new_tokens) == (7, 0.5, 3)
    assert "attention_mask" in model_kwargs and model.generation_config.max_new_tokens is None


def test_attention_implementations_are_found_by_name():
    model = tiny_model("llama")
    assert _compat.attn_implementation(model.config) == "sdpa" and _compat.can_set_attn_implementation(model)
    assert _compat.registered_mask("sdpa") is not None and _compat.registered_mask("no such thing") is None
    attention = model.model.layers[0].self_attn
    assert _compat.eager_attention_function(attention).__module__ == type(attention).__module__
