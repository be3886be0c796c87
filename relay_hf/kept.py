"""The prefixes a call takes from the model's prefix store: one way for ``generate`` and the pipeline alike.

Per prefix tree, its segments' KV is taken from the store where it was kept for the model as it is now, else
prefilled and kept there (``RelayCache.from_tree``, ``prefill.prefill_tree``); a tree that took some counts one prefix
hit in ``relay_hf.stats``; then the store is trimmed back to its budget, the call's own segments kept (the call holds
them while it runs: ``PrefixStore.holding``).
"""

from __future__ import annotations

from .cache import RelayCache
from .policy import keep_reason
from .prefill import segment_key
from .prefix import PrefixTree
from .state import relay_state
from .store import PrefixKey, PrefixStore, kv_dependencies


def prefix_store(model) -> tuple[PrefixStore | None, object]:
    """``(store, depends)``: the model's prefix store and what its entries must have been built under
    (``store.kv_dependencies``, one walk of the model), when this call may read and keep prefixes there; ``(None,
    None)`` when it may not (``policy.keep_reason``) or keeps nothing (budget 0)."""
    store = relay_state(model).store
    if store.budget_bytes == 0 or keep_reason(model) is not None:
        return None, None
    return store, kv_dependencies(model)


def tree_keys(tree: PrefixTree) -> list[PrefixKey]:
    """The store keys of every segment of ``tree`` (``prefill.segment_key``)."""
    return [segment_key(tree, j) for j in range(len(tree.ids))]


def kept_caches(model, trees: list[PrefixTree], store: PrefixStore | None,
                depends: object) -> tuple[list[RelayCache], list[PrefixKey]]:
    """One ``RelayCache`` per tree, taken from ``store`` where kept (``prefix_store``'s answer; ``None``: prefilled,
    nothing kept), a prefix hit counted per tree that took kept tokens (``RelayCache.kept_tokens``); then the least
    recently used entries are dropped down to the store's budget, the trees' own segments excepted. Returns the caches
    and those segments' keys (for the call to hold while it runs)."""
    caches, keys = [], []
    for tree in trees:
        cache = RelayCache.from_tree(model, tree, store, depends)
        if cache.kept_tokens:
            relay_state(model).counters.add(prefix_hits=1, prefill_tokens_saved=cache.kept_tokens)
        caches.append(cache)
        keys += tree_keys(tree)
    if store is not None:
        store.trim(keep=keys)  # what no call holds goes now, not after the call (its memory is the call's)
    return caches, keys
