"""The RoPE rules: points past which a forward's length changes what the model computes at every position of it
(``RopeLimit``), and the calls relay must leave to stock because of them (``rope_reason``).

Why: stock prefills the whole prompt in one forward; relay prefills each shared prefix alone, at its own length. Where
a model's forwards depend on their length (dynamic NTK or longrope RoPE, or a ``generate`` that recomputes the whole
sequence), relay's prefix KV is stock's only on one side of such a point. ``policy.decide`` asks ``rope_reason`` per
call; ``probe.py`` sizes its prefix by ``rope_limits``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._compat import cache_recomputed_past
from .prefix import Grouping


@dataclass(frozen=True)
class RopeLimit:
    """A length past which a forward's longest position changes what the model computes at every position of it:
    its rotary embedding's frequencies (dynamic NTK rescales them to the longest position past
    ``max_position_embeddings``; longrope takes its long factors in a forward longer than
    ``original_max_position_embeddings``), or its ``generate`` recomputing the whole sequence in one forward (Phi-3's).
    Stock prefills the whole prompt in one forward; relay prefills each shared prefix alone, at its own length, so past
    this point relay's prefix KV would not be stock's.

    Attributes:
        positions: a call whose prompt columns plus new tokens are at most this many runs every forward on fewer
            positions, where the frequencies are the RoPE's base ones for relay's forwards and stock's alike (dynamic
            NTK resets to them there after an earlier, longer call).
        what: the change, for ``relay_last_decision.reason``.
        beyond: whether relay is exact too when every shared prefix is longer than ``positions``: longrope's choice
            depends on nothing but the forward's length, so each of relay's forwards then takes the long factors, as
            stock's prompt does, and a cache already past the point is never recomputed. Dynamic NTK's frequencies
            follow the longest position of each forward (and what earlier forwards grew them to): never.
    """

    positions: int
    what: str
    beyond: bool


def rope_limits(model) -> list[RopeLimit]:
    """The points past which ``model``'s forwards change with their length (``RopeLimit``): a dynamic NTK or longrope
    RoPE (``rope_parameters``, per layer type where the config has several; ``rope_scaling`` where a config still
    calls it so), and a ``prepare_inputs_for_generation`` that recomputes the sequence (``_compat``)."""
    text = model.config.get_text_config(decoder=True)
    max_pos = getattr(text, "max_position_embeddings", None)
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        params = {}
    flat = "rope_type" in params or "type" in params  # else one dict per layer type
    sets = [params] if flat else [p for p in params.values() if isinstance(p, dict)]
    limits = []
    for rope in sets:
        kind = str(rope.get("rope_type", rope.get("type", "default")))
        if "dynamic" in kind and isinstance(max_pos, int):  # transformers' own test: any type that says "dynamic"
            limits.append(RopeLimit(max_pos, f"dynamic NTK RoPE (rope_type={kind!r}) rescales its frequencies in a "
                                             f"forward longer than max_position_embeddings={max_pos}", False))
        elif kind == "longrope":
            original = (rope.get("original_max_position_embeddings")
                        or getattr(text, "original_max_position_embeddings", None) or max_pos)
            if isinstance(original, int):
                limits.append(RopeLimit(original, "longrope RoPE takes its long factors in a forward longer than "
                                                  f"original_max_position_embeddings={original}", True))
    recomputed = cache_recomputed_past(model)
    if recomputed is not None:
        limits.append(RopeLimit(recomputed, f"{type(model).__name__}.generate recomputes the whole sequence once it is "
                                            f"longer than original_max_position_embeddings={recomputed}", True))
    return limits


def rope_reason(model, grouping: Grouping, T: int, n_pad: torch.Tensor, n_new: int) -> str | None:
    """Why this call must run stock because of ``rope_limits``, or ``None``. ``T``: prompt columns; ``n_pad`` ``[B]``
    left pads; ``n_new``: new tokens at most. The call reaches the longer of the stock prompt and relay's layout
    (whose columns can outnumber it under several prefixes; Phi-3's recompute counts columns) plus its new tokens:
    relay serves it when that stays within a limit, or, past a limit that allows it, when every shared prefix is
    longer than the limit (then every forward is past it, relay's as stock's)."""
    limits = rope_limits(model)
    if not limits:
        return None
    lengths = grouping.prefix_lengths()
    columns = max(lengths) + max(T - n - p for n, p in zip(n_pad.tolist(), lengths))
    reach = max(T, columns) + n_new
    roots = [n for n, parent in zip(grouping.tree.lengths, grouping.tree.parents) if parent < 0]
    for limit in limits:
        if reach > limit.positions and not (limit.beyond and min(roots) > limit.positions):
            return (f"the call can reach {reach} positions (prompt + new tokens) and the model's {limit.what}: relay "
                    "prefills the shared prefix alone, at its own length, so its KV would not be stock's")
    return None
