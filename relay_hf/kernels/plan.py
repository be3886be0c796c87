"""``RelayPlan``: everything a relay call needs besides its tensors, planned once per step and run per layer
(FlashInfer's ``plan()`` / ``run()``).

``plan_for(step, options, tensors)`` is the plan of one step's layout (``metadata.StepMetadata``) with one module's
``options.AttentionOptions``: the first layer of the step plans, the step keeps the plan (``StepMetadata.plans``),
its later layers find it there; ``RelayPlan.run`` then takes tensors only. A layout is the shapes, dtypes and devices
of the query, prefix and suffix, the prefix strides (TMA), which extents and prefix groups the step has, the options'
``key`` and the ``KernelConfig``: ``plan_relay`` validates it once, builds its launch layout, scratch shapes, grids
and constexprs of each launch, TMA descriptor cache and compiled-kernel cache, and keeps them by ``plan_key`` for the
next step of that layout (and for callers that hold no step: the free functions, the custom op).

Tensors (``relay_hf.relay_attention``'s contract): ``query [B, H_q, L_q, D]``, ``prefix_* [1, H_kv, P, D]`` (shared:
one copy for the batch, or the packed segments of ``PrefixGroups``), ``suffix_* [B, H_kv, L_s, D]`` (per row,
left-padded), ``suffix_lengths [B]`` int or None, ``suffix_end [1]`` int or None, ``sinks [H_q]`` float or None; the
output is ``[B, H_q, L_q, D]`` in the query's dtype. Scratch per call: partials ``[slots, H_kv, N, D]`` (``N =
B*G*L_q``; the input dtype for fp16/bf16 with ``partial_half``, else fp32) and their natural-log fp32 LSEs ``[slots,
H_kv, N]``.
"""

from __future__ import annotations

import copy

import torch

from .config import KernelConfig, active_config, resolve_config
from .device import hopper, interpreting, num_sms
from .direct import can_reuse
from .groups import GroupTables, PrefixGroups
from .jit import KIND_BOTH, KIND_PREFIX, KIND_SUFFIX
from .launch import KernelLaunches
from .layout import LaunchLayout, block_d, cdiv, group_shape, launch_layout, next_power_of_2
from .metadata import StepMetadata
from .options import AttentionOptions
from .reference import check_prefix_groups, check_relay_inputs, check_relay_values, default_scale
from .tma import PrefixDescriptors

MAX_PLANS = 512  # layouts kept (a dynamic cache grows L_s by one a step: one layout per step, not per layer)


def plan_key(step: StepMetadata, options: AttentionOptions, query, prefix_key, prefix_value, suffix_key, suffix_value,
             config: KernelConfig) -> tuple:
    """Every fact a plan and the input checks depend on: shapes, dtypes and devices of all tensors, the prefix
    strides (TMA), the step's layout as far as the launch depends on it (which extents it has, the groups'
    ``(levels, segments per level)``), the options' ``key`` and the config. The other tensors' strides are launch
    arguments, not plan inputs."""
    groups = None if step.groups is None else group_shape(step.groups)
    return (*_shapes(query, prefix_key, prefix_value, suffix_key, suffix_value), *_extents(step), groups, options.key,
            config)


# layouts planned so far, for the first layer of each step and for callers that hold no step (the free functions,
# the custom op): planning a layout costs far more than finding it (docs/performance.md, host rows)
_LAYOUTS: dict[tuple, RelayPlan] = {}


def plan_relay(step: StepMetadata, options: AttentionOptions, query: torch.Tensor, prefix_key: torch.Tensor,
               prefix_value: torch.Tensor, suffix_key: torch.Tensor, suffix_value: torch.Tensor,
               config: KernelConfig | None = None) -> RelayPlan:
    """The plan of a call on ``step``'s layout with ``options`` and these tensors (``relay_attention``'s contract;
    ``config``: ``None`` for the active one), its group tables bound to ``step.groups``. A layout planned before
    (``plan_key``) is reused with this step's tables bound. Raises ``ValueError`` naming what does not fit the
    Triton kernels' contract."""
    config = resolve_config(config)
    options.check(query)
    if step.groups is not None and not isinstance(step.groups, GroupTables):
        check_prefix_groups(step.groups, query.shape[0], prefix_key.shape[2])  # anything else: refused by name
    key = plan_key(step, options, query, prefix_key, prefix_value, suffix_key, suffix_value, config)
    plan = _LAYOUTS.get(key)
    if plan is None:
        plan = RelayPlan(key, step, options, query, prefix_key, prefix_value, suffix_key, suffix_value, config)
        if len(_LAYOUTS) >= MAX_PLANS:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[key] = plan
    return plan.bind(step.groups)


def plan_for(step: StepMetadata, options: AttentionOptions, query: torch.Tensor, prefix_key: torch.Tensor,
             prefix_value: torch.Tensor, suffix_key: torch.Tensor, suffix_value: torch.Tensor) -> RelayPlan:
    """The plan of a call with these options and tensors on ``step``'s layout: the one an earlier layer of the step
    made, when the tensors are laid out as its own (``RelayPlan.fits``), else ``plan_relay``'s, kept in
    ``step.plans`` for the layers after (a step without ``plans`` keeps nothing: ``plan_relay``'s plan)."""
    config = active_config()
    plans = step.plans
    if plans is None:
        return plan_relay(step, options, query, prefix_key, prefix_value, suffix_key, suffix_value, config)
    key = options.key
    plan = plans.get(key)
    if plan is None or not plan.fits(step, config, query, prefix_key, prefix_value, suffix_key, suffix_value):
        plan = plans[key] = plan_relay(step, options, query, prefix_key, prefix_value, suffix_key, suffix_value,
                                       config)
    elif plan.tables is not None and query.is_cuda and torch.cuda.is_current_stream_capturing():
        # a graph replays the group tables it records: only pinned ones will do (PrefixGroups.tables refuses others
        # while capturing), and tables pinned after this plan was bound replace the ones it holds
        plan = plans[key] = plan.bind(step.groups, again=True)
    return plan


def cached_plans() -> list[RelayPlan]:
    """The layouts ``plan_relay`` keeps now, oldest first."""
    return list(_LAYOUTS.values())


class RelayPlan:
    """One layout's validated sizes, launch layout, scratch shapes, launches and descriptor cache (module docstring),
    bound to one step's group tables. Built by ``plan_relay``; ``run`` computes one call from tensors only.
    Attributes read by callers: ``layout`` (``LaunchLayout``), ``config``, ``descriptors`` (``PrefixDescriptors``),
    ``key`` (its ``plan_key``)."""

    def __init__(self, key: tuple, step: StepMetadata, options: AttentionOptions, query, prefix_key, prefix_value,
                 suffix_key, suffix_value, config: KernelConfig):
        lengths, end = step.suffix_lengths, step.suffix_end
        check_relay_inputs(query, prefix_key, prefix_value, suffix_key, suffix_value, lengths, end)
        B, H_q, L_q, D = query.shape
        H_kv, L_s, P, D_v = suffix_key.shape[1], suffix_key.shape[2], prefix_key.shape[2], suffix_value.shape[-1]
        if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"the Triton relay kernels take fp16, bf16 or fp32, got {query.dtype}; use "
                             "relay_attention (which runs the reference for others)")
        if D_v != D:
            raise ValueError(f"the Triton relay kernels need the value head dim D_v={D_v} to equal the key head dim "
                             f"D={D}; relay_attention routes such calls to the reference")
        G, N = H_q // H_kv, B * (H_q // H_kv) * L_q
        self.config, self.key = config, key
        self.dtype, self.device = query.dtype, query.device
        self.scalars = options.kernel_scalars(default_scale(D))  # (scale_log2, cap, cap_scale)
        # what ``fits`` compares: the tensors' layout as far as a later call of the same step may differ from it
        self.shapes = _shapes(query, prefix_key, prefix_value, suffix_key, suffix_value)
        self.extents = _extents(step)
        # the result [B, H_q, L_q, D], laid out as the transpose of a contiguous [B, L_q, H_q, D] buffer: allocated
        # with these strides in one call, or (``run(hf_layout=True)``, the HF seam) that buffer itself, taken as it is
        self.result_shape, self.buffer_shape = (B, H_q, L_q, D), (B, L_q, H_q, D)
        self.out_strides = torch.empty(self.buffer_shape, device="meta").transpose(1, 2).stride()
        self.empty = N * D == 0
        self.check_values = query.device.type == "cpu"  # value checks cost no sync only there (check_relay_values)
        self.L_q, self.L_s = L_q, L_s
        self.groups = self.tables = None  # bound by ``bind``
        if self.empty:
            return
        device_index = query.device.index or 0
        groups = None if step.groups is None else group_shape(step.groups)
        self.layout = layout = launch_layout(B, N, G, L_q, P, L_s, H_kv, D, config.num_sms or num_sms(device_index),
                                             query.is_cuda and hopper(device_index), config, groups)
        bd = block_d(D)
        half = config.partial_half and query.dtype in (torch.float16, torch.bfloat16)
        self.po_shape = (max(layout.slots, 1), H_kv, N, D)  # partial outputs [slots, H_kv, N, D]
        self.po_dtype = query.dtype if half else torch.float32
        self.plse_shape = (max(layout.slots, 1), H_kv, N)  # their natural-log fp32 LSEs [slots, H_kv, N]
        self.pk_st, self.pv_st = prefix_key.stride()[1:], prefix_value.stride()[1:]  # [H_kv, P, D]
        self.dims = (N, P, L_q, L_s, G, D)
        self.prefix_work = (layout.p_blocks, layout.p_splits, layout.p_per, layout.p_slots)
        self.suffix_work = (layout.s_blocks, layout.s_splits, layout.s_per)
        self.table_shape = (layout.prefix[0], G * L_q, layout.p_blocks)  # a grouped call's tables (PrefixGroups.tables)
        self.merge_sizes = (N, L_q, G, D, layout.slots)
        self.descriptors = PrefixDescriptors(prefix_key, prefix_value, layout.prefix[1], bd, config)
        constexprs = dict(HAS_LENS=lengths is not None, HAS_END=end is not None, BLOCK_D=bd,
                          IEEE=query.dtype == torch.float32, GROUPED=groups is not None, **options.constexprs())
        # the CPU interpreter's tl.dot cannot multiply bf16 (numpy has no bf16): upcast there, only there
        interpreted = interpreting()
        constexprs["DOT_F32"] = query.dtype == torch.bfloat16 and interpreted
        self.launches = KernelLaunches(_partials_launches(layout, H_kv, constexprs),
                                       _merge_launch(layout, N, H_kv, bd, config, options.sinks is not None),
                                       config.reuse_compiled and can_reuse() and not interpreted)

    def __deepcopy__(self, memo):  # a copied cache shares its plans: launches and compiled kernels are not copied
        return self

    def bind(self, groups: PrefixGroups | GroupTables | None, again: bool = False) -> RelayPlan:
        """This layout's plan reading ``groups``' device tables (found here, once: ``PrefixGroups.tables`` keeps
        them, or hands the buffers a static cache pinned; ``again``: found anew even for the groups bound now). The
        launches, descriptors and compiled kernels stay shared with every plan of the layout."""
        if groups is self.groups and (groups is None or self.tables is not None) and not again:
            return self
        bound = copy.copy(self)
        bound.groups = groups
        if groups is None or self.empty:
            bound.tables = None
        elif isinstance(groups, GroupTables):
            bound.tables = (groups.items, groups.rows, groups.row_prefix)
        else:
            bound.tables = groups.tables(self.device, *self.table_shape)
        return bound

    def fits(self, step: StepMetadata, config: KernelConfig, query, prefix_key, prefix_value, suffix_key,
             suffix_value) -> bool:
        """Whether a call of ``step`` with these tensors may run this plan: a later layer of the step this plan was
        made for, laid out alike (shapes, strides of the prefix, dtypes, devices), on the same groups and config. A
        step's layers share their extents' dtypes and devices, so those are not compared again."""
        return ((config is self.config or config == self.config) and step.groups is self.groups
                and self.extents == _extents(step)
                and self.shapes == _shapes(query, prefix_key, prefix_value, suffix_key, suffix_value))

    def run(self, query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
            suffix_key: torch.Tensor, suffix_value: torch.Tensor, suffix_lengths: torch.Tensor | None = None,
            suffix_end: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
            out: torch.Tensor | None = None, *, hf_layout: bool = False) -> torch.Tensor:
        """One call: ``[B, H_q, L_q, D]`` in the query's dtype (into ``out`` when given; by default the transpose of a
        contiguous ``[B, L_q, H_q, D]`` buffer; ``hf_layout`` and no ``out``: that buffer itself, the layout an HF
        attention function returns, with no transposed view made). The tensors must be laid out as the ones the
        plan was made for (the same ``plan_key``; the caller holding the plan answers for it): ``suffix_lengths`` /
        ``suffix_end`` the step's extents (``StepMetadata``), ``sinks`` the options' sinks."""
        if self.check_values:
            check_relay_values(self.L_q, self.L_s, suffix_lengths, suffix_end)
        scale_log2, cap, cap_scale = self.scalars
        if out is not None:
            if hf_layout:
                raise ValueError("RelayPlan.run: out is [B, H_q, L_q, D]; hf_layout asks for a buffer of its own")
            if out.shape != self.result_shape or out.dtype != self.dtype or out.device != self.device:
                raise ValueError(f"out must be a {self.dtype} {list(self.result_shape)} tensor on {self.device}, "
                                 f"got {out.dtype} {tuple(out.shape)} on {out.device}")
            o_st = out.stride()
        else:  # the kernels write [B, H_q, L_q, D] through the strides of the buffer's transpose: only its address
            o_st = self.out_strides
            out = (torch.empty(self.buffer_shape, dtype=self.dtype, device=self.device) if hf_layout else
                   torch.empty_strided(self.result_shape, o_st, dtype=self.dtype, device=self.device))
        if self.empty:
            return out
        po = torch.empty(self.po_shape, dtype=self.po_dtype, device=self.device)
        plse = torch.empty(self.plse_shape, dtype=torch.float32, device=self.device)
        prefix_at = prefix_key.data_ptr(), prefix_value.data_ptr()  # read once: for the descriptors and the reuse key
        kd, vd = self.descriptors.get(prefix_key, prefix_value, prefix_at)
        tma = kd is not None
        q_st, sk_st, sv_st = query.stride(), suffix_key.stride(), suffix_value.stride()
        lens = plse if suffix_lengths is None else suffix_lengths  # placeholders, never read when absent
        end = plse if suffix_end is None else suffix_end
        items, rows, row_prefix = (plse, plse, plse) if self.tables is None else self.tables
        sink = plse if sinks is None else sinks
        # _partials_kernel's runtime arguments, in jit.PARTIALS_PARAMS order
        args = (query, prefix_key, prefix_value, kd, vd, suffix_key, suffix_value, lens, end, po, plse, out, items,
                rows, row_prefix, sink, q_st, self.pk_st, self.pv_st, sk_st, sv_st, o_st, self.dims, scale_log2, cap,
                cap_scale, self.prefix_work, self.suffix_work)
        # _merge_kernel's, in jit.MERGE_PARAMS order
        merge_args = None if self.launches.merge is None else (po, plse, out, sink, o_st, *self.merge_sizes)
        reuse_key = tma_key = None
        if self.launches.reuse:
            # Triton specialises a kernel on its arguments' values (a unit stride, multiples of 16, 16-byte aligned
            # pointers): the plan key fixes all but the strides and alignment of these tensors, so those are this key;
            # scratch (po, plse, and plse as every placeholder) comes from the caching allocator, always aligned
            ptrs = (query.data_ptr() | prefix_at[0] | prefix_at[1] | suffix_key.data_ptr() | suffix_value.data_ptr()
                    | out.data_ptr())
            for t in (suffix_lengths, suffix_end, sinks):
                if t is not None:
                    ptrs |= t.data_ptr()
            if self.tables is not None:
                ptrs |= items.data_ptr() | rows.data_ptr() | row_prefix.data_ptr()
            if ptrs % 16 == 0:
                reuse_key = (torch.cuda.current_device(), tma, q_st, sk_st, sv_st, o_st)
                tma_key = prefix_at if tma else None
        self.launches.launch(args, merge_args, tma, reuse_key, tma_key)
        return out


def _shapes(query, prefix_key, prefix_value, suffix_key, suffix_value) -> tuple:
    """The facts of a call's tensors in ``plan_key`` (and what ``RelayPlan.fits`` compares: a later layer of the step
    differs in none of them, or plans anew, its inputs checked again): shapes, dtypes, devices, the prefix strides."""
    return (query.shape, query.dtype, query.device, prefix_key.shape, prefix_key.dtype, prefix_key.device,
            prefix_key.stride(), prefix_value.shape, prefix_value.dtype, prefix_value.device, prefix_value.stride(),
            suffix_key.shape, suffix_key.dtype, suffix_key.device, suffix_value.shape, suffix_value.dtype,
            suffix_value.device)


def _extents(step: StepMetadata) -> tuple:
    """The step's extents as ``plan_key`` holds them: shape, dtype and device of each, or ``None``."""
    lengths, end = step.suffix_lengths, step.suffix_end
    return (None if lengths is None else (lengths.shape, lengths.dtype, lengths.device),
            None if end is None else (end.shape, end.dtype, end.device))


def _partials_launches(layout: LaunchLayout, H_kv: int, constexprs: dict) -> list[tuple[tuple[int, int, int], dict]]:
    """``(grid, constexprs)`` of each ``_partials_kernel`` launch of ``layout`` (``jit.py``, 1. and 3.)."""
    (block_mp, block_n, warps, stages), (block_ms, block_ns, warps_s, stages_s) = layout.prefix, layout.suffix
    constexprs = dict(constexprs, BLOCK_MP=block_mp, BLOCK_MS=block_ms, PDL=layout.pdl)
    if not layout.sep:
        return [((layout.p_units + layout.s_units, H_kv, 1),
                 dict(constexprs, BLOCK_N=block_n, KIND=KIND_BOTH, FUSE=0, num_warps=warps, num_stages=stages))]
    launches = [((layout.p_units, H_kv, 1), dict(constexprs, BLOCK_N=block_n, KIND=KIND_PREFIX, FUSE=0,
                                                 num_warps=warps, num_stages=stages))] if layout.p_units else []
    launches.append(((layout.s_units, H_kv, 1), dict(constexprs, BLOCK_N=block_ns, KIND=KIND_SUFFIX,
                                                     FUSE=layout.fuse_slots, num_warps=warps_s, num_stages=stages_s,
                                                     launch_pdl=layout.pdl, PAIR=layout.pair)))
    return launches


def _merge_launch(layout: LaunchLayout, N: int, H_kv: int, bd: int, config: KernelConfig,
                  sink: bool) -> tuple[tuple[int, int, int], dict] | None:
    """``(grid, constexprs)`` of the ``_merge_kernel`` launch, or ``None`` where the suffix launch merges."""
    if layout.fuse:
        return None
    tile, merge_warps = config.merge_tile
    block_s = next_power_of_2(layout.slots)
    rows = max(1, tile // block_s)
    return ((cdiv(N, rows), H_kv, 1), dict(BLOCK_R=rows, BLOCK_S=block_s, BLOCK_D=bd, SINK=sink,
                                           num_warps=merge_warps))


__all__ = ["MAX_PLANS", "RelayPlan", "cached_plans", "plan_for", "plan_key", "plan_relay"]
