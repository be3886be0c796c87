"""The few places where transformers 5.17 .. 5.x differ for us, answered by looking, not by version numbers."""

from __future__ import annotations

import inspect
from functools import cache


@cache
def _forward_cache_name(forward_qualname: str, params: tuple[str, ...]) -> str:
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg_name(model) -> str:
    """The keyword under which ``model``'s forward (and generate) takes the cache.

    transformers 5.24 renamed ``past_key_values`` to ``cache``; the old name still works there but warns.
    """
    forward = model.base_model.forward
    return _forward_cache_name(forward.__qualname__, tuple(inspect.signature(forward).parameters))


def output_cache(output):
    """The cache carried by a generate/forward output, under whichever field name this version uses."""
    for name in ("cache", "past_key_values"):
        value = output.get(name) if hasattr(output, "get") else getattr(output, name, None)
        if value is not None:
            return value
    return None


# -- attention implementations ---------------------------------------------------------------------------------------
def attn_implementation(config) -> str | None:
    """The attention implementation a config selects (transformers keeps it in a private field)."""
    return getattr(config, "_attn_implementation", None)


def can_set_attn_implementation(model) -> bool:
    """Whether ``model`` routes attention through the ``AttentionInterface`` and lets it be switched."""
    return bool(getattr(model, "_supports_attention_backend", False)) and model._can_set_attn_implementation()


def registered_attention(name: str):
    """The attention function transformers registered under ``name``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def registered_mask(name: str):
    """The mask function transformers registered under ``name``, or ``None`` (that implementation builds none)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name)


@cache
def _eager_of(module_name: str):
    import sys

    fn = getattr(sys.modules.get(module_name), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{module_name} defines no eager_attention_forward; relay_hf cannot run its eager attention")
    return fn


def eager_attention_function(module):
    """The ``eager_attention_forward`` that ``module``'s modeling file uses when the model runs eager attention."""
    return _eager_of(type(module).__module__)


# -- generate ------------------------------------------------------------------------------------------------------
def resolve_generation_config(model, generation_config, kwargs: dict):
    """``(generation_config, model_kwargs)`` exactly as stock ``generate`` resolves them: user kwargs over the passed
    config over ``model.generation_config`` over the library defaults (a private method of ``GenerationMixin``)."""
    return model._prepare_generation_config(generation_config, **kwargs)


def logits_processors(model, generation_config, input_ids, attention_mask):
    """The ``LogitsProcessorList`` stock ``generate`` builds for this call (``input_ids`` / ``attention_mask``
    ``[B, T]`` in stock layout): its special-token tensors prepared on a copy of the config, then its processor
    list, through two private methods of ``GenerationMixin``."""
    import copy

    from transformers import LogitsProcessorList

    gen = copy.deepcopy(generation_config)
    model._prepare_special_tokens(gen, True, device=input_ids.device)
    return model._get_logits_processor(generation_config=gen, input_ids_seq_length=input_ids.shape[1],
                                       encoder_input_ids=input_ids, prefix_allowed_tokens_fn=None,
                                       logits_processor=LogitsProcessorList(), device=input_ids.device,
                                       model_kwargs={"attention_mask": attention_mask})


def compile_all_devices(compile_config) -> bool:
    """Whether a ``CompileConfig`` asks transformers to compile on every device, not only CUDA."""
    return bool(getattr(compile_config, "_compile_all_devices", False))


# -- pipelines -------------------------------------------------------------------------------------------------------
def chat_messages(item) -> list | None:
    """The messages of a chat as a text-generation pipeline item (transformers' internal ``Chat`` wrapper, or a plain
    list of ``{"role", "content"}`` dicts), or ``None`` when ``item`` is no chat."""
    from transformers.utils.chat_template_utils import Chat

    messages = item.messages if isinstance(item, Chat) else item
    if isinstance(messages, (list, tuple)) and messages and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        return list(messages)
    return None


def pipeline_chat(messages: list):
    """``messages`` wrapped as ``TextGenerationPipeline.preprocess`` expects a chat (the internal ``Chat`` class)."""
    from transformers.utils.chat_template_utils import Chat

    return Chat(messages)


# -- continuous batching ---------------------------------------------------------------------------------------------
def paged_attention_name() -> str:
    """The name continuous batching accepts for relay attention: ``paged|relay`` where transformers registers paged
    implementations under ``paged|`` names of their own (5.17), else a name that says "flash" (newer versions accept
    no other custom name; such a name builds no mask, which relay's paged attention does not need)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .names import PAGED_NAMES

    return PAGED_NAMES[0] if "paged|sdpa" in ALL_ATTENTION_FUNCTIONS._global_mapping else PAGED_NAMES[1]


def set_config_attn(config, name: str) -> None:
    """Select ``name`` on ``config`` directly (``set_attn_implementation`` refuses a flash-like name it cannot
    import a kernel for)."""
    config._attn_implementation = name


@cache
def masks_skip_paged_cache() -> bool:
    """Whether transformers' mask creation returns no mask for a continuous-batching cache whatever the attention
    name (newer versions), read from its source."""
    import inspect

    from transformers import masking_utils

    return "PagedAttentionCache" in inspect.getsource(masking_utils._preprocess_mask_arguments)


def cached_continuous_manager(model):
    """The continuous-batching manager transformers keeps on ``model`` for a later call (``persistent_manager``)."""
    return getattr(model, "_cached_continuous_batching_manager", None)


def paged_update(cache, module, key, value, kwargs: dict):
    """Write this step's KV into transformers 5.17's paged cache and read back what ``read_index`` lists (in 5.17 the
    attention function does this; newer versions do it in the attention layer). ``[1, H_kv, N, D]`` each."""
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                              read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    return key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)


def is_paged_cache(obj) -> bool:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return isinstance(obj, PagedAttentionCache)


# -- serving ---------------------------------------------------------------------------------------------------------
def serve_command():
    """transformers' ``transformers serve`` command class (its options are its constructor's parameters)."""
    from transformers.cli.serve import Serve

    return Serve


def serve_model_manager(serve):
    """The model manager a ``transformers serve`` command instance loads its models through."""
    return serve._model_manager
