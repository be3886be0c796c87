"""``relay_hf.stats(model)``: what relay saved on a patched model since ``patch``, as one frozen snapshot.

The counters (``counters.py``) are kept by every road that serves relay: ``generate``, the pipeline and continuous
batching (``generate_batch``, ``init_continuous_batching``, ``relay-hf serve``); this module also holds the
arithmetic of what they count (KV bytes per token and layer, the bytes a decode did not read again).
"""

from __future__ import annotations

import dataclasses

import torch

from .counters import RelayStats
from .dependencies import indexed_modules
from .state import relay_state


def head_shape(text) -> tuple[int, int, int, int]:
    """``(query heads, KV heads, key head dim, value head dim)`` a text config declares (the same for every layer)."""
    heads = getattr(text, "num_attention_heads", 1)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return heads, kv_heads, head_dim, getattr(text, "v_head_dim", None) or head_dim


def head_shapes(text) -> set[tuple[int, int, int, int]]:
    """Every ``head_shape`` a text config's layers have: one, or per layer where the config holds per-layer
    attributes (Gemma 4's global and sliding layers differ, and transformers refuses to read them globally)."""
    per_layer = getattr(text, "per_layer_config", None)
    return {head_shape(layer) for layer in per_layer} if per_layer is not None else {head_shape(text)}


def layer_kv_bytes(model, depends=None) -> list[int]:
    """Per decoder layer (``[num_hidden_layers]`` of the text config), the bytes of one token's keys and values in
    the model's dtype: from the layer's attention module (the one whose ``layer_idx`` names the layer) and its key
    and value projections, so per-layer head counts and dims (Gemma 4's) count as they are; from the text config
    (the same for every layer) when not every layer has exactly one such module. ``depends``: the call's
    ``dependencies.kv_dependencies``, whose walk found the modules naming their layer (else they are found here)."""
    text = model.config.get_text_config(decoder=True)
    layers = getattr(text, "num_hidden_layers", 1)
    itemsize = model.dtype.itemsize
    found: dict[int, list[int]] = {}
    for index, module in indexed_modules(model) if depends is None else depends.indexed:
        k, v = module._modules.get("k_proj"), module._modules.get("v_proj")
        if 0 <= index < layers and isinstance(k, torch.nn.Linear) and isinstance(v, torch.nn.Linear):
            found.setdefault(index, []).append((k.out_features + v.out_features) * itemsize)
    if all(len(found.get(i, ())) == 1 for i in range(layers)):
        return [found[i][0] for i in range(layers)]
    _, kv_heads, head_dim, value_dim = head_shape(text)
    return [kv_heads * (head_dim + value_dim) * itemsize] * layers


def kv_bytes_per_token(model) -> int:
    """Bytes of one token's keys and values over every layer of ``model`` (``layer_kv_bytes`` summed)."""
    return sum(layer_kv_bytes(model))


def attention_windows(model) -> list[int | None]:
    """Per decoder layer, the sliding window its attention applies (stock's and relay's alike: a query at position
    ``t`` sees keys at positions ``> t - window``), or ``None`` for a full-attention layer; read from the text config
    as transformers reads it for its own caches (``layer_types``, else ``sliding_window`` for every layer)."""
    text = model.config.get_text_config(decoder=True)
    layers = getattr(text, "num_hidden_layers", 1)
    window = getattr(text, "sliding_window", None)
    if not getattr(text, "use_sliding_window", True):
        window = None
    types = getattr(text, "layer_types", None) or ["sliding_attention"] * layers
    return [window if i < len(types) and types[i] == "sliding_attention" else None for i in range(layers)]


def full_layer_kv_bytes(model) -> int:
    """One token's key and value bytes over the full-attention layers of ``model`` (``attention_windows``): what a
    continuous-batching step saves per shared KV position it does not read again."""
    return sum(n for n, w in zip(layer_kv_bytes(model), attention_windows(model)) if w is None)


def _seen_sum(reach: int, tokens: int, steps: int) -> int:
    """``sum over k = 1 .. steps of min(tokens, max(0, reach - k))``: the segment tokens one reader's window sees
    over ``steps`` decode steps, when at step ``k`` it sees ``reach - k`` of them (clipped to the segment)."""

    def upto(m: int) -> int:  # sum over x = 1 .. m of min(tokens, x)
        if m <= 0:
            return 0
        if m <= tokens:
            return m * (m + 1) // 2
        return tokens * (tokens + 1) // 2 + (m - tokens) * tokens

    return upto(reach - 1) - upto(reach - 1 - steps)


def decode_bytes_not_reread(segments, steps: int, layers) -> int:
    """The prefix KV bytes relay does not read again over ``steps`` decode steps (``RelayStats.kv_bytes_not_reread``).

    Args:
        segments: per shared segment ``(end, tokens, firsts)``: the absolute position just after its last token,
            its length, and per row that reads it the position of that row's first decode query (its prompt
            length: step ``k`` queries position ``first + k - 1``).
        steps: decode steps (new tokens after the first).
        layers: per layer ``(window, bytes)``: its sliding window (``None``: full attention) and one token's KV
            bytes.

    Per layer, step and segment: stock reads, per reader, the segment tokens its query sees (all of them under full
    attention; those at positions ``> t - window`` under a window), relay reads the most any reader sees, once.
    """
    per_window: dict[int | None, int] = {}
    for window, nbytes in layers:
        per_window[window] = per_window.get(window, 0) + nbytes
    total = 0
    for window, nbytes in per_window.items():
        tokens_saved = 0
        for end, tokens, firsts in segments:
            if len(firsts) < 2:
                continue
            if window is None:
                tokens_saved += (len(firsts) - 1) * tokens * steps
                continue
            # at step k the reader at `first` sees the positions > first + k - 1 - window of the segment: end +
            # window - first - k of them; the reader with the earliest first query sees the most
            seen = [_seen_sum(end + window - first, tokens, steps) for first in firsts]
            tokens_saved += sum(seen) - _seen_sum(end + window - min(firsts), tokens, steps)
        total += tokens_saved * nbytes
    return total


def stats(model) -> RelayStats:
    """The counters of a patched ``model`` (``ValueError`` for a model ``relay_hf.patch`` has not patched)."""
    state = relay_state(model)
    if state is None:
        raise ValueError("relay_hf.stats takes a model patched by relay_hf.patch")
    return dataclasses.replace(state.counters.snapshot(), pinned_bytes=state.store.pinned_nbytes())
