"""What ``relay_hf.stats`` counts: ``RelayStats``, the frozen snapshot, and ``Counters``, its mutable side that a
patched model's ``RelayState`` owns.

Updates take a lock, so concurrent calls on one model count exactly; ``unpatch`` drops them with the rest of the
patch. A module of its own, below ``state.py`` (which holds the counters) and ``stats.py`` (which reads them).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields


@dataclass(frozen=True)
class RelayStats:
    """Counters since ``patch`` (all ints).

    Attributes:
        relay_steps: decode steps (continuous batching: forward steps) in which relay read a shared prefix once for
            several rows: every decode step of a relay ``generate`` call (one per new token after the first) where
            at least two rows read a shared segment.
        relay_rows: rows those steps served (one per row and step).
        kv_bytes_not_reread: prefix KV bytes that stock attention would have read in those steps and relay did not.
            Per decode step, layer and shared segment, stock reads, for each row that reads the segment, the segment
            tokens that row's query sees: all of them in a full-attention layer; in a layer with a sliding window
            ``w``, those at positions ``> t - w`` for a query at position ``t`` (at most the segment's last
            ``w - 1`` tokens, all that a trimmed ``RelayCache`` layer keeps of it). Relay reads them once, as many
            as the reader that sees the most. The difference times the layer's bytes per token (its KV heads times
            its key and value head dims, in the model's dtype) is counted: ``(readers - 1) * tokens`` in a
            full-attention layer; in a windowed layer less, and nothing once the rows' windows have moved past the
            segment. Continuous batching counts per forward step ``(readers - 1) * tokens`` of each shared run of
            blocks over the full-attention layers (it runs stock for models with sliding-window layers). On its
            flash road the kernel counts on the device, per decode step, the shared tokens the requests would each
            have read less those its tiles read, for all models of the process that run it.
        prefix_hits: calls (pipeline batches, ``generate`` calls) whose shared prefix came from the prefix store
            instead of a prefill.
        prefill_tokens_saved: prefix tokens those hits did not prefill again.
        stock_calls: calls relay_hf handed to stock transformers (``relay_last_decision`` says why).
        pinned_bytes: bytes the pinned prompts' KV holds in the prefix store now (``relay_hf.pin``): a level read
            when the snapshot is taken, not a count.
    """

    relay_steps: int = 0
    relay_rows: int = 0
    kv_bytes_not_reread: int = 0
    prefix_hits: int = 0
    prefill_tokens_saved: int = 0
    stock_calls: int = 0
    pinned_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


_NAMES = tuple(f.name for f in fields(RelayStats))


@dataclass(eq=False)
class Counters:
    """The mutable side of ``RelayStats``, owned by a model's ``RelayState``."""

    _values: dict = field(default_factory=lambda: dict.fromkeys(_NAMES, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # amounts counted elsewhere while something runs (continuous batching's flash kernel counts on the device): key
    # -> a function returning them as ``add`` takes them, read at every snapshot
    _sources: dict = field(default_factory=dict, repr=False)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += int(amount)

    def follow(self, key, read) -> None:
        """Add what ``read()`` returns to every snapshot until ``settle(key)``."""
        with self._lock:
            self._sources[key] = read

    def settle(self, key) -> None:
        """Fold ``key``'s amounts in for good and stop following it."""
        with self._lock:
            read = self._sources.pop(key, None)
        if read is not None:
            self.add(**read())

    def snapshot(self) -> RelayStats:
        with self._lock:
            values, sources = dict(self._values), list(self._sources.values())
        for read in sources:
            for name, amount in read().items():
                values[name] += int(amount)
        return RelayStats(**values)
