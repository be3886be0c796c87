"""Prefilled prefixes kept between calls: ``PrefixStore``, and what a kept prefix's KV depends on.

A prefix's KV is a function of its token ids and of the model as it is at prefill time. Two checks stand between a
kept prefix and a model that has changed since (docs/api.md, "Kept prefixes", states the guarantee):

- ``dependencies.kv_dependencies(model)``, read once per call: the model's signature as one comparable value (each
  parameter's and buffer's identity, address and shape, each parameter's version counter, each module's type,
  flags, hooks and plain values...). The store drops every entry built under another value before it answers.
- on every hit, the entry's own check (``freshness.SegmentCheck``): what it recomputes through the model as it is now
  must equal, bit for bit, what it recorded when the entry was built: it is there for what no counter sees (a write
  through ``.data``, into raw storage); docs/api.md says which of those it catches. Read at once, or by a caller that
  launches its own work first (``get(..., pending=...)``) when it reads it (``settle``), throwing that work away
  (``StaleKept``) when it failed.

The store itself knows nothing of models (testable on its own): entries are keyed by a hashable key (a
``PrefixKey``: where a prefix segment starts and its full prefix's token ids), built on a miss by the caller's
function under the store's lock (concurrent callers share one prefill), checked on a hit by the caller's function,
and evicted least recently used first down to a byte budget, except those a running call holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from contextlib import contextmanager
from typing import NamedTuple

import torch


class StaleKept(Exception):
    """A kept segment a call read before its check's verdict failed that check (``PrefixStore.settle``): the call
    throws away what it computed from it and runs again."""


def checked_budget(value) -> int:
    """``value`` when it is a valid store budget (a non-negative ``int`` of bytes), else ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"prefix_cache_bytes (the prefix store's budget) must be a non-negative int of bytes, "
                         f"got {value!r}")
    return value


class PrefixKey(NamedTuple):
    """The key of a kept prefix segment: ``start``, where it starts, and ``data``, its full prefix's token ids as the
    bytes of their ``[P]`` tensor (its KV depends on all of them; a kept entry holds its own positions only, so a root
    and a child of the same ids are different entries). Bytes: hashable and compared exactly. A tuple, so it equals
    (and hashes as) ``(start, data)``."""

    start: int
    data: bytes

    @classmethod
    def of(cls, start: int, ids: torch.Tensor) -> PrefixKey:
        """The key of a segment starting at ``start`` whose full prefix is ``ids`` (``[P]`` integer, any device): the
        ids as int64, so int32 ``input_ids`` find what int64 ones kept."""
        return cls(start, ids.to("cpu", torch.int64).numpy().tobytes())

    @property
    def tokens(self) -> int:
        """How many token ids the key holds (``P``), read without decoding them."""
        return len(self.data) // 8  # int64 ids

    def extends(self, other: Hashable) -> bool:
        """Whether this key's full prefix is ``other``'s followed by more tokens: its KV was computed after
        ``other``'s tokens (a document kept under a prompt), so a change that makes ``other`` stale reaches it."""
        return (isinstance(other, PrefixKey) and len(self.data) > len(other.data)
                and self.data.startswith(other.data))

    def ids(self) -> torch.Tensor:
        """The full prefix's token ids, ``[P]`` int64 on the CPU (a copy: the key stays as it is)."""
        return torch.frombuffer(bytearray(self.data), dtype=torch.int64)


def _extends(key: Hashable, other: Hashable) -> bool:
    return isinstance(key, PrefixKey) and key.extends(other)


class BudgetStore:
    """Values kept by key, least recently used first out, within ``budget_bytes``; held (a running call reads them)
    and pinned keys stay. ``PrefixStore`` adds what a kept prefix needs.

    Args:
        budget_bytes: bytes of kept values (``nbytes(value)``) beyond which the least recently used are dropped;
            ``0`` keeps nothing between calls.
        nbytes: the bytes a value holds.

    Thread-safe: one lock guards the entries.
    """

    def __init__(self, budget_bytes: int, nbytes: Callable[[object], int]):
        self.budget_bytes = budget_bytes
        self._nbytes = nbytes
        self._entries: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()  # key -> (value, bytes); LRU first
        self._held: dict[Hashable, int] = {}  # key -> running calls holding it (never evicted meanwhile)
        self._pinned: set[Hashable] = set()  # keys never evicted for the budget (relay_hf.pin); kept until unpinned
        self._lock = threading.RLock()

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        """A new budget; entries beyond it go at the next ``trim``."""
        self._budget = checked_budget(value)

    def resize(self, budget_bytes: int) -> None:
        """A new budget (validated), the least recently used entries beyond it dropped now (held and pinned ones
        stay). ``ValueError`` for a budget below the pinned entries' bytes (``unpin`` first)."""
        pinned = self.pinned_nbytes()
        if checked_budget(budget_bytes) < pinned:
            raise ValueError(f"prefix_cache_bytes={budget_bytes} is below the {pinned} bytes of pinned prompts; "
                             "relay_hf.unpin them first")
        self.budget_bytes = budget_bytes
        self.trim()

    def pin(self, key: Hashable) -> None:
        """Keep ``key``'s entry whatever least-recently-used eviction would drop (it must be kept now). Its bytes
        count against the budget: ``ValueError`` when the pinned entries would not fit it."""
        with self._lock:
            if key not in self._entries:
                raise ValueError("only a kept prefix can be pinned")
            pinned = self.pinned_nbytes() + (0 if key in self._pinned else self._entries[key][1])
            if pinned > self._budget:
                raise ValueError(f"pinned prompts would hold {pinned} bytes, over prefix_cache_bytes="
                                 f"{self._budget}; relay_hf.patch(model, prefix_cache_bytes=...) with more, or unpin "
                                 "others")
            self._pinned.add(key)
            self.trim()

    def unpin(self, key: Hashable) -> bool:
        """Let ``key``'s entry be evicted again (least recently used first); whether it was pinned."""
        with self._lock:
            if key not in self._pinned:
                return False
            self._pinned.discard(key)
            self.trim()
            return True

    def pinned(self) -> list:
        """The pinned keys (kept or not: an entry dropped because the model changed is pinned again when it is
        prefilled anew)."""
        with self._lock:
            return list(self._pinned)

    def pinned_nbytes(self) -> int:
        """Bytes the pinned entries hold now."""
        with self._lock:
            return sum(self._entries[k][1] for k in self._pinned if k in self._entries)

    @contextmanager
    def holding(self, keys: Iterable[Hashable]):
        """Keep ``keys`` from eviction while the block runs (a running call reads them)."""
        keys = list(keys)
        with self._lock:
            for k in keys:
                self._held[k] = self._held.get(k, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                for k in keys:
                    self._held[k] -= 1
                    if not self._held[k]:
                        del self._held[k]
                self.trim()

    def trim(self, keep: Iterable[Hashable] = ()) -> None:
        """Drop least recently used entries until the kept bytes fit the budget; entries in ``keep`` or held by a
        running call stay (so the store may exceed its budget while they run; a call lets go of them when it ends,
        ``holding``, and the store is within its budget again)."""
        with self._lock:
            keep = set(keep) | set(self._held) | self._pinned
            held = self.nbytes()
            for key in list(self._entries):
                if held <= self._budget:
                    break
                if key not in keep:
                    held -= self._entries.pop(key)[1]
            self._dropped()

    def _dropped(self) -> None:
        """Entries may have gone (``trim``): what depends on them goes too (none here)."""

    def clear(self) -> None:
        """Drop every entry, pinned ones too (and their pins)."""
        with self._lock:
            self._entries.clear()
            self._pinned.clear()
            self._dropped()

    def nbytes(self) -> int:
        """Bytes the kept values hold now."""
        with self._lock:
            return sum(n for _, n in self._entries.values())

    def values(self) -> list:
        """The kept values, least recently used first."""
        with self._lock:
            return [v for v, _ in self._entries.values()]

    def keys(self) -> list:
        """The kept keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries


class PrefixStore(BudgetStore):
    """A ``BudgetStore`` of prefilled prefixes (``prefill.KeptSegment``s, or ``RelayCache``s): every entry was built
    under one ``kv_dependencies`` (others drop them all), a hit may be checked (``fresh``) at once or late
    (``settle``), a segment kept under another goes with it, and a batch's packing of several is kept with them.
    A miss builds under the lock, so threads asking for one key build it once."""

    def __init__(self, budget_bytes: int, nbytes: Callable[[object], int]):
        super().__init__(budget_bytes, nbytes)
        self._depends: object = None  # the signature every kept entry was built under
        self._packed: tuple[tuple, object] | None = None  # (the entries packed, by identity; their packing)
        self.hits = self.misses = self.stale = 0

    def get(self, key: Hashable, depends: object, build: Callable[[], object],
            fresh: Callable[[object], object] | None = None, pending: list | None = None) -> object:
        """The value kept for ``key``, or ``build()``'s (then kept). Entries built under other ``depends`` than
        these are dropped first: they belong to a model that has changed since; so is a kept value for which
        ``fresh(value)`` is false (``stale`` counts those), unless it answers with a verdict not read yet (not a
        ``bool``: a device tensor) and ``pending`` is given: then the value is served, ``(key, value, verdict)``
        appended there for ``settle``. Building ``key`` drops the entries kept under it (``PrefixKey.extends``):
        their KV was computed after the value this one replaces (evicted, or stale in a way their own checks may
        not see), so they are built again on the new one."""
        with self._lock:
            self._check(depends)
            entry = self._entries.get(key)
            if entry is not None and fresh is not None:
                verdict = fresh(entry[0])
                if pending is not None and not isinstance(verdict, bool):
                    pending.append((key, entry[0], verdict))
                elif not verdict:
                    self._drop_stale(key)
                    entry = None
            if entry is None:
                self._drop_under(key)
                value = build()
                self.misses += 1  # (after: a build that raises builds nothing)
                entry = (value, self._nbytes(value))
            else:
                self.hits += 1
            self._entries[key] = entry
            self._entries.move_to_end(key)
            return entry[0]

    def launch(self, keys: Iterable[Hashable], launch: Callable[[object], dict]) -> dict:
        """``launch(value)`` of each value kept for ``keys``, merged (``{}`` for none): a hit's check started before
        ``get`` asks for its verdict. Under the lock, as ``get`` runs a check: one thread at a time replays a
        check's graph. Nothing else changes (the LRU order, the counters)."""
        launched: dict = {}
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    launched.update(launch(entry[0]))
        return launched

    def checking(self):
        """The lock under which ``get`` and ``launch`` run a check: held by a check run apart from them
        (``check_row.CheckRow.holds``), so one thread at a time replays a check's graph."""
        return self._lock

    def settle(self, pending: list) -> None:
        """Read the verdicts ``get`` left in ``pending`` (the host waits for the device once), and empty it. An entry
        whose check failed is dropped as ``get`` drops a stale one, its hit uncounted, then ``StaleKept``."""
        served = [(key, value, bool(verdict)) for key, value, verdict in pending]
        pending.clear()
        failed = [(key, value) for key, value, held in served if not held]
        if failed:
            with self._lock:
                for key, value in failed:
                    entry = self._entries.get(key)
                    if entry is not None and entry[0] is value:
                        self._drop_stale(key)
                    else:  # another call dropped it first (counted) and may have built it again: not under the new one
                        self.stale += self._drop_under(key)
                self.hits -= len(served)  # the call is run again, and its run counts what it takes
            raise StaleKept(f"{len(failed)} kept prefix segment(s) failed their check")

    def built_under(self, depends: object) -> bool:
        """Whether the entries kept now were built under ``depends`` (its ``signature``): a call routed under the
        model's latest walk reads them only then (``policy.decide``), so a walk older than the entries never drops
        them."""
        return self._depends == getattr(depends, "signature", depends)

    def abandon(self, pending: list) -> None:
        """Forget the verdicts ``get`` left in ``pending`` without reading them, and empty it, their hits uncounted:
        the call that took them is run again (``policy.RouteChanged``), and its run counts what it takes."""
        with self._lock:
            self.hits -= len(pending)
        pending.clear()

    def _drop_stale(self, key: Hashable) -> None:
        """Drop ``key``'s entry, which failed its check, and every entry kept under it (``_drop_under``); each counts
        in ``stale``."""
        del self._entries[key]
        self.stale += 1 + self._drop_under(key)
        self._packed = None

    def _drop_under(self, key: Hashable) -> int:
        """Drop every entry kept under ``key`` (``PrefixKey.extends``), and say how many: their KV was computed after
        a value of ``key`` that is gone (evicted, or stale), and their own checks recompute only their first tokens
        and embed only their own tokens, so a change that only that value's tokens see would pass them."""
        under = [k for k in self._entries if _extends(k, key)]
        for k in under:
            del self._entries[k]
        if under:
            self._packed = None
        return len(under)

    def _check(self, depends: object) -> None:
        signature = getattr(depends, "signature", depends)  # not the Dependencies: its walk holds the modules
        if self._entries and self._depends != signature:
            self._entries.clear()
            self._packed = None
        self._depends = signature

    def packed(self, keys: list[Hashable], pack: Callable[[list], object]) -> object | None:
        """``pack(values of keys)``, kept for the next call with the same entries (the same keys, none rebuilt or
        dropped meanwhile): one packing (``RelayCache.combine``) serves every batch that mixes the same few prompts.
        The packing is not counted in the budget; it goes as soon as one of its entries goes. ``None`` where one of
        the keys is no longer kept (another thread dropped it since the caller took it)."""
        with self._lock:
            if not all(k in self._entries for k in keys):
                return None
            values = [self._entries[k][0] for k in keys]
            ids = tuple(map(id, values))
            if self._packed is None or self._packed[0] != ids:
                self._packed = (ids, pack(values))
            return self._packed[1]

    def _dropped(self) -> None:
        kept = {id(v) for v, _ in self._entries.values()}
        if self._packed is not None and not set(self._packed[0]) <= kept:
            self._packed = None  # it holds a dropped entry's KV: let that go too
        if not self._entries:
            self._depends = None
