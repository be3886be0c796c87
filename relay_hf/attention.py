"""The HF seam: an attention function and a mask function registered under the name ``"relay"``.

A patched model stays on ``"relay"`` for good; every forward decides from what it is handed, never from per-call
switches of the model's settings (so concurrent calls on one model cannot disturb each other):

* ``relay_attention_forward`` (``AttentionInterface``) runs relay attention when the cache hands it
  ``RelayKV(prefix, suffix)`` pairs (a ``RelayCache``), and otherwise is exactly the model's own implementation (the
  one it had before ``patch``: sdpa, eager, flash...; sdpa for a model that was never patched). The module's logit
  softcap, attention sinks and sliding window become its ``AttentionOptions`` (``module_options``, built once per
  module) and the cache's ``StepMetadata`` says where the rows are: ``kernels.attend`` runs them.
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
from .kernels import AttentionOptions, attend
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
# id(attention module) -> its AttentionOptions, built once and reused while it asks the same; entries die with the
# module (by id, as _STOCK: a weak-keyed lookup costs a weakref per call)
_OPTIONS: dict[int, AttentionOptions] = {}


def module_options(module: torch.nn.Module, scaling: float | None, sliding_window: int | None,
                   kwargs: dict) -> AttentionOptions:
    """The module's ``AttentionOptions``, from what its forward hands the attention function: ``scaling``, its
    sliding window, its logit softcap (Gemma 2 passes ``softcap``) and its sinks (gpt-oss passes them as ``s_aux``).
    Built once per module (not per call): a layer call compares four values and reuses the object, so the step's
    plans find it by its ``key``. Inside a compiled region it is built inline (dynamo traces it away)."""
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux", kwargs.get("sinks"))
    if is_torchdynamo_compiling():
        return AttentionOptions(scaling, softcap, sliding_window, sinks)
    key = id(module)
    options = _OPTIONS.get(key)
    if options is None or not options.same(scaling, softcap, sliding_window, sinks):
        if options is None:
            weakref.finalize(module, _OPTIONS.pop, key, None)
        options = _OPTIONS[key] = AttentionOptions(scaling, softcap, sliding_window, sinks)
    return options


def _step_options(options: AttentionOptions, key: RelayKV) -> AttentionOptions:
    """The options as this step's buffers need them: a sliding window only where it can exclude a key of these
    buffers (a window that holds every position changes nothing, and without it the kernels skip the window's
    bookkeeping). A static cache always gets the window: a captured step replays for later calls whose prefixes may be
    longer."""
    window, step = options.window, key.step
    if window is None or step.suffix_end is not None:
        return options
    prefix = key.prefix.shape[-2] if step.groups is None else step.groups.max_prefix_length
    return options if prefix + key.suffix.shape[-2] > window else options.without_window()


def _check_relay_call(module, key: RelayKV, dropout: float, sliding_window, kwargs) -> None:
    """Refuse, by name, anything relay would compute differently from stock attention."""
    if dropout:
        raise ValueError("relay attention does not implement attention dropout; call model.eval()")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise ValueError("relay attention is causal; this attention module is not")
    unknown = [k for k in _UNSERVED if kwargs.get(k) is not None]
    if unknown:
        raise ValueError(f"relay attention does not support `{min(unknown)}`; relay_hf.patch should have declined")
    groups = key.step.groups
    trimmed = groups.window if groups is not None else None
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
        key, value: ``RelayKV(prefix [1, H_kv, P, D], suffix [B, H_kv, L_s, D], step)`` from a ``RelayCache`` (the
            step's ``StepMetadata``: row extents, prefix groups, the plans its layers share), or plain
            ``[B, H_kv, L, D]`` tensors (then this is the model's own implementation).
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
    _check_relay_call(module, key, dropout, sliding_window, kwargs)
    step = key.step
    if step.suffix_lengths is None and step.suffix_end is None:  # the cache does not know its rows' extents
        if isinstance(attention_mask, RelayMask):
            step = step.with_lengths(attention_mask.suffix_lengths)
        elif attention_mask is not None:
            raise ValueError("relay attention cannot read the rows' padding from this attention mask (a custom mask, "
                             "or a sliding-window model): pass the RelayCache to a relay_hf.patch'ed model's "
                             "generate, which lays the rows out")
    options = _step_options(module_options(module, scaling, sliding_window, kwargs), key)
    # hf_layout (True): [B, L_q, H_q, D_v] contiguous, on the kernels' eager road their output buffer as it is
    return attend(step, options, query, key.prefix, value.prefix, key.suffix, value.suffix, True), None


def register() -> None:
    """Register ``"relay"`` (and its names for non-sdpa models) with transformers' attention and mask interfaces
    (idempotent)."""
    for name in STOCK_OF:
        AttentionInterface.register(name, relay_attention_forward)
        AttentionMaskInterface.register(name, relay_mask)


register()
