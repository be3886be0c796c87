"""``torch.ops.relay_hf.relay_attention``: the Triton kernels as a PyTorch custom op, so ``torch.compile`` treats
them as one opaque node (with a fake implementation for shapes) and CUDA graphs can capture them.

No ``from __future__ import annotations`` here: ``torch.library`` reads the real annotations to build the schema.
"""

from typing import Optional

import torch

from .groups import GroupTables
from .metadata import StepMetadata
from .options import AttentionOptions
from .plan import plan_relay


@torch.library.custom_op("relay_hf::relay_attention", mutates_args=(), device_types="cuda")
def relay_attention_op(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                       suffix_key: torch.Tensor, suffix_value: torch.Tensor, options: list[float],
                       suffix_lengths: Optional[torch.Tensor],  # noqa: UP045
                       suffix_end: Optional[torch.Tensor] = None,  # noqa: UP045
                       sinks: Optional[torch.Tensor] = None,  # noqa: UP045
                       group_items: Optional[torch.Tensor] = None,  # noqa: UP045
                       group_rows: Optional[torch.Tensor] = None,  # noqa: UP045
                       group_row_prefix: Optional[torch.Tensor] = None,  # noqa: UP045
                       group_shape: Optional[list[int]] = None) -> torch.Tensor:  # noqa: UP045
    """``[B, H_q, L_q, D]`` output, laid out as the transpose of a contiguous ``[B, L_q, H_q, D]`` buffer.
    ``options``: ``AttentionOptions.op_values`` (``torch.library`` takes no Python objects), read back with
    ``AttentionOptions.from_op``. Grouped prefixes come as their device tables (``GroupTables``: items, rows, row
    prefix lengths, ``[levels, segments]``). The kernel configuration is the one ``config.use_config`` set when the op
    runs (``DEFAULT_CONFIG`` otherwise). The op holds no step, so its plan is the layout's (``plan.plan_relay``)."""
    groups = None if group_shape is None else GroupTables(group_items, group_rows, group_row_prefix, *group_shape)
    step = StepMetadata(suffix_lengths, suffix_end, groups, None)  # held by no caller: no plans to keep
    plan = plan_relay(step, AttentionOptions.from_op(options, sinks), query, prefix_key, prefix_value, suffix_key,
                      suffix_value)
    return plan.run(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end, sinks)


@relay_attention_op.register_fake
def _fake(query, prefix_key, prefix_value, suffix_key, suffix_value, options, suffix_lengths, suffix_end=None,
          sinks=None, group_items=None, group_rows=None, group_row_prefix=None, group_shape=None):
    B, H_q, L_q, _ = query.shape
    return query.new_empty(B, L_q, H_q, suffix_value.shape[-1]).transpose(1, 2)
