"""Relay attention ops: the public entry point and its dispatch between the Triton kernel and the PyTorch reference."""

from __future__ import annotations

import contextlib
import contextvars

import torch

from .groups import GroupTables, PrefixGroups
from .metadata import StepMetadata
from .options import AttentionOptions, options_of
from .reference import check_prefix_groups, default_scale, relay_attention_torch

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# True inside ``reference_only()`` (per thread / task: another caller's calls keep their kernels)
_REFERENCE_ONLY = contextvars.ContextVar("relay_hf_reference_only", default=False)
# a free function's step when every row reads the whole prefix and all of its suffix (frozen, keeping no plans: one
# object serves every such call)
_WHOLE_ROWS = StepMetadata(None, None, None, None)


def _triton_ok() -> bool:
    try:
        from .device import triton_available
    except ImportError:
        return False
    return triton_available()


_PLAN_FOR = None  # plan.plan_for once an eager CUDA call found Triton usable (imported then), False if it cannot run


def _eager_planner():
    global _PLAN_FOR
    if _PLAN_FOR is None:
        if _triton_ok():
            from .plan import plan_for

            _PLAN_FOR = plan_for
        else:
            _PLAN_FOR = False
    return _PLAN_FOR


# what a plain eager call's tensor arguments are (gpt-oss hands its sinks over as the module's Parameter)
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter, type(None)))


def _plain_eager(*tensors: torch.Tensor | None) -> bool:
    """Nothing records this call: no ``torch.compile`` trace, no dispatch mode (``make_fx``, fake tensors), plain
    tensors, no autograd. Then the kernels may launch directly; otherwise the custom op keeps the call visible."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    if torch.is_grad_enabled():
        return all(t is None or (type(t) is torch.Tensor and not t.requires_grad) for t in tensors)
    return _PLAIN_TYPES.issuperset(map(type, tensors))  # no grad (generate, inference): the types alone


@contextlib.contextmanager
def reference_only():
    """Inside the block, eager calls of ``attend`` / ``relay_attention`` on this thread (this context) run the PyTorch
    reference on every device (compiled calls, relay's flash kernel and plans run directly are not affected). For
    ``relay_hf.patch``'s probe, which decides on the model's structure (is the KV handed over untouched, are the
    positions right) at a few tokens: on CUDA it would otherwise compile the Triton kernels for a head size they have
    not met (seconds) before ``patch`` returns; ``kernels.check`` asks whether they build and agree with the
    reference before the first relay call instead. The reference is the oracle the kernels are tested against."""
    token = _REFERENCE_ONLY.set(True)
    try:
        yield
    finally:
        _REFERENCE_ONLY.reset(token)


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
                    suffix_key: torch.Tensor, suffix_value: torch.Tensor, *,
                    suffix_lengths: torch.Tensor | None = None, suffix_end: torch.Tensor | None = None,
                    prefix_groups: PrefixGroups | GroupTables | None = None, **options) -> torch.Tensor:
    """Exact attention of a batch over shared prefix KV, read once per batch, plus each row's own suffix.

    Args:
        query: ``[B, H_q, L_q, D]``. The ``L_q`` queries are the last ``L_q`` suffix positions of each row.
        prefix_key: ``[1, H_kv, P, D]``, prefix_value: ``[1, H_kv, P, D_v]``: the shared KV, a single copy (``P``
            may be 0). Without ``prefix_groups`` every row reads all of it; with them it packs their segments.
        suffix_key: ``[B, H_kv, L_s, D]``, suffix_value: ``[B, H_kv, L_s, D_v]``, left-padded: row ``b``'s valid
            tokens are its last ``suffix_lengths[b]`` positions. ``D_v`` may differ from ``D`` (MLA: DeepSeek-V3,
            MiniCPM3).
        suffix_lengths: ``[B]`` integer tensor on the query's device, each in ``[0, end]``, or ``None`` when every
            suffix position is valid.
        suffix_end: one-element integer tensor on the query's device in ``[L_q, L_s]``, or ``None``. For static
            (preallocated, CUDA-graph friendly) suffix buffers: only the first ``end`` positions are filled, the
            queries are positions ``end - L_q ... end - 1`` and ``suffix_lengths`` counts the valid positions ending
            at ``end``. Read on the device, so a captured graph replays correctly as ``end`` grows.
        prefix_groups: several shared prefixes in one batch (``PrefixGroups``): the segments packed in
            ``prefix_key`` and, per row, the segments it reads (its path: a system prompt, then maybe a document
            shared by some of that prompt's rows), each segment read once per batch for all its rows; ``None``:
            one prefix for every row. Inside a ``torch.compile`` region on CUDA pass the ``GroupTables`` built
            ahead instead (``PrefixGroups.tables`` at ``layout.grouped_launch_shape``): a compiled graph cannot build
            them.
        options: the attention options, by name, as ``AttentionOptions`` takes them (``scale``: ``D ** -0.5`` when
            absent; a logit cap, sinks, a sliding window: ``options.AttentionOptions`` says what each does).

    Every query sees its prefix and, causally, the valid part of its own suffix (both within a window). ``H_q`` must
    be a multiple of ``H_kv`` (GQA). All tensors share one dtype (fp16, bf16, fp32 or fp64) and device. Shapes,
    dtypes and devices are checked always (``ValueError`` naming the argument); the values of ``suffix_lengths`` and
    ``suffix_end`` only where that costs no host sync (CPU tensors, eager): on CUDA they are the caller's contract,
    and out of range the kernels still read nothing outside the buffers.

    Returns:
        ``[B, H_q, L_q, D_v]`` in ``query.dtype`` (empty when ``B``, ``H_q``, ``L_q`` or ``D_v`` is 0). A query that
        sees no key at all (no prefix and an empty row) gets zeros, never NaN.

    CUDA tensors go to the Triton kernels when ``relay_hf.kernels.triton_relay`` can run them (``triton_serves``);
    everything else (CPU, fp64, ``D_v != D``, a non-positive ``scale``) runs the PyTorch reference, whose numerics the
    kernels are tested against. Eager CUDA calls launch the kernels directly; under ``torch.compile``, or with inputs
    that require grad, they go through the custom op ``torch.ops.relay_hf.relay_attention``.
    """
    # a call of its own: no holder keeps its plan (plans=None), which is its layout's (plan.plan_relay)
    if suffix_lengths is None and suffix_end is None and prefix_groups is None:
        step = _WHOLE_ROWS
    else:
        step = StepMetadata(suffix_lengths, suffix_end, prefix_groups, None)
    return attend(step, options_of(options), query, prefix_key, prefix_value, suffix_key, suffix_value)


def attend(step: StepMetadata, options: AttentionOptions, query: torch.Tensor, prefix_key: torch.Tensor,
           prefix_value: torch.Tensor, suffix_key: torch.Tensor, suffix_value: torch.Tensor,
           hf_layout: bool = False) -> torch.Tensor:
    """``relay_attention`` on a step's layout (``StepMetadata``) with a module's ``AttentionOptions``: what the HF
    glue calls once per layer. Eager CUDA calls run the step's plan (``plan.plan_for``: planned by the step's first
    layer, found in ``step.plans`` by the others); compiled or recorded calls go through the custom op; everything
    the kernels do not serve runs the reference. Tensors and result as in ``relay_attention``; ``hf_layout``: the
    result as an HF attention function returns it instead, ``[B, L_q, H_q, D_v]`` contiguous (on the kernels'
    eager road their output buffer itself, with no view made)."""
    # dynamo folds is_compiling() to True, so a traced call never reads the context variable (it cannot trace it)
    if (query.is_cuda and triton_serves(query.dtype, query.shape[-1], prefix_value.shape[-1], options.scale)
            and (torch.compiler.is_compiling() or not _REFERENCE_ONLY.get())):
        lengths, end = step.suffix_lengths, step.suffix_end
        if not _plain_eager(query, prefix_key, prefix_value, suffix_key, suffix_value, lengths, end, options.sinks):
            if _triton_ok():
                from .op import relay_attention_op

                options.check(query)  # the op's encoding reads a cap or window of 0 as none: refuse them first
                tables = _tables_for_op(query, suffix_key.shape[1], prefix_key.shape[2], step.groups)
                out = relay_attention_op(query, prefix_key, prefix_value, suffix_key, suffix_value,
                                         options.op_values(default_scale(query.shape[-1])), lengths, end,
                                         options.sinks, *tables)
                return out.transpose(1, 2).contiguous() if hf_layout else out
        elif _eager_planner():
            # the kernels without the custom op's dispatch, which costs more host time than the whole launch
            # (docs/performance.md)
            plan = _PLAN_FOR(step, options, query, prefix_key, prefix_value, suffix_key, suffix_value)
            return plan.run(query, prefix_key, prefix_value, suffix_key, suffix_value, lengths, end, options.sinks,
                            hf_layout=hf_layout)
    out = relay_attention_torch(query, prefix_key, prefix_value, suffix_key, suffix_value,
                                suffix_lengths=step.suffix_lengths, suffix_end=step.suffix_end,
                                prefix_groups=step.groups, **options.reference_kwargs())
    return out.transpose(1, 2).contiguous() if hf_layout else out


def _tables_for_op(query: torch.Tensor, H_kv: int, P: int, groups: PrefixGroups | GroupTables | None) -> tuple:
    """The custom op's group arguments: ``(items, rows, row_prefix, [levels, segments])`` for this call's launch
    shape, or four ``None``."""
    if groups is None:
        return None, None, None, None
    if isinstance(groups, GroupTables):
        return groups.items, groups.rows, groups.row_prefix, [groups.depth, groups.segments]
    if torch.compiler.is_compiling():
        raise ValueError("inside torch.compile, pass prefix_groups as the GroupTables built ahead "
                         "(PrefixGroups.tables at layout.grouped_launch_shape): a compiled graph cannot build "
                         "them, and would replay one call's layout for every later call")
    from .config import active_config
    from .layout import grouped_launch_shape

    check_prefix_groups(groups, query.shape[0], P)
    B, H_q, L_q, D = query.shape
    folded = H_q // max(1, H_kv) * L_q
    block_m, items = grouped_launch_shape(B * folded, D, groups, active_config())
    return (*groups.tables(query.device, block_m, folded, items), [groups.depth, groups.segments_per_level])


__all__ = ["AttentionOptions", "GroupTables", "PrefixGroups", "StepMetadata", "attend", "reference_only",
           "relay_attention", "relay_attention_torch", "triton_serves"]
