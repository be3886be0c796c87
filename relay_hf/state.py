"""What ``relay_hf.patch`` keeps on a model instance: its settings and the static caches it may reuse.

One owner: only this module reads or writes it on the model (``relay_state``, ``attach_state``, ``detach_state``),
and only the methods here change it. Per-call state never lives here (a call's route, cache and decision are its
own), so concurrent ``generate`` calls on one model are as independent as stock's: the one shared thing, the idle
static caches (and the decode steps captured on them), are handed to one call at a time under a lock.
"""

from __future__ import annotations

import threading
from dataclasses import InitVar, dataclass, field

from .counters import Counters
from .dependencies import Dependencies, LatestWalk, kv_dependencies
from .prefill import segment_nbytes
from .store import PrefixStore


@dataclass(eq=False)
class StaticSlot:
    """A static ``RelayCache``, the decode step relay_hf's loop compiled / captured on its buffers and its recorded
    suffix prefills (``suffix_prefill.SuffixPrefill``; each ``None`` until made), and the model's ``structure`` they
    were made under (``dependencies.Dependencies.structure``). Kept together: a CUDA graph replays on the exact
    buffers it was recorded with."""

    cache: object
    stepper: object = None
    prefill: object = None
    structure: object = field(default=None, repr=False)

    def made_under(self, structure: object) -> StaticSlot:
        """This slot for a call on the model as it is now (``structure``): a step and prefills made under another
        structure are dropped (made again by the call), the buffers kept. A CUDA graph reads each parameter and
        buffer at the address it was recorded with and runs no Python hook, and a compiled step's view of the model
        holds the modules on the path to its decoder layers, so a parameter or module replaced, a hook added or the
        dtype changed since would be replayed stale; an in-place write keeps them (the graph reads the new values)."""
        if self.structure != structure:
            self.stepper = self.prefill = None
            self.structure = structure
        return self

    def replayable(self, structure: object) -> bool:
        """Whether a call routed under ``structure`` before walking the model itself (the model's latest walk:
        ``Route.deferred_walk``) may replay this slot's recorded prefills before its walk confirms it: they were
        made under another structure (``made_under`` drops them), or every parameter and buffer they read is still
        allocated where it was (``SuffixPrefill.allocated``): a graph reads by address, and a freed one could fault
        the device. What they compute meanwhile is thrown away where the walk then finds the model changed; where
        this is ``False`` the call walks first (``generate._static_slot``)."""
        return self.structure != structure or self.prefill is None or self.prefill.allocated()

    def recordings(self) -> tuple:
        """What the slot has recorded so far, as a comparable value: its step and how far it got (warming up,
        captured), its prefills' lengths."""
        step, prefill = self.stepper, self.prefill
        return step, getattr(step, "state", None), prefill, tuple(getattr(prefill, "graphs", ()))

    def confirm(self, before: tuple, model) -> None:
        """After a call that took the slot with ``recordings()`` equal to ``before``: where the call recorded more, the
        model is walked again, and if its structure is not the one the call was routed under (another thread changed
        the model meanwhile), what was recorded is marked as made under an unknown structure, so the next call makes
        it again. (A change made and undone while the call records is not seen: docs/api.md.)"""
        if self.recordings() != before and walk(model).structure != self.structure:
            self.structure = None


@dataclass(eq=False)
class RelayState:
    """Per-model settings of ``patch`` and the idle static slots (at most ``MAX_IDLE``, most recent first: two, so a
    job alternating two batch buckets replays both without capturing again).

    Attributes:
        original_attn: the attention implementation the model had before ``patch`` (what ``unpatch`` restores).
        min_prefix_length: shortest shared prefix (tokens) worth a separate prefill.
        declined: why ``patch`` left the model on its own attention (``None``: relay serves it).
        decode: which decode loop ``patch(model, decode=...)`` chose (``loop_rules.loop_choice_reason``).
        prefix_cache_bytes: the initial budget of ``store``, the prefilled prefix segments kept between calls (``0``:
            none); it lives in ``store.budget_bytes`` from then on.
        counters: what ``relay_hf.stats`` reports.
        prefill_eager: why the rows' own tokens are no longer prefilled as recorded CUDA graphs on this model (a
            recording failed: ``suffix_prefill.py``), or ``None``.
        prefill_uncompiled: why they are no longer recorded through the decode step's compiled region (compiling or
            recording it failed: ``suffix_prefill.py``), or ``None``.
        last_walk: the model's latest walk (``walk``), under which a chat turn is routed before it walks the model
            itself (``policy.decide``, ``Route.deferred_walk``), or ``None``.
    """

    original_attn: str
    min_prefix_length: int
    declined: str | None
    decode: str = "auto"
    prefix_cache_bytes: InitVar[int] = 0
    counters: Counters = field(default_factory=Counters, repr=False)  # ``relay_hf.stats``
    prefill_eager: str | None = field(default=None, repr=False)
    prefill_uncompiled: str | None = field(default=None, repr=False)
    last_walk: LatestWalk | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _idle: list = field(default_factory=list, repr=False)
    _regions: dict = field(default_factory=dict, repr=False)
    MAX_IDLE = 2

    def __post_init__(self, prefix_cache_bytes: int):
        # prefilled prefix segments kept between calls (generate and the pipeline), within the budget
        self.store = PrefixStore(prefix_cache_bytes, segment_nbytes)

    def stop_recording_prefills(self, reason: str) -> None:
        """From now on this model's suffix prefills run as eager ops (``reason``: why its recording failed)."""
        self.prefill_eager = reason

    def stop_compiling_prefills(self, reason: str) -> None:
        """From now on this model's suffix prefills are recorded through its eager forward (``reason``: why the compiled
        one failed)."""
        self.prefill_uncompiled = reason

    def take_static(self, fits) -> StaticSlot | None:
        """The first idle slot (most recent first) for which ``fits(slot.cache)`` holds, now owned by the caller. When
        none fits, ``None``, and the least recent slot is dropped if the caller's new one would be one too many (its
        buffers and graphs are freed before the caller allocates new ones)."""
        with self._lock:
            for i, slot in enumerate(self._idle):
                if fits(slot.cache):
                    return self._idle.pop(i)
            del self._idle[self.MAX_IDLE - 1:]
        return None

    def give_back_static(self, slot: StaticSlot) -> None:
        """Keep ``slot`` for the next call, first in line; beyond ``MAX_IDLE`` the least recent is dropped."""
        with self._lock:
            self._idle.insert(0, slot)
            del self._idle[self.MAX_IDLE:]

    def region(self, key, make):
        """The compiled decoder-layer region for ``key`` (the compile settings; ``regional.py``), made by ``make()``
        the first time: shared by the decode steps of every batch bucket and prompt length, so a new one compiles
        nothing."""
        with self._lock:
            if key not in self._regions:
                self._regions[key] = make()
            return self._regions[key]

    def idle_static(self) -> StaticSlot | None:
        """The most recent idle slot, for inspection (tests, benchmarks); do not use it while a call may run."""
        return self._idle[0] if self._idle else None

    def idle_slots(self) -> tuple[StaticSlot, ...]:
        """Every idle slot, most recent first (at most ``MAX_IDLE``): a snapshot for inspection (tests, benchmarks)."""
        with self._lock:
            return tuple(self._idle)

    def __getstate__(self):  # pickling / deepcopy of a patched model: settings only, no lock, no buffers or graphs
        return {"original_attn": self.original_attn, "min_prefix_length": self.min_prefix_length,
                "declined": self.declined, "decode": self.decode,
                "prefix_cache_bytes": self.store.budget_bytes}

    def __setstate__(self, state):
        self.__init__(**state)


_ATTRIBUTE = "_relay_state"  # where a patched model instance holds its RelayState (pickled with the model)


def relay_state(model) -> RelayState | None:
    """The ``RelayState`` that ``relay_hf.patch`` keeps on ``model`` (an attribute of the instance), or ``None`` for a
    model it has not patched (or anything that is not a model): every reader goes through here."""
    return getattr(model, "__dict__", {}).get(_ATTRIBUTE)


def attach_state(model, state: RelayState) -> None:
    """Keep ``state`` on ``model`` (``patch``): an attribute of the instance, so copies and pickles carry it."""
    setattr(model, _ATTRIBUTE, state)


def walk(model) -> Dependencies:
    """``dependencies.kv_dependencies(model)``, kept as the model's latest walk (``RelayState.last_walk``) where it is
    patched. Every walk of a patched model goes through here."""
    depends = kv_dependencies(model)
    state = relay_state(model)
    if state is not None:
        state.last_walk = LatestWalk(depends)
    return depends


def detach_state(model) -> RelayState:
    """Take ``model``'s ``RelayState`` off it and return it (``unpatch``; ``KeyError`` when there is none)."""
    return model.__dict__.pop(_ATTRIBUTE)
