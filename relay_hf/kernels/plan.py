"""``RelayPlan``: everything a relay call needs besides its tensors, built once per step layout and run per layer
(FlashInfer's ``plan()`` / ``run()``).

A step's layers share one layout: the shapes, dtypes and devices of the query, prefix and suffix, the prefix strides
(TMA), which of ``suffix_lengths`` / ``suffix_end`` / ``sinks`` / ``softcap`` / ``window`` / prefix groups the call
has, and the ``KernelConfig``. ``plan_relay`` validates that layout once, builds its plan (launch layout, scratch
shapes, grids and constexprs of each launch, TMA descriptor cache, compiled-kernel cache) and keeps it by ``plan_key``;
every later call with the same layout gets the same plan. A caller that knows the step's layout may also keep the
plan and call ``run`` per layer, with no lookup at all.

Tensors (``relay_hf.relay_attention``'s contract): ``query [B, H_q, L_q, D]``, ``prefix_* [1, H_kv, P, D]`` (shared:
one copy for the batch, or the packed segments of ``PrefixGroups``), ``suffix_* [B, H_kv, L_s, D]`` (per row,
left-padded), ``suffix_lengths [B]`` int or None, ``suffix_end [1]`` int or None, ``sinks [H_q]`` float or None; the
output is ``[B, H_q, L_q, D]`` in the query's dtype. Scratch per call: partials ``[slots, H_kv, N, D]`` (``N =
B*G*L_q``; the input dtype for fp16/bf16 with ``partial_half``, else fp32) and their natural-log fp32 LSEs ``[slots,
H_kv, N]``.
"""

from __future__ import annotations

import torch

from .config import KernelConfig, resolve_config
from .device import hopper, interpreting, num_sms
from .direct import can_reuse
from .groups import GroupTables, PrefixGroups
from .jit import KIND_BOTH, KIND_PREFIX, KIND_SUFFIX, LOG2E
from .launch import KernelLaunches
from .layout import LaunchLayout, block_d, cdiv, group_shape, next_power_of_2, plan_layout
from .reference import check_prefix_groups, check_relay_inputs, check_relay_options, check_relay_values, default_scale
from .tma import PrefixDescriptors

MAX_PLANS = 512  # plans kept (a dynamic cache grows L_s by one a step: one plan per step, not per layer)


def plan_key(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end,
             config: KernelConfig, groups: tuple[int, int] | None, softcap: float | None, window: int | None,
             sinks: torch.Tensor | None) -> tuple:
    """Every fact a plan and the input checks depend on: shapes, dtypes and devices of all tensors, the prefix
    strides (TMA), the options as far as the launch depends on them (``groups``: ``(levels, segments per level)``;
    whether there is a softcap; the window; the sinks' dtype) and the config. The other tensors' strides are launch
    arguments, not plan inputs."""
    return (query.shape, query.dtype, query.device, prefix_key.shape, prefix_key.dtype, prefix_key.device,
            prefix_key.stride(), prefix_value.shape, prefix_value.dtype, prefix_value.device, prefix_value.stride(),
            suffix_key.shape, suffix_key.dtype, suffix_key.device, suffix_value.shape, suffix_value.dtype,
            suffix_value.device,
            None if suffix_lengths is None else (suffix_lengths.shape, suffix_lengths.dtype, suffix_lengths.device),
            None if suffix_end is None else (suffix_end.shape, suffix_end.dtype, suffix_end.device),
            groups, softcap is not None, window or 0, None if sinks is None else sinks.dtype, config)


_PLANS: dict[tuple, RelayPlan] = {}


def plan_relay(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor, suffix_key: torch.Tensor,
               suffix_value: torch.Tensor, *, suffix_lengths: torch.Tensor | None = None,
               suffix_end: torch.Tensor | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
               window: int | None = None, prefix_groups: PrefixGroups | GroupTables | None = None,
               config: KernelConfig | None = None) -> RelayPlan:
    """The plan of calls laid out as these tensors and options (``relay_attention``'s arguments; ``config``: ``None``
    for the active one): the kept one if a call of this layout was planned before (``plan_key``), else a new one,
    kept. Raises ``ValueError`` naming what does not fit the Triton kernels' contract."""
    config = resolve_config(config)
    check_relay_options(query, softcap, sinks, window)
    if prefix_groups is None:
        groups = None
    else:
        if not isinstance(prefix_groups, GroupTables):
            check_prefix_groups(prefix_groups, query.shape[0], prefix_key.shape[2])  # anything else: refused by name
        groups = group_shape(prefix_groups)
    key = plan_key(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end, config,
                   groups, softcap, window, sinks)
    plan = _PLANS.get(key)
    if plan is None:
        plan = RelayPlan(key, query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end,
                         config, groups, softcap is not None, window or 0, sinks is not None)
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return plan


def cached_plans() -> list[RelayPlan]:
    """The plans ``plan_relay`` keeps now, oldest first."""
    return list(_PLANS.values())


class RelayPlan:
    """One layout's validated sizes, launch layout, scratch shapes, launches and descriptor cache (module docstring).
    Built by ``plan_relay``; ``run`` computes one call. Attributes read by callers: ``layout`` (``LaunchLayout``),
    ``config``, ``descriptors`` (``PrefixDescriptors``), ``key`` (its ``plan_key``)."""

    def __init__(self, key: tuple, query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths,
                 suffix_end, config: KernelConfig, groups: tuple[int, int] | None, softcap: bool, window: int,
                 sink: bool):
        check_relay_inputs(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end)
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
        # the result [B, H_q, L_q, D], laid out as the transpose of a contiguous [B, L_q, H_q, D] buffer (so the HF
        # seam's transpose(1, 2).contiguous() is free): allocated with these strides in one call
        self.result_shape = (B, H_q, L_q, D)
        self.out_strides = torch.empty((B, L_q, H_q, D), device="meta").transpose(1, 2).stride()
        self.empty = N * D == 0
        self.check_values = query.device.type == "cpu"  # value checks cost no sync only there (check_relay_values)
        self.L_q, self.L_s, self.default_scale = L_q, L_s, default_scale(D)
        if self.empty:
            return
        device_index = query.device.index or 0
        self.layout = layout = plan_layout(B, N, G, L_q, P, L_s, H_kv, D, config.num_sms or num_sms(device_index),
                                           query.is_cuda and hopper(device_index), config, groups)
        bd = block_d(D)
        half = config.partial_half and query.dtype in (torch.float16, torch.bfloat16)
        self.po_shape = (max(layout.slots, 1), H_kv, N, D)  # partial outputs [slots, H_kv, N, D]
        self.po_dtype = query.dtype if half else torch.float32
        self.plse_shape = (max(layout.slots, 1), H_kv, N)  # their natural-log fp32 LSEs [slots, H_kv, N]
        self.pk_st, self.pv_st = prefix_key.stride()[1:], prefix_value.stride()[1:]  # [H_kv, P, D]
        self.dims = (N, P, L_q, L_s, G, D)
        self.prefix_plan = (layout.p_blocks, layout.p_splits, layout.p_per, layout.p_slots)
        self.suffix_plan = (layout.s_blocks, layout.s_splits, layout.s_per)
        self.table_shape = (layout.prefix[0], G * L_q, layout.p_blocks)  # a grouped call's tables (PrefixGroups.tables)
        self.merge_sizes = (N, L_q, G, D, layout.slots)
        self.descriptors = PrefixDescriptors(prefix_key, prefix_value, layout.prefix[1], bd, config)
        constexprs = dict(HAS_LENS=suffix_lengths is not None, HAS_END=suffix_end is not None, BLOCK_D=bd,
                          IEEE=query.dtype == torch.float32, GROUPED=groups is not None, SOFTCAP=softcap,
                          WINDOW=window, SINK=sink)
        # the CPU interpreter's tl.dot cannot multiply bf16 (numpy has no bf16): upcast there, only there
        interpreted = interpreting()
        constexprs["DOT_F32"] = query.dtype == torch.bfloat16 and interpreted
        self.launches = KernelLaunches(_partials_launches(layout, H_kv, constexprs),
                                       _merge_launch(layout, N, H_kv, bd, config, sink),
                                       config.reuse_compiled and can_reuse() and not interpreted)

    def run(self, query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
            suffix_key: torch.Tensor, suffix_value: torch.Tensor, *, scale: float | None = None,
            suffix_lengths: torch.Tensor | None = None, suffix_end: torch.Tensor | None = None,
            softcap: float | None = None, sinks: torch.Tensor | None = None,
            prefix_groups: PrefixGroups | GroupTables | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """One call: ``[B, H_q, L_q, D]`` in the query's dtype (into ``out`` when given; by default the transpose of a
        contiguous ``[B, L_q, H_q, D]`` buffer). The tensors and options must be laid out as the ones the plan was
        made for (the same ``plan_key``); ``relay_attention_triton`` looks the plan up by it, a caller holding a step's
        plan answers for it. ``scale``: the softmax scale (> 0), ``D ** -0.5`` when ``None``."""
        if self.check_values:
            check_relay_values(self.L_q, self.L_s, suffix_lengths, suffix_end)
        if scale is None:
            scale = self.default_scale
        elif not scale > 0:  # the kernels fold the scale into exp2 after the row max, which needs scale > 0
            raise ValueError(f"the Triton relay kernel needs scale > 0, got {scale}; use relay_attention_torch")
        # with a softcap the scale goes inside the cap and the capped scores are natural-log logits
        scale_log2, cap, cap_scale = ((LOG2E, float(softcap), scale / softcap) if softcap is not None
                                      else (scale * LOG2E, 0.0, 0.0))
        if out is None:
            out = torch.empty_strided(self.result_shape, self.out_strides, dtype=self.dtype, device=self.device)
        elif out.shape != self.result_shape or out.dtype != self.dtype or out.device != self.device:
            raise ValueError(f"out must be a {self.dtype} {list(self.result_shape)} tensor on {self.device}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        if self.empty:
            return out
        po = torch.empty(self.po_shape, dtype=self.po_dtype, device=self.device)
        plse = torch.empty(self.plse_shape, dtype=torch.float32, device=self.device)
        kd, vd = self.descriptors.get(prefix_key, prefix_value)
        tma = kd is not None
        q_st, sk_st, sv_st, o_st = query.stride(), suffix_key.stride(), suffix_value.stride(), out.stride()
        lens = plse if suffix_lengths is None else suffix_lengths  # placeholders, never read when absent
        end = plse if suffix_end is None else suffix_end
        if prefix_groups is None:
            items = rows = row_prefix = plse
        elif isinstance(prefix_groups, GroupTables):
            items, rows, row_prefix = prefix_groups.items, prefix_groups.rows, prefix_groups.row_prefix
        else:
            items, rows, row_prefix = prefix_groups.tables(self.device, *self.table_shape)
        sink = plse if sinks is None else sinks
        # _partials_kernel's runtime arguments, in jit.PARTIALS_PARAMS order
        args = (query, prefix_key, prefix_value, kd, vd, suffix_key, suffix_value, lens, end, po, plse, out, items,
                rows, row_prefix, sink, q_st, self.pk_st, self.pv_st, sk_st, sv_st, o_st, self.dims, scale_log2, cap,
                cap_scale, self.prefix_plan, self.suffix_plan)
        # _merge_kernel's, in jit.MERGE_PARAMS order
        merge_args = None if self.launches.merge is None else (po, plse, out, sink, o_st, *self.merge_sizes)
        reuse_key = tma_key = None
        if self.launches.reuse:
            # Triton specialises a kernel on its arguments' values (a unit stride, multiples of 16, 16-byte aligned
            # pointers): the plan key fixes all but the strides and alignment of these tensors, so those are this key;
            # scratch (po, plse, and plse as every placeholder) comes from the caching allocator, always aligned
            ptrs = (query.data_ptr() | prefix_key.data_ptr() | prefix_value.data_ptr() | suffix_key.data_ptr()
                    | suffix_value.data_ptr() | out.data_ptr())
            if suffix_lengths is not None:
                ptrs |= suffix_lengths.data_ptr()
            if suffix_end is not None:
                ptrs |= suffix_end.data_ptr()
            if prefix_groups is not None:
                ptrs |= items.data_ptr() | rows.data_ptr() | row_prefix.data_ptr()
            if sinks is not None:
                ptrs |= sinks.data_ptr()
            if ptrs % 16 == 0:
                reuse_key = (torch.cuda.current_device(), tma, q_st, sk_st, sv_st, o_st)
                tma_key = (prefix_key.data_ptr(), prefix_value.data_ptr()) if tma else None
        self.launches.launch(args, merge_args, tma, reuse_key, tma_key)
        return out

    def fits(self, query, prefix_key, prefix_value, suffix_key, suffix_value, *, suffix_lengths=None,
             suffix_end=None, softcap=None, sinks=None, window=None, prefix_groups=None) -> bool:
        """Whether a call with these arguments is laid out as this plan's (``run`` may compute it)."""
        groups = None if prefix_groups is None else group_shape(prefix_groups)
        return self.key == plan_key(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths,
                                    suffix_end, self.config, groups, softcap, window, sinks)


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


__all__ = ["MAX_PLANS", "RelayPlan", "cached_plans", "plan_key", "plan_relay"]
