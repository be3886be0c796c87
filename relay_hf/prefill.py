"""Prefill: run the model over shared prefixes at batch 1 and keep, per layer, what each layer must store of them.

A global layer stores each segment whole; a sliding-window layer (one whose attention module states its own
``sliding_window``) stores only what a query after the segment can see, its last ``window - 1`` tokens, where that
saves enough (``TRIM_AT_MOST``). ``RelayCache.from_prefix`` / ``from_prefixes`` / ``from_tree`` / ``combine`` build
on these functions, which return what a ``RelayCache`` is made of: the packed KV per layer, the ``PrefixTree`` of
its segments and the window each layer was trimmed for.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from ._compat import cache_kwarg_name
from .kernels.groups import window_kept
from .prefix import PrefixTree

# a sliding-window layer stores only what its window sees where that keeps at most this share of the prefix tokens
# (below, its memory saving does not pay for reading the prefix through work tables)
TRIM_AT_MOST = 0.75
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer, the packed prefix keys / values [1, H_kv, P_packed, D]


def _prefix_ids(ids, name: str) -> torch.Tensor:
    """``[P]`` integer token ids from a tensor or list (``[1, P]`` accepted), else ``ValueError`` naming ``name``."""
    ids = torch.as_tensor(ids)
    if ids.numel() == 0:  # checked first: an empty list becomes a float tensor
        raise ValueError(f"{name} is empty: a prefix needs at least one token")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be integer token ids, got dtype {ids.dtype}")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"{name} must be a non-empty [P] or [1, P] sequence, got shape {tuple(ids.shape)}")
    return ids


@torch.no_grad()
def prefill_prefixes(model, prefixes, names: list[str] | None = None) -> tuple[KV, PrefixTree, list[int | None]]:
    """Validate ``prefixes`` (a non-empty list of ``[P]`` / ``[1, P]`` integer token id sequences; an error names the
    bad one by ``names``, by default ``prefixes[i]``), store them as a ``PrefixTree`` (a prefix that starts with
    another is its continuation) and prefill it (``prefill_tree``)."""
    if isinstance(prefixes, torch.Tensor) or not prefixes:
        raise ValueError("prefixes must be a non-empty list of token id sequences")
    names = names or [f"prefixes[{i}]" for i in range(len(prefixes))]
    tree = PrefixTree.from_prefixes([_prefix_ids(p, name) for p, name in zip(prefixes, names)])
    kv, windows = prefill_tree(model, tree)
    return kv, tree, windows


@torch.no_grad()
def prefill_tree(model, tree: PrefixTree) -> tuple[KV, list[int | None]]:
    """Prefill the segments of ``tree`` (roots at position 0, each child after its parent's KV) at batch 1.

    Returns ``(kv, windows)``: per layer the packed prefix keys / values ``[1, H_kv, P_packed, D]`` (every segment,
    trimmed where the layer's window allows), and the window each layer was trimmed for (``None``: stored whole).
    """
    text_config = model.config.get_text_config(decoder=True)
    max_pos = getattr(text_config, "max_position_embeddings", None)
    longest = max(tree.full_ids(j).numel() for j in range(len(tree.ids)))
    if max_pos is not None and longest > max_pos:
        raise ValueError(f"prefix of {longest} tokens is longer than the model's max_position_embeddings "
                         f"({max_pos})")
    name = cache_kwarg_name(model)
    done: dict[int, DynamicCache] = {}
    for j in sorted(range(len(tree.ids)), key=lambda j: len(tree.path(j))):  # parents first
        scratch = DynamicCache()  # no config: plain full layers, nothing windowed away
        parent = tree.parents[j]
        if parent >= 0:  # continue after the parent's keys (copied in: the parent's own tensors stay as they are)
            for i, (k, v) in enumerate(_kv(done[parent])):
                scratch.update(k, v, i)
        model.base_model(input_ids=tree.ids[j][None].to(model.device), use_cache=True, **{name: scratch})
        done[j] = scratch
    # a sliding-window layer keeps of each segment only what a query after it can see (its last window - 1
    # tokens), where that saves enough; every other layer keeps it all
    windows = [trim_window(w, tree.lengths) for w in layer_windows(model)]
    ends = [start + n for start, n in zip(tree.starts(), tree.lengths)]
    states = [_kv(done[j]) for j in range(len(tree.ids))]  # per segment, per layer (keys, values)
    kv = []
    for i, window in enumerate(windows):
        parts = []
        for j, keep in enumerate(window_kept(tree.lengths, window)):
            k, v = states[j][i]
            parts.append((k[:, :, ends[j] - keep:ends[j]], v[:, :, ends[j] - keep:ends[j]]))
        if len(parts) == 1 and window is None:
            kv.append(parts[0])
        else:  # packed (and a trimmed layer's own storage, so the dropped tokens are freed)
            kv.append((torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2)))
    return kv, windows


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def trim_window(window: int | None, lengths) -> int | None:
    """``window`` when a layer with this sliding window should store only each segment's last ``window - 1`` tokens
    (that keeps at most ``TRIM_AT_MOST`` of them), else ``None`` (it stores the segments whole)."""
    if window is None or not lengths:
        return None
    return window if sum(window_kept(lengths, window)) <= TRIM_AT_MOST * sum(lengths) else None


def layer_windows(model) -> list[int | None]:
    """Per layer, the sliding window its attention module states as its own (``module.sliding_window``, set per
    layer by Gemma 2/3, gpt-oss, Qwen2/3, ...), or ``None``: a model that passes its window from the config at call
    time keeps every layer whole (exact either way: the kernels apply the window; trimming only saves memory)."""
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    found: dict[int, set] = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and "sliding_window" in vars(module):
            found.setdefault(index, set()).add(vars(module)["sliding_window"])
    out = []
    for i in range(n_layers):
        values = found.get(i, set())
        window = next(iter(values)) if len(values) == 1 else None
        ok = isinstance(window, int) and not isinstance(window, bool) and window >= 1
        out.append(window if ok else None)
    return out


def pack_prefixes(caches) -> tuple[KV, PrefixTree, list[int | None]]:
    """The stored prefixes of several caches of one model, packed into one: ``caches`` is ``[(tree, layers)]``.
    Returns ``(kv, tree, windows)`` as ``prefill_tree`` does, the trees side by side (their KV copied once)."""
    ids, parents = [], []
    for tree, _ in caches:
        parents += [p + len(ids) if p >= 0 else -1 for p in tree.parents]
        ids += list(tree.ids)
    # a layer one cache trimmed to its window (TRIM_AT_MOST) is trimmed in the combination; another cache's
    # prefixes are trimmed on the way (the packing copies them anyway)
    windows = [next((w for w in ws if w is not None), None)
               for ws in zip(*[[lay.window for lay in layers] for _, layers in caches])]
    kv = []
    for i, window in enumerate(windows):
        keys, values = [], []
        for tree, layers in caches:
            lay = layers[i]
            stored = window_kept(tree.lengths, lay.window)
            if lay.window is not None and lay.window != window:
                raise ValueError("combine takes RelayCaches of one model (their layers keep different windows)")
            at = 0
            for n, keep in zip(stored, window_kept(stored, window)):
                keys.append(lay.prefix_keys[:, :, at + n - keep:at + n])
                values.append(lay.prefix_values[:, :, at + n - keep:at + n])
                at += n
        kv.append((torch.cat(keys, 2), torch.cat(values, 2)))
    return kv, PrefixTree(tuple(ids), tuple(parents)), windows
