"""A kept prefix's check run as one more row of the call's recorded suffix prefill (``CheckRow``), so a chat turn
reads the model's weights once, not twice.

Why: on a hit, a kept segment's check recomputes the first ``CHECK_TOKENS`` tokens of its prefix through every layer
(``freshness.SegmentCheck``), a forward that reads every weight, as the turn's own prefill does; a short turn on a GPU
is bound by those reads (docs/performance.md, the chat turn). Here the check's tokens ride in a spare row of the
prefill (the bucket's, or a one-row turn laid out at two rows: ``DecodeConfig.check_row_bucket``), after the kept
prefix like every row but at the positions where the standalone check computes them, and that row's keys and
values at every layer are compared bit for bit with what the same recorded graph gave when the standalone check last
held for the entry.

Why that is exact: the row's keys and values are a function of the kept prefix's KV, the row's tokens and the
model's parameters, computed by the same recorded kernels at the same shapes (no kernel mixes rows: each row's
matrix products, norms and attention read that row alone), so an unchanged model gives the same bits, and a row
equal to its reference means the parameters it passed through gave what they gave under a model the standalone
check passed. Where the graph has no reference yet, or the row differs, the standalone check decides
(``SegmentCheck.holds``), queued after the prefill (a call that may run a check row launches none before it:
``SegmentCheck.launch``), and a pass records the row as the graph's reference: a mismatch costs one standalone check,
never a wrong answer. A change is seen where it alters the row's KV at some layer; the standalone check's tokens
attend to nothing before them, the row's to the kept prefix too, so a change can show in one and not the other
(docs/api.md, "Kept prefixes").
"""

from __future__ import annotations

import weakref

import torch

from .freshness import CHECK_TOKENS, SegmentCheck, equal_on_device


class CheckRow:
    """One call's check row: its tokens, and the keys and values the call's prefill gave them.

    Attributes:
        n: the row's own tokens: the first ``min(CHECK_TOKENS, P)`` tokens of the kept prefix (``P`` tokens), those
            every kept segment's check recomputes.
        graph: the recorded prefill (``suffix_prefill._Graph``) that computed ``kv``, or ``None``.
        kv: ``[layers * 2 * H_kv * n * D]`` in the cache's dtype, on its device: the row's keys and values at every
            layer, flattened, as that replay wrote them into the static cache; ``None`` where the call's prefill did
            not replay a recorded graph (its first run at a length, a prefill left eager): then every segment's
            standalone check decides.
    """

    def __init__(self, model, store, prefix_length: int):
        self.model, self.store = model, store
        self.n = min(CHECK_TOKENS, prefix_length)
        self.graph = self.kv = None

    def pads(self, suffix: int) -> int:
        """The row's left padding in a prefill of ``suffix`` own tokens per row."""
        return suffix - self.n

    def lay_out(self, ids: torch.Tensor, pos: torch.Tensor, prefix: int) -> None:
        """Write the row over ``ids`` / ``pos`` (``[T]`` int64 each, a row of the call's relay layout and its
        positions, the first ``prefix`` columns the kept prefix), on their device (nothing copied from the host, so
        nothing waits): padding (the prefix's first token at position 0, masked by the slot's ``pads``: every input
        of the row is fixed), then the prefix's first ``n`` tokens at positions ``0 .. n - 1``, where the standalone
        check computes them (a position table is read where it reads it)."""
        n = self.n
        ids[prefix:] = ids[:1].expand(ids.shape[0] - prefix)
        ids[-n:] = ids[:n]
        pos[prefix:] = 0
        pos[-n:] = torch.arange(n, device=pos.device)

    def supply(self, graph, cache, row: int, suffix: int) -> None:
        """Take the row's keys and values from ``cache`` (the static ``RelayCache`` the recorded ``graph`` just
        prefilled, ``suffix`` own positions per row, the check row at ``row``): queued after the replay on the
        caller's stream, nothing read back."""
        n = self.n
        parts = [t[row, :, suffix - n:suffix].reshape(-1) for layer in cache.layers for t in (layer.keys,
                                                                                                layer.values)]
        self.graph, self.kv = graph, torch.cat(parts)

    def verdict(self, check: SegmentCheck, full_ids: torch.Tensor, rest, memo: dict) -> _Verdict:
        """``check``'s verdict with its head left to this row: ``rest`` is what the check compared without it
        (embeddings, partial sums; a ``bool`` or a device verdict); ``memo``: the call's (``SegmentCheck.verdict``)."""
        return _Verdict(self, check, full_ids, rest, memo)

    def holds(self, check: SegmentCheck, full_ids: torch.Tensor, memo: dict) -> bool:
        """Whether the row equals ``check``'s reference for the graph that computed it (read now: the host waits
        for the prefill), else whether the standalone check holds; a pass then records the row. The standalone
        check is queued after the prefill (``freshness.check_stream`` waits for the caller's stream), so a weight
        written between the two fails it and no row computed under other weights than it passed is recorded."""
        if self.kv is not None:
            with self.store.checking():  # (the references: one thread at a time)
                reference = _reference(check, self.graph)
            if reference is not None and bool(equal_on_device(reference, self.kv)):
                return True
        with self.store.checking():  # one thread at a time replays a check's graph
            held = check.verdict(self.model, full_ids, {**memo, "check_row": None})
        held = bool(held)
        if held:
            with self.store.checking():
                self.keep(check)
        return held

    def keep(self, check: SegmentCheck) -> None:
        """Record the row as ``check``'s reference for its graph (nothing where the prefill replayed none); the
        references of graphs since freed go. The caller holds the store's lock (``PrefixStore.checking``)."""
        if self.kv is None:
            return
        references = check.rows
        _prune(references)
        references.pop(id(self.graph), None)  # (its newest last)
        while len(references) >= MAX_REFERENCES:
            references.pop(next(iter(references)), None)
        references[id(self.graph)] = (weakref.ref(self.graph), self.kv)


MAX_REFERENCES = 4  # reference rows a kept check holds at most (a slot's few recorded lengths), the oldest out first


def _prune(references: dict) -> None:
    """Drop the references of graphs since freed."""
    for key in [k for k, (graph, _) in list(references.items()) if graph() is None]:
        references.pop(key, None)


def _reference(check: SegmentCheck, graph) -> torch.Tensor | None:
    """``check``'s reference row for ``graph`` (``CheckRow.keep``), or ``None``."""
    _prune(check.rows)
    entry = check.rows.get(id(graph))
    return entry[1] if entry is not None and entry[0]() is graph else None


class _Verdict:
    """A kept segment's verdict whose head is the call's check row: ``bool()`` reads it once the call's prefill is
    launched (``PrefixStore.settle``)."""

    def __init__(self, row: CheckRow, check: SegmentCheck, full_ids: torch.Tensor, rest, memo: dict):
        self.row, self.check, self.full_ids, self.rest, self.memo = row, check, full_ids, rest, memo

    def __bool__(self) -> bool:
        return bool(self.rest) and self.row.holds(self.check, self.full_ids, self.memo)
