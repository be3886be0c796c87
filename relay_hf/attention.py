"""The HF seam: an attention function and a mask function registered under the name ``"relay"``.

A patched model stays on ``"relay"`` for good; every forward decides from what it is handed, never from per-call
switches of the model's settings (so concurrent calls on one model cannot disturb each other):

* ``relay_attention_forward`` (``AttentionInterface``) runs relay attention when the cache hands it
  ``RelayKV(prefix, suffix)`` pairs (a ``RelayCache``), and otherwise is exactly the model's own implementation (the
  one it had before ``patch``: sdpa, eager, flash...; sdpa for a model that was never patched). The module's logit
  softcap, attention sinks and sliding window go to ``relay_attention`` as they are.
* ``relay_mask`` (``AttentionMaskInterface``) builds exactly the own implementation's mask. Only for a layer of a
  dynamic ``RelayCache`` (the one cache whose ``kv_offset`` is a ``RelayOffset``), full or sliding, it returns a
  ``RelayMask`` instead: ``suffix_lengths``, each row's valid (non-pad) suffix tokens. A static
  ``RelayCache`` carries its rows' extents with its keys and reports no mask positions (``kv_length == 0``): no mask
  is built, so a compiled decode step has no mask work.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.utils import is_torchdynamo_compiling

from ._compat import attn_implementation, eager_attention_function, registered_attention, registered_mask
from .kernels import relay_attention
from .layers import RelayKV, RelayOffset
from .names import ATTN_NAME, RELAY_NAMES, STOCK_OF

DEFAULT_STOCK = "sdpa"
# id(config) -> an implementation no relay name says (a hub kernel, or a sub-config's own); entries die with it
_STOCK: dict[int, str] = {}


def relay_name(stock: str | None) -> str:
    """The registered name a model whose own implementation is ``stock`` runs under once patched."""
    return RELAY_NAMES.get(stock or DEFAULT_STOCK, ATTN_NAME)


def model_configs(model) -> list:
    """Every config object the model's modules read their attention implementation from."""
    seen = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and attn_implementation(config) is not None:
            seen.setdefault(id(config), config)
    return list(seen.values())


def set_stock_implementation(config, name: str | None) -> None:
    """Remember ``name`` as what relay runs for ``config`` without a relay prefix, where the config's relay name
    does not say it (``None``: forget)."""
    key = id(config)
    if name is None or STOCK_OF.get(attn_implementation(config)) == name:
        _STOCK.pop(key, None)
        return
    if key not in _STOCK:
        weakref.finalize(config, _STOCK.pop, key, None)
    _STOCK[key] = name


def stock_implementation(config) -> str:
    if id(config) in _STOCK:
        return _STOCK[id(config)]
    return STOCK_OF.get(attn_implementation(config), DEFAULT_STOCK)


@dataclass
class RelayMask:
    """What attention layers receive as ``attention_mask`` on a dynamic ``RelayCache``.

    Attributes:
        suffix_lengths: ``[B]`` int32 count of valid kv positions from ``kv_offset`` on (left padding), or ``None``
            when nothing is padded.
    """

    suffix_lengths: torch.Tensor | None


def _stock_mask(name: str, **kwargs):
    fn = sdpa_mask if name == DEFAULT_STOCK else registered_mask(name)
    return None if fn is None else fn(**kwargs)


def relay_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None, **kwargs):
    """``AttentionMaskInterface`` entry: the own implementation's mask, or a ``RelayMask`` for a ``RelayCache``."""
    if kv_length == 0:  # a static RelayCache: its keys carry every row's extent
        return None
    name = stock_implementation(kwargs.get("config"))
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    # no relay prefix in front of these keys (a stock sliding-window layer reports an offset too, once its window is
    # full: only a RelayCache's offset is a RelayOffset)
    if not isinstance(kv_offset, RelayOffset):
        return _stock_mask(name, **args)
    # a relay prefix (a sliding layer too: relay attention applies the window itself, by each row's positions)
    suffix_lengths = None
    if attention_mask is not None:
        if not is_torchdynamo_compiling() and not bool(attention_mask[:, :kv_offset].all()):
            raise ValueError("rows are padded in front of the RelayCache's shared prefix: relay attention needs the "
                             "prefix at the start of every row; call relay_hf.patch(model) (its generate reorders "
                             "left-padded rows) or pass rows without padding")
        suffix_lengths = attention_mask[:, kv_offset:kv_offset + kv_length].sum(-1, dtype=torch.int32)
    return RelayMask(suffix_lengths)


def _stock_attention(module, query, key, value, attention_mask, **kwargs):
    """Exactly the model's own attention implementation (what stock transformers runs for this module)."""
    name = stock_implementation(getattr(module, "config", None))
    if name == DEFAULT_STOCK:
        fn = sdpa_attention_forward
    elif name == "eager":
        fn = eager_attention_function(module)
    else:
        fn = registered_attention(name)
    return fn(module, query, key, value, attention_mask, **kwargs)


# attention-function arguments that change the result and that relay attention does not implement
_UNSERVED = ("attention_chunk_size", "alibi", "position_bias")


def _options(key: RelayKV, sliding_window, kwargs) -> dict:
    """``softcap`` / ``sinks`` / ``window`` for ``relay_attention``: the module's logit softcap (Gemma 2), its sinks
    (gpt-oss hands them as ``s_aux``), and its sliding window where it can exclude a key of these buffers (a window
    that holds every position changes nothing, and without it the kernels skip the window's bookkeeping). A static
    cache always gets the window: a captured step replays for later calls whose prefixes may be longer."""
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    window = None
    if sliding_window is not None:
        prefix = key.prefix.shape[-2] if key.groups is None else key.groups.max_prefix_length
        if key.end is not None or prefix + key.suffix.shape[-2] > sliding_window:
            window = sliding_window
    return dict(softcap=kwargs.get("softcap"), sinks=sinks, window=window)


def _check_relay_call(module, key: RelayKV, attention_mask, dropout: float, sliding_window, kwargs) -> None:
    """Refuse, by name, anything relay would compute differently from stock attention."""
    if dropout:
        raise ValueError("relay attention does not implement attention dropout; call model.eval()")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise ValueError("relay attention is causal; this attention module is not")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k in _UNSERVED)
    if unknown:
        raise ValueError(f"relay attention does not support `{unknown[0]}`; relay_hf.patch should have declined")
    trimmed = key.groups.window if key.groups is not None else None
    if trimmed is not None and sliding_window != trimmed:  # the dropped keys would be missing: refuse, never guess
        raise ValueError(f"this layer's RelayCache keeps only what a sliding window of {trimmed} tokens can see, "
                         f"but its attention now runs with sliding_window={sliding_window}; build the RelayCache "
                         "again for the model as it is")


def relay_attention_forward(module: torch.nn.Module, query: torch.Tensor, key, value, attention_mask,
                            dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                            **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``AttentionInterface`` entry.

    Args:
        query: ``[B, H_q, L_q, D]``.
        key, value: ``RelayKV(prefix [1, H_kv, P, D], suffix [B, H_kv, L_s, D], ...)`` from a ``RelayCache`` (with
            the ``PrefixGroups`` of several prefixes), or plain ``[B, H_kv, L, D]`` tensors (then this is the model's
            own implementation).
        attention_mask: with a ``RelayCache`` that does not carry its rows' extents, a ``RelayMask`` or ``None``
            (ignored when it does); the own implementation's mask otherwise.

    Returns:
        ``([B, L_q, H_q, D], weights or None)`` like every HF attention function.
    """
    if not isinstance(key, RelayKV):
        if sliding_window is not None:
            kwargs["sliding_window"] = sliding_window
        return _stock_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                **kwargs)
    _check_relay_call(module, key, attention_mask, dropout, sliding_window, kwargs)
    if key.lengths is not None or key.end is not None:  # the cache knows its rows' layout: extents travel with it
        suffix_lengths = key.lengths
    elif isinstance(attention_mask, RelayMask):
        suffix_lengths = attention_mask.suffix_lengths
    elif attention_mask is None:
        suffix_lengths = None
    else:
        raise ValueError("relay attention cannot read the rows' padding from this attention mask (a custom mask, or a "
                         "sliding-window model): pass the RelayCache to a relay_hf.patch'ed model's generate, which "
                         "lays the rows out")
    out = relay_attention(query, key.prefix, value.prefix, key.suffix, value.suffix, scale=scaling,
                          suffix_lengths=suffix_lengths, suffix_end=key.end, prefix_groups=key.groups,
                          **_options(key, sliding_window, kwargs))  # [B, H_q, L_q, D_v]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"relay"`` (and its names for non-sdpa models) with transformers' attention and mask interfaces
    (idempotent)."""
    for name in STOCK_OF:
        AttentionInterface.register(name, relay_attention_forward)
        AttentionMaskInterface.register(name, relay_mask)


register()
