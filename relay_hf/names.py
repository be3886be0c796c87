"""The attention implementation names relay_hf registers with transformers, and which stock implementation each
stands for."""

ATTN_NAME = "relay"
# The name a patched model runs under says which implementation it runs without a relay prefix, so a copied or
# unpickled model keeps it. (No "flash" in these names: transformers treats such names as flash attention.)
RELAY_NAMES = {"sdpa": ATTN_NAME, "eager": "relay_eager", "flash_attention_2": "relay_fa2",
               "flash_attention_3": "relay_fa3", "flash_attention_4": "relay_fa4", "flex_attention": "relay_flex"}
STOCK_OF = {relay: stock for stock, relay in RELAY_NAMES.items()}


def is_relay_name(name: str | None) -> bool:
    """Whether ``name`` is one of the attention implementations relay_hf registers."""
    return name in STOCK_OF
