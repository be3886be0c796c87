"""The layers of a ``RelayCache``, one class per kind (as transformers' ``cache_utils`` layers): ``RelayLayer`` (a
shared prefix stored once, a growing per-row suffix), ``StaticRelayLayer`` (the suffix preallocated and written in
place, for compiled and captured decode steps), and what they hand attention (``RelayKV``) and the mask
(``RelayOffset``). A sliding-window layer is either kind with ``window`` set: it stores of each prefix segment only
what its window sees (``prefill.trim_window``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin
from transformers.utils import is_torchdynamo_compiling

from .kernels.groups import PrefixGroups
from .kernels.metadata import StepMetadata


class RelayOffset(int):
    """The ``kv_offset`` a ``RelayCache`` layer reports to transformers' mask creation: the prefix columns in front of
    the keys the mask covers. A type of its own because transformers' sliding-window layers also report
    ``kv_offset > 0`` (once their window is full): ``attention.relay_mask`` builds a relay mask for this type only and
    the own implementation's mask for every other offset."""

    __slots__ = ()


class RelayKV(NamedTuple):
    """Keys (or values) of one layer as two parts, ``prefix [1, H_kv, P, D]`` and ``suffix [B, H_kv, L_s, D]``, and
    where each row is in them: ``step`` (``kernels.StepMetadata``).

    A static cache's step carries where its preallocated suffix is filled, as device tensors (so a captured CUDA
    graph replays correctly): ``suffix_end`` (0-d int64, filled positions) and ``suffix_lengths`` (``[B]`` int32,
    valid positions ending at ``suffix_end``: the left padding excluded). A dynamic cache whose rows were laid out by
    relay_hf carries ``suffix_lengths`` alone; otherwise both are ``None`` and the padding comes from the attention
    mask. ``step.groups``: which packed prefix segments each row reads (``PrefixGroups``), or ``None``: every row
    reads all of ``prefix``. ``step.plans`` is shared by the layers of the cache that read one prefix view.
    """

    prefix: torch.Tensor
    suffix: torch.Tensor
    step: StepMetadata


class RelayLayer(CacheLayerMixin):
    """One layer of a ``RelayCache``: a shared prefix (read-only once set) and a growing per-row suffix.

    Beam reordering, batch selection, repetition and cropping touch the suffix only; the prefix is the same for
    every row by construction.
    """

    is_sliding = False
    is_croppable = True

    # The suffix lives in buffers [B, H_kv, capacity, D] that grow geometrically (or are sized up front by
    # ``reserve``), so a decode step writes its token in place instead of copying the whole suffix (torch.cat).
    GROWTH = 2
    MIN_CAPACITY = 16

    def __init__(self, prefix_keys: torch.Tensor | None = None, prefix_values: torch.Tensor | None = None,
                 suffix_padding: torch.Tensor | None = None, groups: PrefixGroups | None = None,
                 window: int | None = None, full_lengths: tuple[int, ...] | None = None):
        self._kbuf = self._vbuf = None  # suffix buffers [B, H_kv, capacity, D]
        self._len = 0  # valid suffix positions in the buffers
        self._reserve = 0  # capacity to allocate on first append
        super().__init__()
        self.prefix_keys = prefix_keys  # [1, H_kv, P_packed, D] or None before the prefix is set
        self.prefix_values = prefix_values
        # [B] int: each row's left padding at the start of its suffix, when the caller laid the rows out (relay_hf's
        # generate does); then attention reads each row's extent from the cache, else from the attention mask
        self.suffix_padding = suffix_padding
        self.groups = groups  # which packed segments each row reads; None: every row reads the whole prefix
        # a sliding-window layer stores of each segment only the last window - 1 tokens (PrefixGroups.windowed):
        # the window it was trimmed for and the segments' whole lengths, or None (the whole prefix is stored)
        self.window, self.full_lengths = window, full_lengths
        self._view = None  # (groups, rows, the view attention reads): built once per call

    @property
    def keys(self) -> torch.Tensor | None:
        """The valid suffix keys ``[B, H_kv, L_s, D]``: a view of the buffer, no copy."""
        return None if self._kbuf is None else self._kbuf[:, :, :self._len]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._kbuf, self._len = value, 0 if value is None else value.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._vbuf is None else self._vbuf[:, :, :self._len]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._vbuf = value

    @property
    def capacity(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.shape[-2]

    @property
    def prefix_length(self) -> int:
        """Prefix columns of the rows: the longest row prefix (the packed prefix itself without groups)."""
        if self.groups is not None:
            return self.groups.max_prefix_length
        if self.window is not None:
            return max(self.full_lengths)
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[-2]

    def view(self, rows: int) -> PrefixGroups | None:
        """The groups attention reads this layer's prefix through, for ``rows`` rows: the call's (``None``: one
        prefix, every row), or for a trimmed sliding-window layer their windowed view."""
        if self.window is None:
            return self.groups
        if self._view is None or self._view[0] is not self.groups or self._view[1] != rows:
            base = self.groups if self.groups is not None else PrefixGroups(self.full_lengths, [(0,)] * rows)
            self._view = (self.groups, rows, base.windowed(self.window))
        return self._view[2]

    def set_groups(self, groups: PrefixGroups | None, rows: int | None = None,
                   view: PrefixGroups | None = None) -> None:
        """Read the prefix through ``groups`` from now on; a trimmed sliding-window layer may be handed the windowed
        ``view`` for ``rows`` rows that another layer of the same window built (else it builds its own, once)."""
        self.groups = groups
        self._view = None if view is None else (groups, rows, view)

    @property
    def suffix_length(self) -> int:
        return self._len

    def _row_lengths(self, device: torch.device) -> torch.Tensor | None:
        """``[B]`` int32 valid suffix positions of each row, when the rows' layout is known."""
        if self.suffix_padding is None:
            return None
        self.suffix_padding = self.suffix_padding.to(device=device, dtype=torch.int32)
        return self._len - self.suffix_padding

    def _expanded_prefix(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's prefix as stock attention needs it, ``[B, H_kv, P, D]``: the one prefix expanded, or each row's
        segments gathered into its first columns (the rest is masked in the relay row layout, or by the window)."""
        view = self.view(B)
        if view is None:
            return self.prefix_keys.expand(B, -1, -1, -1), self.prefix_values.expand(B, -1, -1, -1)
        index = view.gather_index().to(self.prefix_keys.device)  # [B, P]
        return (self.prefix_keys[0][:, index].transpose(0, 1), self.prefix_values[0][:, index].transpose(0, 1))

    def reserve(self, tokens: int) -> None:
        """Size the suffix buffers for ``tokens`` positions at their first allocation (e.g. prompt + max_new)."""
        self._reserve = max(self._reserve, tokens)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        """New suffix buffers of at least ``needed`` positions: keys ``[B, H_kv, cap, D]``, values ``[B, H_kv, cap,
        D_v]``, each sized from its own states (MLA models such as DeepSeek-V3 have ``D_v != D``)."""
        B, H = key_states.shape[:2]
        cap = max(needed, self._reserve, self.MIN_CAPACITY, self.GROWTH * self.capacity)
        kbuf = key_states.new_empty(B, H, cap, key_states.shape[-1])
        vbuf = value_states.new_empty(B, value_states.shape[1], cap, value_states.shape[-1])
        if self._len:
            kbuf[:, :, :self._len] = self._kbuf[:, :, :self._len]
            vbuf[:, :, :self._len] = self._vbuf[:, :, :self._len]
        self._kbuf, self._vbuf = kbuf, vbuf

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write ``[B, H_kv, L_new, D]`` new suffix states after the valid ones."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._len + key_states.shape[-2]
        if self._kbuf is None or end > self.capacity:
            self._grow(key_states, value_states, end)
        elif self._kbuf.shape[0] != key_states.shape[0]:
            raise ValueError(f"suffix holds {self._kbuf.shape[0]} rows, got states for {key_states.shape[0]}")
        self._kbuf[:, :, self._len:end] = key_states
        self._vbuf[:, :, self._len:end] = value_states
        self._len = end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stock's contract (any attention implementation): append, and return each row's whole keys and values
        ``[B, H_kv, P + L_s, D]``, the prefix expanded or gathered per row in front of the suffix."""
        self.append(key_states, value_states)
        if self.prefix_keys is None:
            return self.keys, self.values
        prefix_keys, prefix_values = self._expanded_prefix(self.keys.shape[0])
        return torch.cat([prefix_keys, self.keys], dim=-2), torch.cat([prefix_values, self.values], dim=-2)

    def relay_update(self, key_states: torch.Tensor, value_states: torch.Tensor, plans: dict | None = None
                     ) -> tuple[RelayKV, RelayKV]:
        """Relay attention's contract: append, and return keys and values as ``RelayKV`` (the prefix stored once).
        Only a layer with a prefix is asked (``RelayCache.relay_active``). ``plans``: the kernel plans the cache's
        layers of this view share this step (``StepMetadata.plans``)."""
        self.append(key_states, value_states)
        step = StepMetadata(self._row_lengths(key_states.device), None, self.view(key_states.shape[0]),
                            {} if plans is None else plans)
        return RelayKV(self.prefix_keys, self.keys, step), RelayKV(self.prefix_values, self.values, step)

    def get_seq_length(self) -> int:
        return self.prefix_length + self.suffix_length

    def get_mask_sizes(self, query_length: int, relay: bool = False) -> tuple[int, int]:
        if relay and self.prefix_keys is not None:
            if self.suffix_padding is not None:  # its keys carry every row's extent: no mask to build
                return 0, RelayOffset(self.prefix_length)
            return self.suffix_length + query_length, RelayOffset(self.prefix_length)
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self._len = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.suffix_length:
            self._kbuf = self._kbuf.index_select(0, beam_idx.to(self._kbuf.device))
            self._vbuf = self._vbuf.index_select(0, beam_idx.to(self._vbuf.device))
        if self.suffix_padding is not None:
            self.suffix_padding = self.suffix_padding.index_select(0, beam_idx.to(self.suffix_padding.device))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if -tokens_to_remove > self.suffix_length:
            raise ValueError(f"cannot crop {-tokens_to_remove} tokens: only {self.suffix_length} suffix tokens are "
                             f"cached and the shared prefix ({self.prefix_length} tokens) is never cropped")
        self._len += tokens_to_remove

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.suffix_length:
            self._kbuf = self._kbuf.repeat_interleave(repeats, dim=0)
            self._vbuf = self._vbuf.repeat_interleave(repeats, dim=0)
        if self.suffix_padding is not None:
            self.suffix_padding = self.suffix_padding.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.suffix_length:
            self._kbuf, self._vbuf = self._kbuf[indices, ...], self._vbuf[indices, ...]
        if self.suffix_padding is not None:
            self.suffix_padding = self.suffix_padding[indices.to(self.suffix_padding.device)]


class StaticRelayLayer(RelayLayer):
    """A compileable ``RelayLayer``: the suffix buffers ``[B, H_kv, max_suffix_length, D]`` are allocated once (zeros)
    and written in place at a position kept on the device, so ``torch.compile`` sees fixed shapes and a CUDA graph
    can replay the decode step. The prefix is shared exactly as in ``RelayLayer``.

    Where each row is filled travels with the keys (``RelayKV.step``: one ``StepMetadata`` on the layer's fixed
    extents, kept while its groups view and plans stay), so attention needs no mask. ``suffix_padding`` (``[B]``
    int) is each row's left padding at the start of its suffix.
    """

    is_compileable = True
    is_croppable = False

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor, max_suffix_length: int,
                 suffix_padding: torch.Tensor | None = None, groups: PrefixGroups | None = None,
                 window: int | None = None, full_lengths: tuple[int, ...] | None = None):
        super().__init__(prefix_keys, prefix_values, groups=groups, window=window, full_lengths=full_lengths)
        self.max_suffix_length = max_suffix_length
        self.suffix_padding = suffix_padding
        self._end = self._lengths = None  # 0-d int64 filled positions; [B] int32 valid positions ending there
        self._step = None  # the StepMetadata of these extents (its tensors never move: one per groups view)

    @property
    def keys(self) -> torch.Tensor | None:
        """The whole suffix buffer ``[B, H_kv, max_suffix_length, D]`` (filled up to ``end``)."""
        return self._kbuf

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._kbuf = value

    @property
    def values(self) -> torch.Tensor | None:
        return self._vbuf

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._vbuf = value

    @property
    def suffix_length(self) -> int:
        return 0 if self._end is None else int(self._end)

    @property
    def end(self) -> torch.Tensor | None:
        """0-d int64 on the device: filled suffix positions (what a captured step reads; ``None`` before the first
        update)."""
        return self._end

    @property
    def row_lengths(self) -> torch.Tensor | None:
        """``[B]`` int32 on the device: each row's valid suffix positions ending at ``end`` (left padding excluded)."""
        return self._lengths

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        B, H, _, D = key_states.shape
        self._kbuf = key_states.new_zeros(B, H, self.max_suffix_length, D)  # [B, H_kv, S, D]
        # [B, H_kv, S, D_v]: the value head dim may differ from the key's (MLA)
        self._vbuf = value_states.new_zeros(B, value_states.shape[1], self.max_suffix_length, value_states.shape[-1])
        self._end = torch.zeros((), dtype=torch.int64, device=key_states.device)
        if self.suffix_padding is None:
            self.suffix_padding = torch.zeros(B, dtype=torch.int32)
        if self.suffix_padding.shape != (B,):
            raise ValueError(f"suffix_padding has shape {tuple(self.suffix_padding.shape)}, the batch has {B} rows")
        self._lengths = -self.suffix_padding.to(device=key_states.device, dtype=torch.int32)
        self._step = None
        if not is_torchdynamo_compiling():  # fixed addresses, so CUDA graphs replay in place (as in StaticLayer)
            for t in (self.prefix_keys, self.prefix_values, self._kbuf, self._vbuf, self._end, self._lengths):
                torch._dynamo.mark_static_address(t)

    def __getstate__(self):  # pickled without its step (the plans it shares hold compiled launches)
        return dict(self.__dict__, _step=None)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise ValueError("a static RelayCache needs a prefix and a model patched by relay_hf (relay attention)")

    def relay_update(self, key_states: torch.Tensor, value_states: torch.Tensor, plans: dict | None = None
                     ) -> tuple[RelayKV, RelayKV]:
        if self.prefix_keys is None:
            raise ValueError("a static RelayCache needs a prefix and a model patched by relay_hf (relay attention)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        # a decode step writes at ``end`` itself (no index kernels: two fewer launches per layer and step)
        pos = self._end.view(1) if n == 1 else torch.arange(n, device=key_states.device) + self._end
        self._kbuf.index_copy_(2, pos, key_states)
        self._vbuf.index_copy_(2, pos, value_states)
        self._end.add_(n)
        self._lengths.add_(n)
        view = self.view(self._kbuf.shape[0])
        step = self._step
        if is_torchdynamo_compiling():  # a compiled step calls the custom op, which takes tensors, not plans
            step = StepMetadata(self._lengths, self._end, view)
        elif step is None or step.groups is not view or (plans is not None and step.plans is not plans):
            step = self._step = StepMetadata(self._lengths, self._end, view, {} if plans is None else plans)
        return RelayKV(self.prefix_keys, self._kbuf, step), RelayKV(self.prefix_values, self._vbuf, step)

    def get_seq_length(self):
        return self.prefix_length if self._end is None else self._end + self.prefix_length  # a tensor: no host sync

    def get_mask_sizes(self, query_length: int, relay: bool = False) -> tuple[int, int]:
        # no mask positions: the keys carry every row's extent, so relay_mask builds nothing (no mask work in a
        # compiled decode step)
        return 0, self.prefix_length

    def get_max_length(self) -> int:
        return self.prefix_length + self.max_suffix_length

    def reset(self) -> None:
        if self.is_initialized:  # in place: a captured CUDA graph keeps working on the same buffers
            self._kbuf.zero_()
            self._vbuf.zero_()
            self._end.zero_()
            self._lengths.copy_(-self.suffix_padding.to(self._lengths))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:  # in place: the addresses a CUDA graph captured must stay valid
            idx = beam_idx.to(self._kbuf.device)
            self._kbuf.copy_(self._kbuf.index_select(0, idx))
            self._vbuf.copy_(self._vbuf.index_select(0, idx))
            self._lengths.copy_(self._lengths.index_select(0, idx))

    def fill_marks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Copies of ``(end, row_lengths)``, or ``None`` before the first update: what ``rewind`` puts back."""
        return None if self._end is None else (self._end.clone(), self._lengths.clone())

    def rewind(self, marks: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put ``fill_marks``'s copies back in place (the positions after them are written again by the next
        update, so the buffers need nothing)."""
        if marks is not None and self._end is not None:
            self._end.copy_(marks[0])
            self._lengths.copy_(marks[1])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a static RelayCache cannot be cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            raise NotImplementedError("a static RelayCache cannot change its batch after the first forward")
        if self.suffix_padding is not None:
            self.suffix_padding = self.suffix_padding.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a static RelayCache cannot change its batch")


def share_groups(layers: list[RelayLayer], groups: PrefixGroups | None) -> dict[int, PrefixGroups | None]:
    """Hand every layer of a cache this call's ``groups``; trimmed sliding-window layers read them through one
    windowed view per window, built once and shared by that window's layers (not once per layer and step).

    Returns the views by window, ``0`` keying the call's groups as they are (a static cache pins each view's kernel
    tables)."""
    rows = None
    padding = layers[0].suffix_padding if layers else None
    if groups is not None:
        rows = groups.rows
    elif padding is not None:
        rows = padding.shape[0]
    shared: dict[int, PrefixGroups | None] = {}
    for lay in layers:
        lay.set_groups(groups)
        if lay.window is not None and rows is not None:
            if lay.window not in shared:  # one windowed view per window, shared by its layers
                shared[lay.window] = lay.view(rows)
            lay.set_groups(groups, rows, shared[lay.window])
    return {0: groups, **shared}  # 0: the layers that read the call's groups as they are


def reset_static(layers) -> None:
    """``StaticRelayLayer.reset`` of every initialised layer of ``layers`` at once (a refill resets them all): their
    suffix buffers and ends zeroed, their rows' extents set from their ``suffix_padding``, in place, by one foreach
    launch per device and dtype instead of four launches per layer (on a GPU a refill's cost is the host's launches,
    not the device's work)."""
    live = [lay for lay in layers if lay.is_initialized]
    zeros: dict[tuple, list[torch.Tensor]] = {}
    for lay in live:
        for t in (lay._kbuf, lay._vbuf, lay._end):
            zeros.setdefault((t.device, t.dtype), []).append(t)
    for tensors in zeros.values():
        torch._foreach_zero_(tensors)
    starts: dict[tuple, torch.Tensor] = {}  # -padding once per padding tensor and device (a refill shares one)
    targets: dict[tuple, tuple[list, list]] = {}
    for lay in live:
        out = lay._lengths
        key = (id(lay.suffix_padding), out.device, out.dtype)
        if key not in starts:
            starts[key] = -lay.suffix_padding.to(out)
        dst, src = targets.setdefault((out.device, out.dtype), ([], []))
        dst.append(out)
        src.append(starts[key])
    for dst, src in targets.values():
        torch._foreach_copy_(dst, src)
