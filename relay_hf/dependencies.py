"""What a model's recorded work depends on besides its inputs: ``kv_dependencies(model)``, one walk of the model as
one comparable value (``Dependencies``), read once per call.

Two readers compare it with what they recorded under:

- the prefix store (``store.PrefixStore``): a kept prefix's KV was computed by the model as it was; any change of the
  whole signature (``Dependencies.signature``) drops every kept entry before the store answers (docs/api.md, "Kept
  prefixes": what a kept segment guarantees, with the per-hit check of ``freshness.SegmentCheck`` for writes no
  counter sees);
- a static slot's recorded decode step and prefills (``state.StaticSlot.made_under``): a CUDA graph reads each weight
  at the address it was recorded with and runs no Python hook, so they are made again under another ``structure``
  (the signature without the parameters' version counters: an in-place write keeps them; docs/api.md, "A model
  changed between calls").

What it holds: each parameter's and buffer's identity, address, dtype, device and shape, each parameter's version
counter (an in-place write through autograd, an optimizer step, ``load_state_dict``), each module's type, training
flag, adapter switches, hooks, forward replaced on the instance, plain values and dicts of plain values (a rotary
``attention_scaling``, PEFT's ``scaling`` dict), torch's global hooks and the attention implementation. Host metadata
only: no device read.
"""

from __future__ import annotations

import functools
import weakref

import torch

from .freshness import local_shard, reached_partly


def _tensors_signature(path: str, params: dict, buffers: dict, seen: set, partial: dict, out: list,
                       versions: list) -> None:
    """Appends to ``out``, per parameter and buffer of one module (``params`` / ``buffers``: its own, not seen
    before): its name, identity, address, dtype, device and shape; to ``versions``, per parameter, its version counter
    (a tensor's ``_version`` goes up at every in-place write made through it: optimizer steps, ``load_state_dict``,
    ``torch.no_grad()`` edits). Not a buffer's version: a rotary table the model rewrites at each forward, as dynamic
    and longrope embeddings do, would drop every kept prefix; a hit's check reads what buffers hold. Host metadata
    only: no device read. Stacked parameters (3+ dims: experts) go into ``partial``."""
    for is_param, tensors in ((True, params), (False, buffers)):
        for name, t in tensors.items():
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            local = t if type(t) in _PLAIN_TENSORS else local_shard(t)
            shape = tuple(t.shape)
            out.append((path, name, id(t), local.data_ptr(), t.dtype, t.device, shape))
            if is_param:
                versions.append(local._version)
                if len(shape) >= 3:
                    partial[id(t)] = t


_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))  # exact types with no shard to ask for (no getattr)
_SCALARS = frozenset((bool, int, float, str, type(None)))  # exact types: no ``__class__`` lookups on other values
_ADAPTER_SWITCHES = ("_disable_adapters", "_active_adapter", "merged_adapters")
_SWITCH_NAMES = frozenset(_ADAPTER_SWITCHES)


def _hooks(hooks: dict) -> tuple:
    return tuple((key, _reference(hook)) for key, hook in hooks.items()) if hooks else ()


def _reference(value) -> object:
    """A weak reference to ``value`` (equal to another only while both are alive and their values equal: a
    ``forward`` replaced by a new one that took the freed one's ``id`` is still a change), or its ``id`` where it
    takes none."""
    try:
        return weakref.ref(value)
    except TypeError:
        return id(value)


def _plain(value) -> bool:
    """A value a forward may read that the signature can hold: a scalar, or a dict of scalars (PEFT's per-adapter
    ``scaling``)."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    return kind is dict and len(value) <= 64 and all(type(v) in _SCALARS for v in value.values())


@functools.cache
def _class_switches(cls: type) -> tuple[str, ...]:
    """The adapter switches ``cls`` declares (PEFT's tuner layers declare them on the class)."""
    return tuple(a for a in _ADAPTER_SWITCHES if hasattr(cls, a))


def _adapters(m: torch.nn.Module, own: dict) -> tuple:
    """The adapter switches of ``m`` (``own``: its ``__dict__``) as strings, those its class declares and those set on
    the instance; ``()`` for a module with neither (most: two lookups)."""
    declared = _class_switches(type(m))
    if not declared and own.keys().isdisjoint(_SWITCH_NAMES):
        return ()
    switches = [a for a in declared if a not in own] + [a for a in _ADAPTER_SWITCHES if a in own]
    return tuple(str(getattr(m, a, None)) for a in switches)


def _modules_signature(model: torch.nn.Module, partial: dict, indexed: list, versions: list) -> tuple:
    """In one walk (every module once, parents first: ``named_modules``' order, without its nested generators, as
    the walk runs at every call), the parameters and buffers (``_tensors_signature``) and per module: its type,
    training flag, adapter switches (PEFT's ``disable_adapters`` / ``active_adapters`` / ``merged_adapters``, where a
    module has them), the forward hooks on it (activation steering changes the KV), a ``forward`` replaced on the
    instance, and the plain values its forward may read (``scaling``, a rotary ``attention_scaling``, a dict of
    adapter scales...); and torch's global forward hooks. The parameters of modules only some tokens reach
    (``freshness.reached_partly``) go into ``partial``, every parameter's version counter into ``versions``;
    ``(layer_idx, module)`` of each module whose own ``layer_idx`` is an int into ``indexed`` (what
    ``prefill.layer_windows`` and ``stats.layer_kv_bytes`` read)."""
    out, tensors, seen, walked = [], [], set(), set()
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    stack = [("", model)]
    while stack:
        path, m = stack.pop()
        if id(m) in walked:
            continue
        walked.add(id(m))
        own = m.__dict__
        children = own["_modules"]
        if children:
            at = f"{path}." if path else ""
            stack.extend([(f"{at}{k}", c) for k, c in reversed(children.items()) if c is not None])
        if own["_parameters"] or own["_buffers"]:
            _tensors_signature(path, own["_parameters"], own["_buffers"], seen, partial, tensors, versions)
        if reached_partly(m, inputs):
            partial.update((id(p), p) for p in m.parameters())
        index = own.get("layer_idx")
        if isinstance(index, int):
            indexed.append((index, m))
        plain = tuple([(k, tuple(sorted(v.items(), key=repr)) if type(v) is dict else v)
                       for k, v in own.items()
                       if k[0] != "_" and (type(v) in _SCALARS or _plain(v))
                       and not k.startswith("relay_")])  # relay_hf's own: not read
        forward = own.get("forward")
        out.append((path, type(m), m.training, _adapters(m, own), _hooks(own["_forward_hooks"]),
                    _hooks(own["_forward_pre_hooks"]), plain, None if forward is None else _reference(forward)))
    from torch.nn.modules import module as torch_module

    out.append((_hooks(torch_module._global_forward_hooks), _hooks(torch_module._global_forward_pre_hooks)))
    return tuple(out), tuple(tensors)


class Dependencies:
    """What ``kv_dependencies`` returns: compared (``==``) by ``signature`` alone, the model's structure and its
    parameters' version counters as one value.

    Attributes:
        structure: the signature without the version counters (every module's type, flags, hooks and plain
            values, every parameter's and buffer's identity, address, dtype, device and shape): what a static slot's
            recorded step and prefills are checked against (``state.StaticSlot.made_under``: a CUDA graph reads by
            address and runs no Python hook), which an in-place write leaves as it was.
        versions: the parameters' version counters, in the walk's order.
        partial: the parameters only some tokens reach (a hit's check reads them), found in the same walk.
        indexed: ``(layer_idx, module)`` of the modules naming their layer (so the call reads per-layer windows and
            KV sizes without walking the model again).
    """

    __slots__ = ("structure", "versions", "partial", "indexed")
    __hash__ = None

    def __init__(self, structure: tuple, versions: tuple, partial: list[torch.Tensor], indexed: tuple = ()):
        self.structure, self.versions, self.partial, self.indexed = structure, versions, partial, indexed

    @property
    def signature(self) -> tuple:
        """``(structure, versions)``: what a kept prefix's KV depends on, holding no module (what the store keeps)."""
        return self.structure, self.versions

    def __eq__(self, other) -> bool:
        return isinstance(other, Dependencies) and self.signature == other.signature


class LatestWalk:
    """A walk kept between calls (``state.RelayState.last_walk``) without holding the model: its structure and
    versions, and weak references to the parameters and modules it found (``Dependencies.partial``, ``indexed``), so
    a module or parameter the user drops is freed as it would be unpatched."""

    __slots__ = ("structure", "versions", "partial", "indexed")

    def __init__(self, depends: Dependencies):
        self.structure, self.versions = depends.structure, depends.versions
        self.partial = tuple(weakref.ref(p) for p in depends.partial)
        self.indexed = tuple((index, weakref.ref(module)) for index, module in depends.indexed)

    def depends(self) -> Dependencies | None:
        """The walk as ``Dependencies`` again, or ``None`` where a parameter or module it found is gone (the model has
        changed since)."""
        partial = [ref() for ref in self.partial]
        indexed = tuple((index, ref()) for index, ref in self.indexed)
        if any(p is None for p in partial) or any(module is None for _, module in indexed):
            return None
        return Dependencies(self.structure, self.versions, partial, indexed)


def kv_dependencies(model: torch.nn.Module) -> Dependencies:
    """Everything a prefix's KV computed by ``model`` now depends on besides its tokens, as one comparable value: its
    ``structure`` and its parameters' ``versions`` (one pass over the parameters and modules, no device read). What
    it cannot see (a write that bypasses version counters) each kept entry's check catches on a hit (module
    docstring)."""
    from ._compat import attn_implementation

    config = getattr(model, "config", None)
    partial: dict[int, torch.Tensor] = {}
    indexed: list[tuple[int, torch.nn.Module]] = []
    versions: list[int] = []
    structure = (attn_implementation(config) if config is not None else None,
                 _modules_signature(model, partial, indexed, versions))
    return Dependencies(structure, tuple(versions), list(partial.values()), tuple(indexed))


def indexed_modules(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(layer_idx, module)`` of every module of ``model`` (once each) whose own ``layer_idx`` is an int: what
    ``Dependencies.indexed`` holds, for a caller without one. Read from the instance's own attributes: a miss
    through ``nn.Module``'s ``__getattr__`` raises inside."""
    found, walked, stack = [], set(), [model]
    while stack:
        m = stack.pop()
        if id(m) in walked:
            continue
        walked.add(id(m))
        own = m.__dict__
        index = own.get("layer_idx")
        if isinstance(index, int):
            found.append((index, m))
        stack.extend([c for c in own["_modules"].values() if c is not None])
    return found
