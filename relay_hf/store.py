"""Prefilled prefixes kept between calls: ``PrefixStore``, and what a kept prefix's KV depends on.

A prefix's KV is a function of its token ids and of the model as it is at prefill time: its weights (edited in place
by a training step or ``load_state_dict``, replaced by ``model.to(...)``), dtype, device, attention implementation,
training mode and adapters. ``kv_dependencies(model)`` reads all of that as one comparable value; the store drops
every entry built under another value before it answers, so a kept prefix is never served to a model it does not
belong to (the entry is prefilled again instead).

The store itself knows nothing of models (testable on its own): entries are keyed by a hashable key (the prefix's
token ids), built on a miss by the caller's function under the store's lock (concurrent callers share one prefill),
and evicted least recently used first down to a byte budget, except those a running call holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from contextlib import contextmanager

import torch

# elements of each weight read into the dependencies (first, middle, last): a write that bypasses the tensor's version
# counter (``param.data.copy_(...)``, a checkpoint loaded through ``.data``) still changes what these read
_SAMPLES = 3


def _weights_signature(model: torch.nn.Module) -> tuple:
    """Per parameter and buffer: its identity, address, dtype, device and version counter (a tensor's
    ``_version`` goes up at every in-place write made through it: optimizer steps, ``load_state_dict``,
    ``torch.no_grad()`` edits), plus its first, middle and last elements, read in one copy per device and dtype."""
    meta, samples = [], {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        meta.append((name, id(t), t.data_ptr(), t.dtype, t.device, t._version, tuple(t.shape)))
        n = t.numel()
        if n and not t.is_meta:
            flat = t.detach().reshape(-1)
            samples.setdefault((str(t.device), t.dtype), []).extend(
                flat[i:i + 1] for i in (0, n // 2, n - 1)[:_SAMPLES])  # views: no copy until the one cat
    ordered = sorted(samples.items(), key=lambda item: str(item[0]))  # by (device, dtype): never print a tensor
    values = tuple((key, tuple(torch.cat(parts).cpu().tolist())) for key, parts in ordered)
    return tuple(meta), values


_SCALARS = (bool, int, float, str, type(None))


def _hooks(hooks: dict) -> tuple:
    return tuple((key, id(hook)) for key, hook in hooks.items())


def _modules_signature(model: torch.nn.Module) -> tuple:
    """Per module: its type, training flag, adapter switches (PEFT's ``disable_adapters`` / ``active_adapters`` /
    ``merged_adapters``, where a module has them), the forward hooks on it (activation steering changes the KV) and
    the plain values its forward may read (``scaling``, a rotary ``attention_scaling``...); and torch's global
    forward hooks."""
    out = []
    for name, m in model.named_modules():
        adapters = tuple(str(getattr(m, a, None)) for a in ("_disable_adapters", "_active_adapter", "merged_adapters")
                         if hasattr(m, a))
        scalars = tuple((k, v) for k, v in vars(m).items()
                        if not k.startswith(("_", "relay_")) and isinstance(v, _SCALARS))  # relay_hf's own: not read
        out.append((name, type(m), m.training, adapters, _hooks(m._forward_hooks), _hooks(m._forward_pre_hooks),
                    scalars))
    from torch.nn.modules import module as torch_module

    out.append((_hooks(torch_module._global_forward_hooks), _hooks(torch_module._global_forward_pre_hooks)))
    return tuple(out)


def kv_dependencies(model: torch.nn.Module) -> tuple:
    """Everything a prefix's KV computed by ``model`` now depends on besides its tokens, as one comparable value:
    equal before and after a change only if the change cannot alter the KV (one pass over the parameters and
    modules, one small device-to-host copy)."""
    from ._compat import attn_implementation

    config = getattr(model, "config", None)
    return (attn_implementation(config) if config is not None else None, _weights_signature(model),
            _modules_signature(model))


def checked_budget(value) -> int:
    """``value`` when it is a valid store budget (a non-negative ``int`` of bytes), else ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"prefix_cache_bytes (the prefix store's budget) must be a non-negative int of bytes, "
                         f"got {value!r}")
    return value


class PrefixStore:
    """Values (prefilled ``RelayCache``s) kept by key, least recently used first out, within ``budget_bytes``.

    Args:
        budget_bytes: bytes of kept values (``nbytes(value)``) beyond which the least recently used are dropped;
            ``0`` keeps nothing between calls.
        nbytes: the bytes a value holds.

    Thread-safe: one lock guards the entries, and a miss builds under it, so threads asking for one key build it once.
    """

    def __init__(self, budget_bytes: int, nbytes: Callable[[object], int]):
        self.budget_bytes = budget_bytes
        self._nbytes = nbytes
        self._entries: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()  # key -> (value, bytes); LRU first
        self._depends: object = None  # what every kept entry was built under
        self._held: dict[Hashable, int] = {}  # key -> running calls holding it (never evicted meanwhile)
        self._lock = threading.RLock()
        self._packed: tuple[tuple, object] | None = None  # (the entries packed, by identity; their packing)
        self.hits = self.misses = 0

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        """A new budget; entries beyond it go at the next ``trim``."""
        self._budget = checked_budget(value)

    def get(self, key: Hashable, depends: object, build: Callable[[], object]) -> object:
        """The value kept for ``key``, or ``build()``'s (then kept). Entries built under other ``depends`` than
        these are dropped first: they belong to a model that has changed since."""
        with self._lock:
            self._check(depends)
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                value = build()
                entry = (value, self._nbytes(value))
            else:
                self.hits += 1
            self._entries[key] = entry
            self._entries.move_to_end(key)
            return entry[0]

    def _check(self, depends: object) -> None:
        if self._entries and self._depends != depends:
            self._entries.clear()
            self._packed = None
        self._depends = depends

    def packed(self, keys: list[Hashable], pack: Callable[[list], object]) -> object:
        """``pack(values of keys)``, kept for the next call with the same entries (the same keys, none rebuilt or
        dropped meanwhile): one packing (``RelayCache.combine``) serves every batch that mixes the same few prompts.
        The packing is not counted in the budget; it goes as soon as one of its entries goes."""
        with self._lock:
            values = [self._entries[k][0] for k in keys]
            ids = tuple(map(id, values))
            if self._packed is None or self._packed[0] != ids:
                self._packed = (ids, pack(values))
            return self._packed[1]

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
        running call stay (so the store may exceed its budget while they run)."""
        with self._lock:
            keep = set(keep) | set(self._held)
            held = self.nbytes()
            for key in list(self._entries):
                if held <= self._budget:
                    break
                if key not in keep:
                    held -= self._entries.pop(key)[1]
            kept = {id(v) for v, _ in self._entries.values()}
            if self._packed is not None and not set(self._packed[0]) <= kept:
                self._packed = None  # it holds a dropped entry's KV: let that go too

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._packed = None

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
