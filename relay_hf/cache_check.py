"""A ``RelayCache`` the caller passes to ``generate``: whether it fits the model and the rows (``check_cache``), and
each row's path in its prefixes (``cache_grouping``).

The pipeline matches its rows to its cache before it passes the cache (a row under none of its system prompts runs
without it); ``rows_matched`` hands that match to the call, so the rows are matched once.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

from .cache import RelayCache
from .prefix import Grouping


def check_cache(model, cache: RelayCache, ids: torch.Tensor, n_pad: torch.Tensor) -> Grouping:
    """Each row's path in ``cache``'s prefixes (``cache_grouping``); raise ``ValueError`` naming what makes ``cache``
    unusable for these rows on this model (a row that starts with none of its prefixes: which row, and where it
    differs)."""
    # a cache a call returned (a fork: its prefixes, and suffixes the new call lays out again) serves as well as the
    # one it was forked from
    if cache.tree is None or cache.layers[0].prefix_keys is None:
        raise ValueError("RelayCache holds no prefix; build it with RelayCache.from_prefix(model, prefix_ids)")
    if cache.config is not model.config:
        raise ValueError("RelayCache was built for another model (its config is not this model's): build one with "
                         "RelayCache.from_prefix(model, prefix_ids) for this model")
    text = model.config.get_text_config(decoder=True)
    if len(cache.layers) != text.num_hidden_layers:
        raise ValueError(f"RelayCache has {len(cache.layers)} layers, the model has {text.num_hidden_layers}")
    k = cache.layers[0].prefix_keys
    if k.dtype != model.dtype:
        raise ValueError(f"RelayCache prefix dtype is {k.dtype} but the model runs in {model.dtype}")
    if k.device != model.device:
        raise ValueError(f"RelayCache prefix is on {k.device} but the model is on {model.device}")
    matched = _MATCHED.get()
    if (matched is not None and matched[0] is cache and matched[1] is ids
            and torch.equal(matched[2].cpu(), n_pad.cpu())):  # the caller matched these very rows (``rows_matched``)
        return matched[3]
    return cache_grouping(cache, ids, n_pad)


def cache_grouping(cache: RelayCache, ids: torch.Tensor, n_pad: torch.Tensor) -> Grouping:
    """Each row's path in ``cache``'s prefixes (``ids [B, T]``, ``n_pad [B]`` left pads); ``ValueError`` for a row
    that starts with none of them (which row, and where it differs)."""
    # the cache a grouped call returned (a fork with groups) continues all of that call's rows, those that read no
    # prefix too; a cache the user built refuses a row under none of its prefixes (a tokenization slip, most likely)
    allow_none = cache.groups is not None
    return Grouping(cache.tree, tuple(cache.tree.match(ids, n_pad, allow_none)))


# rows a caller matched to the cache it passes to generate on this thread: (cache, ids, n_pad, grouping)
_MATCHED: ContextVar[tuple | None] = ContextVar("relay_hf_rows_matched", default=None)


@contextlib.contextmanager
def rows_matched(cache: RelayCache, ids: torch.Tensor, n_pad: torch.Tensor, grouping: Grouping):
    """While the block runs, a patched ``generate`` on this thread given ``cache`` and these very ``ids`` (with this
    left padding) takes ``grouping`` (``cache_grouping``'s answer for them) instead of matching its rows again: the
    pipeline matches them first, to pass its cache only where every row is under one of its prefixes."""
    token = _MATCHED.set((cache, ids, n_pad, grouping))
    try:
        yield
    finally:
        _MATCHED.reset(token)
