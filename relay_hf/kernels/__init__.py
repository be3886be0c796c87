"""Relay attention ops: the public entry point and its dispatch between the Triton kernel and the PyTorch reference."""

from __future__ import annotations

import torch

from .groups import GroupTables, PrefixGroups
from .reference import check_prefix_groups, default_scale, relay_attention_torch

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_ok() -> bool:
    try:
        from .device import triton_available
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


def pin_tables(groups: PrefixGroups, prefix_key: torch.Tensor, prefix_value: torch.Tensor, rows: int,
               group_size: int, buffers: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...] | None:
    """Write the Triton kernels' work tables of ``groups`` into int32 buffers on the prefix's device, in place, and
    make ``groups`` read them from now on: CUDA graphs captured on these buffers replay with the layout written last.

    Args:
        groups: the layout of this call's ``rows`` rows. ``prefix_key`` / ``prefix_value``: ``[1, H_kv, P, D]``
            (their dtype, head dims and device pick the launch shape). ``group_size``: query heads per KV head.
        buffers: the tables pinned for the previous call of the same cache (reused when their shapes still fit).

    Returns the buffers, or ``None`` where the kernels would not run this call (no Triton, or a dtype / head dim
    they do not serve): then there is nothing to pin."""
    from .config import active_config
    from .device import triton_available
    from .layout import grouped_launch_shape

    D = prefix_key.shape[3]
    if not triton_available() or not triton_serves(prefix_key.dtype, D, prefix_value.shape[3], None):
        return None
    block_m, items = grouped_launch_shape(rows * group_size, D, groups, active_config())
    shapes = ((items, 7), (groups.depth * rows,), (rows,))
    if buffers is None or tuple(t.shape for t in buffers) != shapes:
        buffers = tuple(torch.zeros(s, dtype=torch.int32, device=prefix_key.device) for s in shapes)
    groups.pin(prefix_key.device, block_m, group_size, items, buffers)
    return buffers


def relay_attention(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                    suffix_key: torch.Tensor, suffix_value: torch.Tensor, *, scale: float | None = None,
                    suffix_lengths: torch.Tensor | None = None, suffix_end: torch.Tensor | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None, window: int | None = None,
                    prefix_groups: PrefixGroups | GroupTables | None = None) -> torch.Tensor:
    """Exact attention of a batch over shared prefix KV, read once per batch, plus each row's own suffix.

    Args:
        query: ``[B, H_q, L_q, D]``. The ``L_q`` queries are the last ``L_q`` suffix positions of each row.
        prefix_key: ``[1, H_kv, P, D]``, prefix_value: ``[1, H_kv, P, D_v]``: the shared KV, a single copy (``P``
            may be 0). Without ``prefix_groups`` every row reads all of it; with them it packs their segments.
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
        window: a sliding window: a query at absolute position ``t`` (a row's prefix holds positions ``0 .. P_b -
            1``, its valid suffix tokens the next ones) sees only keys at positions ``> t - window``, so its prefix
            part covers ``[max(0, t - window + 1), P_b)``; ``None``: no window.
        prefix_groups: several shared prefixes in one batch (``PrefixGroups``): the segments packed in
            ``prefix_key`` and, per row, the segments it reads (its path: a system prompt, then maybe a document
            shared by some of that prompt's rows), each segment read once per batch for all its rows; ``None``:
            one prefix for every row. Inside a ``torch.compile`` region on CUDA pass the ``GroupTables`` built
            ahead instead (``PrefixGroups.tables`` at ``triton_relay.grouped_launch_shape``): a compiled graph
            cannot build them.

    Every query sees its prefix and, causally, the valid part of its own suffix (both within ``window``). ``H_q``
    must be a multiple of ``H_kv`` (GQA). All tensors share one dtype (fp16, bf16, fp32 or fp64) and device.
    Shapes, dtypes and devices are checked always (``ValueError`` naming the argument); the values of
    ``suffix_lengths`` and ``suffix_end`` only where that costs no host sync (CPU tensors, eager): on CUDA they are
    the caller's contract, and out of range the kernels still read nothing outside the buffers.

    Returns:
        ``[B, H_q, L_q, D_v]`` in ``query.dtype`` (empty when ``B``, ``H_q``, ``L_q`` or ``D_v`` is 0). A query that
        sees no key at all (no prefix and an empty row) gets zeros, never NaN.

    CUDA tensors go to the Triton kernels when ``relay_hf.kernels.triton_relay`` can run them (``triton_serves``);
    everything else (CPU, fp64, ``D_v != D``, a non-positive ``scale``) runs the PyTorch reference, whose numerics the
    kernels are tested against. Eager CUDA calls launch the kernels directly; under ``torch.compile``, or with inputs
    that require grad, they go through the custom op ``torch.ops.relay_hf.relay_attention``.
    """
    if query.is_cuda and triton_serves(query.dtype, query.shape[-1], prefix_value.shape[-1], scale):
        kernel_scale = default_scale(query.shape[-1]) if scale is None else float(scale)
        if not _plain_eager(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end,
                            sinks):
            if _triton_ok():
                from .op import relay_attention_op

                tables = _tables_for_op(query, suffix_key.shape[1], prefix_key.shape[2], prefix_groups)
                return relay_attention_op(query, prefix_key, prefix_value, suffix_key, suffix_value, kernel_scale,
                                          suffix_lengths, suffix_end, softcap, sinks, window, *tables)
        elif _eager_kernel():
            # the same kernels without the custom op's dispatch, which costs more host time than the whole launch
            # (docs/performance.md)
            return _EAGER_KERNEL(query, prefix_key, prefix_value, suffix_key, suffix_value, scale=kernel_scale,
                                 suffix_lengths=suffix_lengths, suffix_end=suffix_end, softcap=softcap, sinks=sinks,
                                 window=window, prefix_groups=prefix_groups)
    return relay_attention_torch(query, prefix_key, prefix_value, suffix_key, suffix_value, scale=scale,
                                 suffix_lengths=suffix_lengths, suffix_end=suffix_end, softcap=softcap, sinks=sinks,
                                 window=window, prefix_groups=prefix_groups)


def _tables_for_op(query: torch.Tensor, H_kv: int, P: int, groups: PrefixGroups | GroupTables | None) -> tuple:
    """The custom op's group arguments: ``(items, rows, row_prefix, [levels, segments])`` for this call's launch
    shape, or four ``None``."""
    if groups is None:
        return None, None, None, None
    if isinstance(groups, GroupTables):
        return groups.items, groups.rows, groups.row_prefix, [groups.depth, groups.segments]
    if torch.compiler.is_compiling():
        raise ValueError("inside torch.compile, pass prefix_groups as the GroupTables built ahead "
                         "(PrefixGroups.tables at triton_relay.grouped_launch_shape): a compiled graph cannot build "
                         "them, and would replay one call's layout for every later call")
    from .config import active_config
    from .layout import grouped_launch_shape

    check_prefix_groups(groups, query.shape[0], P)
    B, H_q, L_q, D = query.shape
    folded = H_q // max(1, H_kv) * L_q
    block_m, items = grouped_launch_shape(B * folded, D, groups, active_config())
    return (*groups.tables(query.device, block_m, folded, items), [groups.depth, groups.segments_per_level])


__all__ = ["GroupTables", "PrefixGroups", "relay_attention", "relay_attention_torch", "triton_serves"]
