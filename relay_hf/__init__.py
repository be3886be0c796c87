"""relay_hf: RelayAttention for HuggingFace transformers.

Batched generation under one long system prompt reads that prompt's KV once per batch instead of once per row,
exactly (no retraining, no quality change). See README.md and docs/.
"""

from ._version import __version__ as __version__
from .cache import RelayCache
from .generate import RelayFallbackWarning
from .kernels import relay_attention
from .patch import clear_prefixes, is_patched, patch, unpatch
from .pinning import pin, unpin
from .pipeline import pipeline
from .policy import RelayDecision
from .stats import RelayStats, stats

__all__ = ["RelayCache", "RelayDecision", "RelayFallbackWarning", "RelayStats", "clear_prefixes", "is_patched",
           "patch", "pin", "pipeline", "relay_attention", "stats", "unpatch", "unpin"]
