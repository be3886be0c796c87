"""Triton relay attention: the entry point ``relay_attention_triton`` (plan once per layout, run per layer).

The pieces, each its own module (imports only downward):

* ``config.py`` — ``KernelConfig``: every tunable in one frozen object; ``use_config`` / ``active_config``.
* ``layout.py`` — ``launch_layout``: which units run in which launch with which tiles (pure functions of sizes).
* ``jit.py`` — the Triton JIT kernels (the kernel design is its docstring).
* ``tma.py`` — TMA descriptors of the prefix and their cache by address.
* ``direct.py`` — the only code that touches Triton's internals: compiled kernels launched through their C launcher.
* ``launch.py`` — ``KernelLaunches``: one plan's launches, first through Triton, then directly.
* ``options.py`` — ``AttentionOptions``: a module's scale, logit cap, window and sinks, one frozen object.
* ``metadata.py`` — ``StepMetadata``: one step's row extents and prefix groups, and the plans its layers share.
* ``plan.py`` — ``RelayPlan`` (validated layout, scratch, launches, descriptors; ``run`` per call from tensors only),
  ``plan_for`` (a step's plan, kept by the step) and ``plan_relay`` (a layout's plan, kept by layout).

Every LSE that leaves a kernel is natural-log fp32. This module also re-exports the names other modules import from
it (``KernelConfig``, ``DEFAULT_CONFIG``, ``use_config``, ``active_config``, ``triton_available``,
``grouped_launch_shape``, ``prefix_split_count``, ...).
"""

from __future__ import annotations

import torch

from .config import DEFAULT_CONFIG, KernelConfig, active_config, use_config
from .device import triton_available
from .groups import GroupTables, PrefixGroups
from .layout import group_split_count, grouped_launch_shape, prefix_split_count, suffix_split_count
from .metadata import StepMetadata
from .options import AttentionOptions, options_of
from .plan import RelayPlan, cached_plans, plan_for, plan_relay


def relay_attention_triton(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                           suffix_key: torch.Tensor, suffix_value: torch.Tensor, *,
                           suffix_lengths: torch.Tensor | None = None, suffix_end: torch.Tensor | None = None,
                           prefix_groups: PrefixGroups | GroupTables | None = None, out: torch.Tensor | None = None,
                           config: KernelConfig | None = None, **options) -> torch.Tensor:
    """Triton relay attention; contract of ``relay_hf.relay_attention`` (fp16, bf16 or fp32; value head dim equal to
    the key head dim; ``scale > 0``), ``options`` by name as ``AttentionOptions`` takes them.

    ``prefix_groups``: a ``PrefixGroups`` (its device tables are built for this launch shape once and cached on it),
    or the ``GroupTables`` built ahead. ``out`` (optional) is a ``[B, H_q, L_q, D]`` tensor of the query's dtype and
    device to write into; by default it is allocated as the transpose of a contiguous ``[B, L_q, H_q, D]`` buffer, so
    the HF seam's ``transpose(1, 2).contiguous()`` is free. ``config``: the kernel configuration (``None``: the one
    ``use_config`` set, else ``DEFAULT_CONFIG``). Scratch: partials ``[slots, H_kv, B*G*L_q, D]`` (the input dtype
    for fp16/bf16 with ``partial_half``, else fp32) and fp32 natural-log LSEs ``[slots, H_kv, B*G*L_q]``.

    A free call holds no step: its plan is the layout's (``plan_relay``, found by ``plan_key``). The values of
    ``suffix_lengths`` and ``suffix_end`` are checked on CPU only (``check_relay_values``): on CUDA that would sync
    the host every layer.
    """
    options = options_of(options)
    plan = plan_relay(StepMetadata(suffix_lengths, suffix_end, prefix_groups), options, query, prefix_key,
                      prefix_value, suffix_key, suffix_value, config)
    return plan.run(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end,
                    options.sinks, out)


def bytes_moved(B: int, H_q: int, H_kv: int, L_q: int, P: int, L_s: int, D: int, itemsize: int) -> int:
    """Fewest bytes relay attention must move: prefix K/V once, every suffix K/V, the queries and the output."""
    return itemsize * (2 * H_kv * P * D + 2 * B * H_kv * L_s * D + 2 * B * H_q * L_q * D)


__all__ = ["DEFAULT_CONFIG", "AttentionOptions", "KernelConfig", "RelayPlan", "StepMetadata", "active_config",
           "bytes_moved", "cached_plans", "group_split_count", "grouped_launch_shape", "plan_for", "plan_relay",
           "prefix_split_count", "relay_attention_triton", "suffix_split_count", "triton_available", "use_config"]
