"""The HF seam: an attention function and a mask function registered under the name ``"relay"``.

* ``relay_mask`` (``AttentionMaskInterface``) builds exactly what ``sdpa_mask`` builds for the sizes the cache
  reports, and adds ``suffix_lengths``: how many valid (non-pad) suffix tokens each row has. With a ``RelayCache``
  those sizes cover the suffix only (``kv_offset = P``), so the prefix never enters a mask.
* ``relay_attention_forward`` (``AttentionInterface``) runs relay attention when the cache handed it
  ``RelayKV(prefix, suffix)`` pairs, and is exactly ``sdpa_attention_forward`` otherwise (no cache, a
  ``DynamicCache``, a ``RelayCache`` without a prefix).
* ``"relay_static"`` is the same attention function with NO mask function: with a static (compileable)
  ``RelayCache`` the keys carry each row's filled extent on the device, so transformers builds no mask at all and the
  compiled decode step stays free of mask work. ``patch`` switches to it only for calls that use a static cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from .cache import ATTN_NAME, STATIC_ATTN_NAME, RelayKV
from .kernels import relay_attention


@dataclass
class RelayMask:
    """What every attention layer receives as ``attention_mask`` under the relay implementation.

    Attributes:
        dense: exactly what ``sdpa_mask`` returns for these sizes: ``[B, 1, L_q, kv_length]`` bool or ``None``.
        suffix_lengths: ``[B]`` int32 count of valid kv positions from ``kv_offset`` on (left padding), or ``None``
            when nothing is padded.
    """

    dense: torch.Tensor | None
    suffix_lengths: torch.Tensor | None


def relay_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None, **kwargs) -> RelayMask:
    """``AttentionMaskInterface`` entry: ``sdpa_mask`` plus per-row valid suffix lengths (one reduction per forward,
    shared by all layers)."""
    dense = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                      kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    suffix_lengths = None
    if attention_mask is not None:
        suffix_lengths = attention_mask[:, kv_offset:kv_offset + kv_length].sum(-1, dtype=torch.int32)
    return RelayMask(dense, suffix_lengths)


def _check_relay_call(module, key: RelayKV, attention_mask, dropout: float, sliding_window, kwargs) -> None:
    """Refuse, by name, anything relay would compute differently from stock attention."""
    if attention_mask is not None and not isinstance(attention_mask, RelayMask):
        raise ValueError("relay attention got a custom attention mask it cannot split into prefix and suffix; pass a "
                         "2D padding mask (or none) with a RelayCache")
    if dropout:
        raise ValueError("relay attention does not implement attention dropout; call model.eval()")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"relay attention does not support `{name}`; relay_hf.patch should have fallen back")
    total = key.prefix.shape[-2] + key.suffix.shape[-2]
    if sliding_window is not None and total > sliding_window:
        raise ValueError(f"sliding window of {sliding_window} tokens would exclude prefix tokens at length {total}; "
                         "relay attention is exact only while the whole sequence fits in the window")


def relay_attention_forward(module: torch.nn.Module, query: torch.Tensor, key, value, attention_mask,
                            dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry.

    Args:
        query: ``[B, H_q, L_q, D]``.
        key, value: ``RelayKV(prefix [1, H_kv, P, D], suffix [B, H_kv, L_s, D])`` from a ``RelayCache``, or plain
            ``[B, H_kv, L, D]`` tensors (then this is sdpa).
        attention_mask: a ``RelayMask`` from ``relay_mask`` (or a tensor / ``None`` on the sdpa path).

    Returns:
        ``([B, L_q, H_q, D], None)`` like every HF attention function.
    """
    if not isinstance(key, RelayKV):
        dense = attention_mask.dense if isinstance(attention_mask, RelayMask) else attention_mask
        return sdpa_attention_forward(module, query, key, value, dense, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    _check_relay_call(module, key, attention_mask, dropout, sliding_window, kwargs)
    if key.end is not None:  # static cache: extents travel with the keys
        suffix_lengths = key.lengths
    else:
        suffix_lengths = attention_mask.suffix_lengths if attention_mask is not None else None
    out = relay_attention(query, key.prefix, value.prefix, key.suffix, value.suffix, scale=scaling,
                          suffix_lengths=suffix_lengths, suffix_end=key.end)  # [B, H_q, L_q, D]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"relay"`` with transformers' attention and mask interfaces, ``"relay_static"`` with the attention
    interface only (idempotent)."""
    AttentionInterface.register(ATTN_NAME, relay_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, relay_mask)
    AttentionInterface.register(STATIC_ATTN_NAME, relay_attention_forward)


register()
