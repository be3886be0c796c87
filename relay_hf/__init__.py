"""relay_hf: RelayAttention for HuggingFace transformers.

Batched generation under one long system prompt reads that prompt's KV once per batch instead of once per row,
exactly (no retraining, no quality change). See README.md and docs/.
"""

from importlib.metadata import PackageNotFoundError, version

from .cache import RelayCache
from .generate import RelayFallbackWarning
from .kernels import relay_attention
from .patch import clear_prefixes, is_patched, patch, unpatch
from .pipeline import pipeline
from .policy import RelayDecision
from .stats import RelayStats, stats

try:
    __version__ = version("relay_hf")
except PackageNotFoundError:  # pragma: no cover - running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["RelayCache", "RelayDecision", "RelayFallbackWarning", "RelayStats", "clear_prefixes", "is_patched",
           "patch", "pipeline", "relay_attention", "stats", "unpatch"]
