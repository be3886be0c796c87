"""What ``relay_hf.patch`` keeps on a model instance: its settings and the static caches it may reuse.

One owner: only the methods here read or write it. Per-call state never lives here (a call's plan, cache and
decision are its own), so concurrent ``generate`` calls on one model are as independent as stock's: the one shared
thing, the idle static cache (and the decode step captured on it), is handed to one call at a time under a lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(eq=False)
class StaticSlot:
    """A static ``RelayCache`` and the decode step relay_hf's loop compiled / captured on its buffers (or ``None``).
    Kept together: a CUDA graph replays on the exact buffers it was recorded with."""

    cache: object
    stepper: object = None


@dataclass(eq=False)
class RelayState:
    """Per-model settings of ``patch`` and the idle static slot.

    Attributes:
        original_attn: the attention implementation the model had before ``patch`` (what ``unpatch`` restores).
        min_prefix_length: shortest shared prefix (tokens) worth a separate prefill.
        declined: why ``patch`` left the model on its own attention (``None``: relay serves it).
    """

    original_attn: str
    min_prefix_length: int
    declined: str | None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _idle: StaticSlot | None = field(default=None, repr=False)

    def take_static(self, fits) -> StaticSlot | None:
        """The idle slot if ``fits(slot.cache)``, now owned by the caller; else ``None``, and a slot that does not fit
        is dropped (its buffers and graph are freed before the caller allocates new ones)."""
        with self._lock:
            slot, self._idle = self._idle, None
        return slot if slot is not None and fits(slot.cache) else None

    def give_back_static(self, slot: StaticSlot) -> None:
        """Keep ``slot`` for the next call (one idle slot; a concurrent caller's is dropped if one is kept)."""
        with self._lock:
            if self._idle is None:
                self._idle = slot

    def idle_static(self) -> StaticSlot | None:
        """The idle slot, for inspection (tests, benchmarks); do not use it while a call may run."""
        return self._idle

    def __getstate__(self):  # pickling / deepcopy of a patched model: settings only, no lock, no buffers or graphs
        return {"original_attn": self.original_attn, "min_prefix_length": self.min_prefix_length,
                "declined": self.declined}

    def __setstate__(self, state):
        self.__init__(**state)
