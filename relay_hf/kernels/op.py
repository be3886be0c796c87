"""``torch.ops.relay_hf.relay_attention``: the Triton kernels as a PyTorch custom op, so ``torch.compile`` treats
them as one opaque node (with a fake implementation for shapes) and CUDA graphs can capture them.

No ``from __future__ import annotations`` here: ``torch.library`` reads the real annotations to build the schema.
"""

from typing import Optional

import torch

from .triton_relay import relay_attention_triton


@torch.library.custom_op("relay_hf::relay_attention", mutates_args=(), device_types="cuda")
def relay_attention_op(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                       suffix_key: torch.Tensor, suffix_value: torch.Tensor, scale: float,
                       suffix_lengths: Optional[torch.Tensor],  # noqa: UP045
                       suffix_end: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
    """``[B, H_q, L_q, D]`` output, laid out as the transpose of a contiguous ``[B, L_q, H_q, D]`` buffer. The kernel
    configuration is the one ``triton_relay.use_config`` set when the op runs (``DEFAULT_CONFIG`` otherwise)."""
    return relay_attention_triton(query, prefix_key, prefix_value, suffix_key, suffix_value, scale=scale,
                                  suffix_lengths=suffix_lengths, suffix_end=suffix_end)


@relay_attention_op.register_fake
def _fake(query, prefix_key, prefix_value, suffix_key, suffix_value, scale, suffix_lengths, suffix_end=None):
    B, H_q, L_q, _ = query.shape
    return query.new_empty(B, L_q, H_q, suffix_value.shape[-1]).transpose(1, 2)
