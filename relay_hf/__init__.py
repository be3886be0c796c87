"""relay_hf: RelayAttention for HuggingFace transformers.

Batched generation under one long system prompt reads that prompt's KV once per batch instead of once per row,
exactly (no retraining, no quality change). See README.md and docs/.
"""

from .attention import RelayMask, relay_attention_forward, relay_mask
from .cache import ATTN_NAME, STATIC_ATTN_NAME, RelayCache, RelayKV, RelayLayer, StaticRelayLayer
from .generate import RelayDecision, RelayFallbackWarning
from .kernels import relay_attention, relay_attention_torch
from .patch import is_patched, patch, unpatch, unsupported_reason
from .pipeline import RelayTextGenerationPipeline, pipeline

__version__ = "0.1.0"

__all__ = [
    "ATTN_NAME", "STATIC_ATTN_NAME", "RelayCache", "RelayDecision", "RelayFallbackWarning", "RelayKV", "RelayLayer",
    "RelayMask", "RelayTextGenerationPipeline", "StaticRelayLayer", "is_patched", "patch", "pipeline",
    "relay_attention", "relay_attention_forward", "relay_attention_torch", "relay_mask", "unpatch",
    "unsupported_reason",
]
