"""Relay attention ops: the public entry point and its dispatch between the Triton kernel and the PyTorch reference."""

from __future__ import annotations

import torch

from .reference import default_scale, relay_attention_torch

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_ok() -> bool:
    try:
        from .triton_relay import triton_available
    except ImportError:
        return False
    return triton_available()


_EAGER_KERNEL = None  # relay_attention_triton once an eager CUDA call found Triton usable, False if it cannot run


def _eager_kernel():
    global _EAGER_KERNEL
    if _EAGER_KERNEL is None:
        if _triton_ok():
            from .triton_relay import relay_attention_triton

            _EAGER_KERNEL = relay_attention_triton
        else:
            _EAGER_KERNEL = False
    return _EAGER_KERNEL


def _plain_eager(*tensors: torch.Tensor | None) -> bool:
    """Nothing records this call: no ``torch.compile`` trace, no dispatch mode (``make_fx``, fake tensors), plain
    tensors, no autograd. Then the kernels may launch directly; otherwise the custom op keeps the call visible."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    grad = torch.is_grad_enabled()
    return all(t is None or (type(t) is torch.Tensor and not (grad and t.requires_grad)) for t in tensors)


def triton_serves(dtype: torch.dtype, head_dim: int, value_head_dim: int, scale: float | None) -> bool:
    """The Triton kernels compute this call exactly (given CUDA tensors): fp16/bf16/fp32, one head dim for keys and
    values (MLA's ``D_v != D`` runs the reference), a non-empty head dim and a positive scale (the kernels fold it into
    ``exp2`` after the row max)."""
    return (dtype in _TRITON_DTYPES and head_dim == value_head_dim and head_dim > 0
            and (scale is None or scale > 0))


def relay_attention(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                    suffix_key: torch.Tensor, suffix_value: torch.Tensor, *, scale: float | None = None,
                    suffix_lengths: torch.Tensor | None = None, suffix_end: torch.Tensor | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None, window: int | None = None
                    ) -> torch.Tensor:
    """Exact attention of a batch over ONE shared prefix plus each row's own suffix.

    Args:
        query: ``[B, H_q, L_q, D]``. The ``L_q`` queries are the last ``L_q`` suffix positions of each row.
        prefix_key: ``[1, H_kv, P, D]``, prefix_value: ``[1, H_kv, P, D_v]``: the shared system-prompt KV, a single
            copy (``P`` may be 0).
        suffix_key: ``[B, H_kv, L_s, D]``, suffix_value: ``[B, H_kv, L_s, D_v]``, left-padded: row ``b``'s valid
            tokens are its last ``suffix_lengths[b]`` positions. ``D_v`` may differ from ``D`` (MLA: DeepSeek-V3,
            MiniCPM3).
        scale: softmax scale, ``D ** -0.5`` when ``None``.
        suffix_lengths: ``[B]`` integer tensor on the query's device, each in ``[0, end]``, or ``None`` when every
            suffix position is valid.
        suffix_end: one-element integer tensor on the query's device in ``[L_q, L_s]``, or ``None``. For static
            (preallocated, CUDA-graph friendly) suffix buffers: only the first ``end`` positions are filled, the
            queries are positions ``end - L_q ... end - 1`` and ``suffix_lengths`` counts the valid positions ending
            at ``end``. Read on the device, so a captured graph replays correctly as ``end`` grows.

        softcap: every score becomes ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2), or ``None``.
        sinks: ``[H_q]`` floating point, one logit per query head that joins the softmax denominator once with no
            value (gpt-oss), or ``None``.
        window: a sliding window: a query at absolute position ``t`` (the prefix holds positions ``0 .. P - 1``, a
            row's valid suffix tokens the next ones) sees only keys at positions ``> t - window``, so its prefix part
            covers ``[max(0, t - window + 1), P)``; ``None``: no window.

    Every query sees the whole prefix and, causally, the valid part of its own suffix (both within ``window``).
    ``H_q`` must be a multiple of ``H_kv`` (GQA). All tensors share one dtype (fp16, bf16, fp32 or fp64) and device.
    Shapes, dtypes and devices are checked always (``ValueError`` naming the argument); the values of
    ``suffix_lengths`` and ``suffix_end`` only where that costs no host sync (CPU tensors, eager): on CUDA they are
    the caller's contract, and out of range the kernels still read nothing outside the buffers.

    Returns:
        ``[B, H_q, L_q, D_v]`` in ``query.dtype`` (empty when ``B``, ``H_q``, ``L_q`` or ``D_v`` is 0). A query that
        sees no key at all (``P == 0`` and an empty row) gets zeros, never NaN.

    CUDA tensors go to the Triton kernels when ``relay_hf.kernels.triton_relay`` can run them (``triton_serves``);
    everything else (CPU, fp64, ``D_v != D``, a non-positive ``scale``, and for now ``softcap``, ``sinks`` and
    ``window``) runs the PyTorch reference, whose numerics the kernels are tested against. Eager CUDA calls launch
    the kernels directly; under ``torch.compile``, or with inputs that require grad, they go through the custom op
    ``torch.ops.relay_hf.relay_attention``.
    """
    options = softcap is not None or sinks is not None or window is not None  # the reference's alone, for now
    if query.is_cuda and not options and triton_serves(query.dtype, query.shape[-1], prefix_value.shape[-1], scale):
        kernel_scale = default_scale(query.shape[-1]) if scale is None else float(scale)
        if not _plain_eager(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end):
            if _triton_ok():
                from .op import relay_attention_op

                return relay_attention_op(query, prefix_key, prefix_value, suffix_key, suffix_value, kernel_scale,
                                          suffix_lengths, suffix_end)
        elif _eager_kernel():
            # the same kernels without the custom op's dispatch, which costs more host time than the whole launch
            # (docs/performance.md)
            return _EAGER_KERNEL(query, prefix_key, prefix_value, suffix_key, suffix_value, scale=kernel_scale,
                                 suffix_lengths=suffix_lengths, suffix_end=suffix_end)
    return relay_attention_torch(query, prefix_key, prefix_value, suffix_key, suffix_value, scale=scale,
                                 suffix_lengths=suffix_lengths, suffix_end=suffix_end, softcap=softcap, sinks=sinks,
                                 window=window)


__all__ = ["relay_attention", "relay_attention_torch", "triton_serves"]
