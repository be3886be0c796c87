"""Relay attention ops: the public entry point and its dispatch between the Triton kernel and the PyTorch reference."""

from __future__ import annotations

import torch

from .reference import relay_attention_torch


def _triton_ok() -> bool:
    try:
        from .triton_relay import triton_available
    except ImportError:
        return False
    return triton_available()


def relay_attention(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                    suffix_key: torch.Tensor, suffix_value: torch.Tensor, *, scale: float | None = None,
                    suffix_lengths: torch.Tensor | None = None, suffix_end: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Exact attention of a batch over ONE shared prefix plus each row's own suffix.

    Args:
        query: ``[B, H_q, L_q, D]``. The ``L_q`` queries are the last ``L_q`` suffix positions of each row.
        prefix_key, prefix_value: ``[1, H_kv, P, D]``: the shared system-prompt KV, a single copy (``P`` may be 0).
        suffix_key, suffix_value: ``[B, H_kv, L_s, D]``, left-padded: row ``b``'s valid tokens are its last
            ``suffix_lengths[b]`` positions.
        scale: softmax scale, ``D ** -0.5`` when ``None``.
        suffix_lengths: ``[B]`` integer tensor, or ``None`` when every suffix position is valid.
        suffix_end: one-element integer tensor, or ``None``. For static (preallocated, CUDA-graph friendly) suffix
            buffers: only the first ``end`` positions are filled, the queries are positions ``end - L_q ...
            end - 1`` and ``suffix_lengths`` counts the valid positions ending at ``end``. Read on the device, so a
            captured graph replays correctly as ``end`` grows.

    Every query sees the whole prefix and, causally, the valid part of its own suffix. ``H_q`` must be a multiple
    of ``H_kv`` (GQA). All tensors share one dtype (fp16, bf16, fp32 or fp64) and device.

    Returns:
        ``[B, H_q, L_q, D]`` in ``query.dtype``. A query that sees no key at all (``P == 0`` and an empty row)
        gets zeros, never NaN.

    CUDA tensors go to the Triton kernels when ``relay_hf.kernels.triton_relay`` can run them; everything else
    (CPU, fp64, a non-positive ``scale``) runs the PyTorch reference, whose numerics the kernels are tested against.
    """
    if query.is_cuda and query.dtype != torch.float64 and (scale is None or scale > 0) and _triton_ok():
        from .op import relay_attention_op

        scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
        return relay_attention_op(query, prefix_key, prefix_value, suffix_key, suffix_value, scale, suffix_lengths,
                                  suffix_end)
    return relay_attention_torch(query, prefix_key, prefix_value, suffix_key, suffix_value,
                                 scale=scale, suffix_lengths=suffix_lengths, suffix_end=suffix_end)


__all__ = ["relay_attention", "relay_attention_torch"]
