"""Prefill: run the model over shared prefixes at batch 1 and keep, per layer, what each layer must store of them.

A global layer stores each segment whole; a sliding-window layer (one whose attention module states its own
``sliding_window``) stores only what a query after the segment can see, its last ``window - 1`` tokens, where that
saves enough (``TRIM_AT_MOST``). ``RelayCache.from_prefix`` / ``from_prefixes`` / ``from_tree`` / ``combine`` build
on these functions, which return what a ``RelayCache`` is made of: the packed KV per layer, the ``PrefixTree`` of
its segments and the window each layer was trimmed for.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicCache

from ._compat import cache_kwarg_name
from .dependencies import indexed_modules
from .freshness import SegmentCheck
from .kernels.groups import window_kept
from .prefix import PrefixTree
from .store import PrefixKey

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
    kv, windows, _ = prefill_tree(model, tree)
    return kv, tree, windows


class Prefilled(NamedTuple):
    """What ``prefill_tree`` returns: per layer the packed prefix keys / values ``[1, H_kv, P_packed, D]`` (every
    segment, trimmed where the layer's window allows), the window each layer was trimmed for (``None``: stored
    whole), and how many of the tree's tokens came from a store instead of a prefill."""

    kv: KV
    windows: list[int | None]
    kept_tokens: int = 0


def segment_key(tree: PrefixTree, j: int) -> PrefixKey:
    """The store key of segment ``j`` (``store.PrefixKey``: where it starts and its full prefix's token ids)."""
    return PrefixKey.of(tree.starts()[j], tree.full_ids(j))


class KeptSegment(NamedTuple):
    """A segment as the prefix store keeps it: per layer its own positions' keys / values ``[1, H_kv, n, D]``, and
    the check a hit must pass (``freshness.SegmentCheck``)."""

    states: list[tuple[torch.Tensor, torch.Tensor]]
    check: SegmentCheck


def segment_nbytes(kept: KeptSegment) -> int:
    """Bytes of one kept segment: its per-layer keys and values, and its check."""
    return sum(k.nbytes + v.nbytes for k, v in kept.states) + kept.check.nbytes()


@torch.no_grad()
def prefill_tree(model, tree: PrefixTree, store=None, depends=None, pending: list | None = None,
                 launched: dict | None = None, check_row=None) -> Prefilled:
    """Prefill the segments of ``tree`` (roots at position 0, each child after its parent's KV) at batch 1.

    ``store`` (a ``store.PrefixStore`` of ``KeptSegment``s, with the model's ``kv_dependencies`` as ``depends``):
    each segment's KV is taken from it where kept and its check holds for the model as it is now (a system prompt
    kept from an earlier call; a new document under it then prefills alone, after the kept prompt's KV), else
    prefilled and kept there. ``pending`` (a list): a kept segment's check is launched, not read
    (``SegmentCheck.verdict``): its verdict goes there for the caller to read (``PrefixStore.settle``) once it has
    launched its own work; read here before any segment is prefilled (none is built on a stale one's KV).
    ``launched``: checks' forwards the call launched before it walked the model (``kept.launch_checks``), which
    their verdicts read instead of running them again. ``check_row``: a ``check_row.CheckRow`` the call's prefill
    runs, to which the pending verdicts leave their head (``SegmentCheck.verdict``).
    """
    text_config = model.config.get_text_config(decoder=True)
    max_pos = getattr(text_config, "max_position_embeddings", None)
    longest = max(tree.full_ids(j).numel() for j in range(len(tree.ids)))
    if max_pos is not None and longest > max_pos:
        raise ValueError(f"prefix of {longest} tokens is longer than the model's max_position_embeddings "
                         f"({max_pos})")
    name = cache_kwarg_name(model)
    states: dict[int, list] = {}  # per segment, per layer (keys, values) of its own positions
    kept = 0

    def prefill(j: int) -> list:
        scratch = DynamicCache()  # no config: plain full layers, nothing windowed away
        for i, (k, v) in enumerate(_ancestors_kv(tree, j, states)):  # continue after the ancestors' KV (copied)
            scratch.update(k, v, i)
        skip = tree.starts()[j]
        model.base_model(input_ids=tree.ids[j][None].to(model.device), use_cache=True, **{name: scratch})
        # its own positions, compact (a child's slice would keep the copied ancestors alive)
        return [(k[:, :, skip:].contiguous(), v[:, :, skip:].contiguous()) for k, v in _kv(scratch)]

    # the checks' values through the model as it is now, shared by this call's segments
    memo: dict = {"partial_params": getattr(depends, "partial", None), "launched": launched or {},
                  "check_row": check_row if pending is not None else None}

    def build(j: int) -> KeptSegment:
        if pending:  # a kept segment not known fresh yet: StaleKept before anything is built on its KV
            store.settle(pending)
        return KeptSegment(prefill(j), SegmentCheck.record(model, tree.full_ids(j), tree.ids[j], memo))

    def fresh(entry: KeptSegment, j: int) -> torch.Tensor | bool:
        verdict = entry.check.verdict(model, tree.full_ids(j), memo)
        return verdict if pending is not None else bool(verdict)

    for j in sorted(range(len(tree.ids)), key=lambda j: len(tree.path(j))):  # parents first
        if store is None:
            states[j] = prefill(j)
            continue
        built = []  # whether this call's lookup prefilled it (the store's counters are shared with other threads)
        states[j] = store.get(segment_key(tree, j), depends, lambda j=j, built=built: built.append(j) or build(j),
                              lambda entry, j=j: fresh(entry, j), pending).states
        kept += 0 if built else tree.lengths[j]
    # a sliding-window layer keeps of each segment only what a query after it can see (its last window - 1
    # tokens), where that saves enough; every other layer keeps it all
    windows = [trim_window(w, tree.lengths) for w in layer_windows(model, depends)]
    kv = []
    for i, window in enumerate(windows):
        parts = []
        for j, keep in enumerate(window_kept(tree.lengths, window)):
            k, v = states[j][i]
            if keep < k.shape[2]:
                k, v = k[:, :, k.shape[2] - keep:], v[:, :, v.shape[2] - keep:]
            parts.append((k, v))  # whole: the kept tensors themselves (a later call's hit hands the same ones)
        if len(parts) == 1 and window is None:
            kv.append(parts[0])
        else:  # packed (and a trimmed layer's own storage, so the dropped tokens are freed)
            kv.append((torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2)))
    return Prefilled(kv, windows, kept)


def _ancestors_kv(tree: PrefixTree, j: int, states: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the keys / values of segment ``j``'s ancestors, root first, concatenated (empty for a root)."""
    ancestors = tree.path(j)[:-1]
    if not ancestors:
        return []
    layers = len(states[ancestors[0]])
    return [(torch.cat([states[a][i][0] for a in ancestors], 2), torch.cat([states[a][i][1] for a in ancestors], 2))
            for i in range(layers)]


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def trim_window(window: int | None, lengths) -> int | None:
    """``window`` when a layer with this sliding window should store only each segment's last ``window - 1`` tokens
    (that keeps at most ``TRIM_AT_MOST`` of them), else ``None`` (it stores the segments whole)."""
    if window is None or not lengths:
        return None
    return window if sum(window_kept(lengths, window)) <= TRIM_AT_MOST * sum(lengths) else None


def layer_windows(model, depends=None) -> list[int | None]:
    """Per layer, the sliding window its attention module states as its own (``module.sliding_window``, set per
    layer by Gemma 2/3, gpt-oss, Qwen2/3, ...), or ``None``: a model that passes its window from the config at call
    time keeps every layer whole (exact either way: the kernels apply the window; trimming only saves memory).
    ``depends``: the call's ``dependencies.kv_dependencies``, whose walk found the modules naming their layer (else
    they are found here)."""
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    found: dict[int, set] = {}
    for index, module in indexed_modules(model) if depends is None else depends.indexed:
        own = module.__dict__  # (a miss through ``nn.Module.__getattr__`` raises)
        if "sliding_window" in own:
            found.setdefault(index, set()).add(own["sliding_window"])
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
