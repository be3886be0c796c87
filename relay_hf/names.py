"""The attention implementation names relay_hf registers with transformers, and which stock implementation each
stands for."""

from .flash import KERNEL_ID

ATTN_NAME = "relay"
# The name a patched model runs under says which implementation it runs without a relay prefix, so a copied or
# unpickled model keeps it. (No "flash" in these names: transformers treats such names as flash attention.)
RELAY_NAMES = {"sdpa": ATTN_NAME, "eager": "relay_eager", "flash_attention_2": "relay_fa2",
               "flash_attention_3": "relay_fa3", "flash_attention_4": "relay_fa4", "flex_attention": "relay_flex"}
STOCK_OF = {relay: stock for stock, relay in RELAY_NAMES.items()}


def is_relay_name(name: str | None) -> bool:
    """Whether ``name`` is one of the attention implementations relay_hf registers."""
    return name in STOCK_OF

# Continuous batching accepts few names: transformers 5.17 any ``paged|<name>`` it finds registered, newer versions
# only ``sdpa``, ``paged|eager`` and names that say "flash" (with no 2 or 3 after it: those take flash's decode path).
# A patched model runs under one of these while a continuous-batching manager serves it (``continuous.py``).
PAGED_NAMES = ("paged|relay", "relay_paged_flash")


def is_paged_name(name: str | None) -> bool:
    """Whether ``name`` is the implementation a patched model runs continuous batching under."""
    return name in PAGED_NAMES


def is_flash_name(name: str | None) -> bool:
    """Whether ``name`` is relay's flash kernel, as a patched model runs it while a manager serves it on the flash
    road (transformers 5.17's continuous batching prefixes it with ``paged|``)."""
    return name is not None and name.rpartition("|")[2] == KERNEL_ID
