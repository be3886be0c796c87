"""The patch-time probe's rows (``probe.py``): two rows sharing a prefix, the second left-padded, in the stock layout
and in relay's, sized for the model.

The prefix is ``PROBE_PREFIX`` tokens, or longer where the model needs it: past a sliding window of at most
``MAX_WINDOW`` tokens, long enough that relay stores the prefix trimmed to the window (``_prefix_length``); below the
points where the model's forwards change with their length (``rope.rope_limits``), or past them where relay serves
calls past them (``_probe_prefix``). Its tokens are ordinary ones, never an id a config reserves (``_special_ids``).
"""

from __future__ import annotations

import inspect

import torch

from .prefill import trim_window
from .prefix import relay_layout
from .rope import rope_limits

PROBE_PREFIX = 5  # shared tokens (more for a small sliding window: ``_prefix_length``)
PROBE_SUFFIXES = (3, 1)  # tokens after the prefix per row: the second row is left-padded by 2
MAX_WINDOW = 128  # a sliding window up to this many tokens is probed past


def probe_inputs(model) -> dict:
    """The probe's rows in both layouts, on the input embedding's device.

    ``ids`` / ``mask`` ``[2, T]`` int64: stock layout ``[pads | prefix | suffix]``; ``relay_ids`` / ``relay_mask``: the
    same rows as ``generate`` lays them out for relay; ``n_pad`` ``[2]``: each row's masked columns in front of its
    suffix there; ``prefix`` ``[P]`` (``_prefix_length``); ``step`` ``[2, 1]``: the token of the decode step;
    ``positions``: whether the forward takes ``position_ids`` (``generate`` passes them only then); ``keep``: whether
    it takes ``logits_to_keep`` (the probe needs the last position's logits only); ``dtype``: the embedding's dtype
    (picks the tolerance); ``half``: whether the weights are 16-bit; ``hidden``: whether the probe's forwards ask for
    every layer's hidden states (a 16-bit model probed whole: ``probe._last_logits``).
    """
    embeddings = model.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, torch.Tensor):
        weight = next(model.parameters())
    text = model.config.get_text_config(decoder=True)
    vocab = getattr(embeddings, "num_embeddings", None) or text.vocab_size
    special = _special_ids(model)
    room = getattr(text, "max_position_embeddings", None) or 4 * MAX_WINDOW
    n_prefix = _probe_prefix(model, room)
    n_tokens = n_prefix + sum(PROBE_SUFFIXES) + 1
    # ordinary tokens from the upper half of the vocabulary, never an id a config reserves, repeated where a long
    # prefix needs more than there are; deterministic (no RNG)
    ordinary = [t for t in range(vocab // 2, vocab) if t not in special][::3]
    if len(ordinary) < n_tokens:
        ordinary = [t for t in range(vocab) if t not in special]
    if not ordinary:
        raise ValueError(f"a vocabulary of {vocab} tokens has no ordinary one")
    tokens = [ordinary[i % len(ordinary)] for i in range(n_tokens)]
    prefix, rest = tokens[:n_prefix], tokens[n_prefix:]
    T = n_prefix + max(PROBE_SUFFIXES)
    ids = torch.full((len(PROBE_SUFFIXES), T), prefix[0], dtype=torch.long)  # pads hold an ordinary token (masked)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(PROBE_SUFFIXES):
        row, rest = prefix + rest[:n], rest[n:]
        ids[b, T - len(row):] = torch.tensor(row)
        mask[b, T - len(row):] = 1
    n_pad = (mask == 0).sum(-1)
    layout = relay_layout(ids, mask, n_pad, n_prefix)
    step = torch.full((len(PROBE_SUFFIXES), 1), rest[0], dtype=torch.long)
    rows = dict(ids=ids, mask=mask, relay_ids=layout.ids, relay_mask=layout.mask, n_pad=layout.suffix_padding,
                prefix=torch.tensor(prefix), step=step)
    parameters = inspect.signature(model.forward).parameters
    half = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
    return {**{k: v.to(weight.device) for k, v in rows.items()}, "positions": "position_ids" in parameters,
            "keep": "logits_to_keep" in parameters, "dtype": weight.dtype,
            "half": half, "hidden": half}


def _window(model) -> int | None:
    """The model's smallest sliding window: an attention module's own ``sliding_window`` (Gemma 2/3, gpt-oss,
    Qwen2...), or the config's where every layer (no ``layer_types``; Mistral passes it at call time) or some layer
    type slides; ``None`` without one."""
    text = model.config.get_text_config(decoder=True)
    found = {w for w in (vars(m).get("sliding_window") for m in model.modules())
             if isinstance(w, int) and not isinstance(w, bool) and w > 0}
    window, layer_types = getattr(text, "sliding_window", None), getattr(text, "layer_types", None)
    slides = "sliding_attention" in layer_types if layer_types else getattr(text, "use_sliding_window", True)
    if isinstance(window, int) and not isinstance(window, bool) and window > 0 and slides:
        found.add(window)
    return min(found, default=None)


def _probe_prefix(model, room: int) -> int:
    """The probe's prefix length (``_prefix_length``), its rows and step within ``room`` positions and where relay is
    meant to be exact for a model whose forwards change with their length (``rope.rope_limits``): below every such
    limit, as the calls relay serves there (a probe past a dynamic NTK limit would compare frequencies relay never
    runs with, and decline a model it serves below it); else, where every limit allows it, a prefix past them all.
    ``ValueError`` where neither fits: relay then cannot be checked on the model."""
    extra = max(PROBE_SUFFIXES) + 1  # the longest row's tokens after the prefix, and the decode step
    limits = rope_limits(model)
    # the probe is a call of extra + 1 new tokens; rope_reason serves it when its prefix + extra + 1 <= positions
    below = min([room] + [limit.positions - 1 for limit in limits])
    if not limits or PROBE_PREFIX + extra <= below:
        return _prefix_length(_window(model), below - extra)
    past = max(limit.positions for limit in limits) + 1
    if all(limit.beyond for limit in limits) and past + extra <= room:
        return past
    raise ValueError(f"the probe needs {PROBE_PREFIX + extra + 1} positions and the model's "
                     f"{min(limits, key=lambda limit: limit.positions).what}")


def _prefix_length(window: int | None, room: int) -> int:
    """``PROBE_PREFIX``, or for a ``window`` of at most ``MAX_WINDOW`` tokens the shortest prefix past it that relay
    stores trimmed to the window (``prefill.trim_window``), else one just past it; at most ``room`` tokens."""
    if window is None or window > MAX_WINDOW or window + 1 > room:
        return PROBE_PREFIX
    start = max(PROBE_PREFIX, window + 1)
    trimmed = (p for p in range(start, min(room, 4 * window) + 1) if trim_window(window, [p]) is not None)
    return next(trimmed, start)


def _special_ids(model) -> set[int]:
    """Every token id a config names (``pad_token_id``, ``eos_token_id``, ``image_token_index``...)."""
    found: set[int] = set()
    configs = (model.config, model.config.get_text_config(decoder=True), getattr(model, "generation_config", None))
    for config in configs:
        for key, value in (vars(config) if config is not None else {}).items():
            if key.endswith(("_id", "_ids", "_index")):
                values = value if isinstance(value, (list, tuple)) else [value]
                found.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return found
