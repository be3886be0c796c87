"""``relay_hf.patch(model)`` / ``unpatch(model)``: batched ``generate`` that prefills a shared prefix once.

``patch`` switches the instance to the ``"relay"`` attention implementation (exactly sdpa whenever no relay prefix is
involved) and shadows that one instance's ``generate``. The wrapped ``generate``:

1. finds the longest common token prefix ``P`` of the left-padded rows (or takes the one of a ``RelayCache`` you
   pass),
2. prefills it once at batch 1 into a ``RelayCache`` (a fork of yours, which is never mutated),
3. permutes each row to ``[prefix | pads | suffix]`` and runs stock ``generate`` on that, so only the suffixes are
   prefilled and every decode step reads the prefix once per batch,
4. hands back ``sequences`` in the stock layout, with the ``RelayCache`` as the returned cache.

``cache_implementation="static"`` (or a ``compile_config``) gets a static, compileable ``RelayCache`` instead, so
transformers' compiled / CUDA-graph decode path runs the relay kernel (``generate.py``).

Whatever it cannot do exactly goes to stock ``generate`` with the reason in ``model.relay_last_decision``.
"""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass

from . import attention  # noqa: F401  (registers the "relay" implementation)
from .cache import ATTN_NAME
from .generate import RelayFallbackWarning, relay_generate

DEFAULT_MIN_PREFIX_LENGTH = 32
_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass
class _RelayState:
    original_attn: str
    min_prefix_length: int
    unsupported: str | None
    static_cache: object = None  # the last static RelayCache, refilled by the next call of the same shapes
    stepper: object = None  # the last decode step of relay_hf's loop (compiled, CUDA graph) on that cache


def unsupported_reason(model) -> str | None:
    """Why relay cannot be exact for this model (softcapping, sinks, ALiBi, exotic layers...), or ``None``."""
    config = model.config
    text = config.get_text_config(decoder=True)
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "attention logit softcapping is not implemented by relay attention"
    if getattr(text, "alibi", False) or getattr(text, "position_embedding_type", None) == "alibi":
        return "ALiBi position biases are not implemented by relay attention"
    if any(hasattr(m, "sinks") for m in model.modules()):
        return "attention sinks are not implemented by relay attention"
    if getattr(text, "attention_chunk_size", None) is not None:
        return "chunked attention is not implemented by relay attention"
    if not getattr(model, "_supports_attention_backend", False) or not model._can_set_attn_implementation():
        return f"{type(model).__name__} does not route attention through transformers' AttentionInterface"
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not layer_types <= _SUPPORTED_LAYER_TYPES:
        return f"layer types {sorted(layer_types - _SUPPORTED_LAYER_TYPES)} are not supported by relay attention"
    return None


def patch(model, *, min_prefix_length: int = DEFAULT_MIN_PREFIX_LENGTH):
    """Make batched ``model.generate`` use relay attention whenever its rows share a token prefix.

    Args:
        model: a transformers causal LM. Patched in place (this instance only) and returned.
        min_prefix_length: shortest common prefix (tokens) worth a separate prefill; shorter runs stock.

    A model relay cannot serve exactly (softcapping, sinks, ALiBi, chunked or linear attention...) keeps its
    attention; a ``RelayFallbackWarning`` says why and ``generate`` stays stock.
    """
    if "_relay_state" in model.__dict__:
        model._relay_state.min_prefix_length = min_prefix_length
        return model
    reason = unsupported_reason(model)
    model._relay_state = _RelayState(model.config._attn_implementation, min_prefix_length, reason)
    if reason is None:
        model.set_attn_implementation(ATTN_NAME)
    else:
        warnings.warn(f"relay_hf: {reason}; {type(model).__name__} keeps stock attention", RelayFallbackWarning,
                      stacklevel=2)
    model.relay_last_decision = None
    model.generate = types.MethodType(relay_generate, model)
    return model


def unpatch(model):
    """Undo ``patch``: the instance's own attention implementation and the class's ``generate`` come back."""
    state = model.__dict__.pop("_relay_state", None)
    if state is None:
        return model
    del model.generate
    model.__dict__.pop("relay_last_decision", None)
    if model.config._attn_implementation != state.original_attn:
        model.set_attn_implementation(state.original_attn)
    return model


def is_patched(model) -> bool:
    return "_relay_state" in model.__dict__
