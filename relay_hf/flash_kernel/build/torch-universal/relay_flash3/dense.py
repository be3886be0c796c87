"""``flash_attn_func``: flash-attention 2's batched attention (equal lengths per batch), as packed varlen.

transformers calls it for a forward outside continuous batching under this kernel's name (a ``generate`` call while
a manager serves the model): ``q [B, L_q, H_q, D]``, ``k``/``v [B, L_k, H_kv, D]`` -> ``[B, L_q, H_q, D]`` in
``q``'s dtype, ``causal`` bottom-right aligned. Padded batches reach ``flash_attn_varlen_func`` instead (transformers
unpads them).
"""

from __future__ import annotations

import torch

from .varlen import flash_attn_varlen_func


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, s_aux=None, **kwargs):
    """``q [B, L_q, H_q, D]``, ``k``/``v [B, L_k, H_kv, D]``; options as ``flash_attn_varlen_func`` takes them."""
    if q.dim() != 4 or k.dim() != 4 or k.shape[:2] != v.shape[:2] or q.shape[0] != k.shape[0]:
        raise ValueError(f"expected q [B, L_q, H_q, D] and k, v [B, L_k, H_kv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    batch, len_q, len_k = q.shape[0], q.shape[1], k.shape[1]
    steps = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    out = flash_attn_varlen_func(q.reshape(batch * len_q, *q.shape[2:]), k.reshape(batch * len_k, *k.shape[2:]),
                                 v.reshape(batch * len_k, *v.shape[2:]), steps * len_q, steps * len_k, len_q, len_k,
                                 dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 deterministic=deterministic, return_attn_probs=return_attn_probs, s_aux=s_aux)
    return out.view(batch, len_q, *out.shape[1:])
