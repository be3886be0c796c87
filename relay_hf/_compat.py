"""The few places where transformers 5.17 .. 5.x differ for us, answered by looking, not by version numbers."""

from __future__ import annotations

import inspect
from functools import cache


@cache
def _forward_cache_name(forward_qualname: str, params: tuple[str, ...]) -> str:
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg_name(model) -> str:
    """The keyword under which ``model``'s forward (and generate) takes the cache.

    transformers 5.24 renamed ``past_key_values`` to ``cache``; the old name still works there but warns.
    """
    forward = model.base_model.forward
    return _forward_cache_name(forward.__qualname__, tuple(inspect.signature(forward).parameters))


def output_cache(output):
    """The cache carried by a generate/forward output, under whichever field name this version uses."""
    for name in ("cache", "past_key_values"):
        value = output.get(name) if hasattr(output, "get") else getattr(output, name, None)
        if value is not None:
            return value
    return None
