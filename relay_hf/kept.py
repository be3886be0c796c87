"""The prefixes a call takes from the model's prefix store: one way for ``generate`` and the pipeline alike.

Per prefix tree, its segments' KV is taken from the store where it was kept for the model as it is now, else
prefilled and kept there (``RelayCache.from_tree``, ``prefill.prefill_tree``); a tree that took some counts one prefix
hit in ``relay_hf.stats``; then the store is trimmed back to its budget, the call's own segments kept (the call holds
them while it runs: ``PrefixStore.holding``). A call may leave its kept segments' checks unread (``pending``) and read
them once its own work is launched (``PrefixStore.settle``); it counts its hits then (``count_kept``), when it knows
they were hits.
"""

from __future__ import annotations

import torch

from .cache import RelayCache
from .freshness import check_stream
from .policy import kept_dependencies
from .prefill import KeptSegment, segment_key
from .prefix import PrefixTree
from .state import relay_state
from .store import PrefixKey, PrefixStore


def prefix_store(model) -> tuple[PrefixStore | None, object]:
    """``(store, depends)``: the model's prefix store and what its entries must have been built under
    (``dependencies.kv_dependencies``, one walk of the model), when this call may read and keep prefixes there; ``(None,
    None)`` when it may not (``policy.keep_reason``) or keeps nothing (budget 0): ``policy.kept_dependencies``."""
    depends = kept_dependencies(model)
    return (None, None) if depends is None else (relay_state(model).store, depends)


def tree_keys(tree: PrefixTree) -> list[PrefixKey]:
    """The store keys of every segment of ``tree`` (``prefill.segment_key``)."""
    return [segment_key(tree, j) for j in range(len(tree.ids))]


def launch_checks(model, tree: PrefixTree, check_row: bool = False) -> tuple[dict, bool]:
    """The checks of ``tree``'s segments kept in the model's prefix store, launched on the device now
    (``SegmentCheck.launch``): ``policy.decide`` calls for this before it walks the model, so the device runs them
    while the host walks (a chat turn's first token comes that much sooner: docs/performance.md, the chat turn).
    Returns ``(launched, whole)``: what ``kept_caches`` takes as ``launched`` (``{}`` where none is kept or none can
    be launched: off CUDA), and whether every segment is kept and no check recorded as a CUDA graph was refused its
    launch (a tensor it read is gone or moved: the model changed; the call then walks the model before it reads any
    verdict, and the walk drops the entry, its graph never replayed). What the call finds is unchanged: a segment the
    walk finds stale is dropped, its launch thrown away. ``check_row``: the call may run a check row
    (``check_row.py``), so no check is launched, only refused where it could not be (``SegmentCheck.launch``)."""
    kept, refused = [], []

    def launch(value) -> dict:
        kept.append(value)
        checks = value.check.launch(model, check_row) if isinstance(value, KeptSegment) else {}
        if checks is None:
            refused.append(value)
            return {}
        return checks

    launched = relay_state(model).store.launch(tree_keys(tree), launch)
    return launched, len(kept) == len(tree.ids) and not refused


def join_checks(model) -> None:
    """The caller's stream made to wait for the kept checks queued on the model's device (``check_stream``): a call
    that launched some (``launch_checks``) and ends before reading them leaves none running past it. No host wait."""
    if model.device.type == "cuda":
        torch.cuda.current_stream(model.device).wait_stream(check_stream(model.device))


def kept_caches(model, trees: list[PrefixTree], store: PrefixStore | None, depends: object,
                pending: list | None = None, launched: dict | None = None,
                check_row=None) -> tuple[list[RelayCache], list[PrefixKey]]:
    """One ``RelayCache`` per tree, taken from ``store`` where kept (``prefix_store``'s answer; ``None``: prefilled,
    nothing kept), a prefix hit counted per tree that took kept tokens (``count_kept``); then the least recently used
    entries are dropped down to the store's budget, the trees' own segments excepted. Returns the caches and those
    segments' keys (for the call to hold while it runs). ``pending`` (a list): the kept segments' checks are left
    unread there (``prefill.prefill_tree``) and no hit is counted: the caller reads them (``PrefixStore.settle``),
    then counts. ``launched``: checks the call launched early (``launch_checks``); ``check_row``: the
    ``check_row.CheckRow`` of a call of one tree whose prefill computes the checks' head."""
    caches, keys = [], []
    for tree in trees:
        caches.append(RelayCache.from_tree(model, tree, store, depends, pending, launched, check_row))
        keys += tree_keys(tree)
    if pending is None:
        count_kept(model, caches)
    if store is not None:
        store.trim(keep=keys)  # what no call holds goes now, not after the call (its memory is the call's)
    return caches, keys


def count_kept(model, caches: list[RelayCache]) -> None:
    """One prefix hit in ``relay_hf.stats`` per cache that took kept tokens (``RelayCache.kept_tokens``)."""
    for cache in caches:
        if cache.kept_tokens:
            relay_state(model).counters.add(prefix_hits=1, prefill_tokens_saved=cache.kept_tokens)
