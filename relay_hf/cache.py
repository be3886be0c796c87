"""What is stored: ONE copy of each shared prefix's KV per layer, plus each row's own suffix KV.

Layout per layer (``RelayLayer``)::

    prefix_keys / prefix_values   [1, H_kv, P_packed, D]  the shared segments (a system prompt; several, and blocks
                                                          under them, see ``prefix.PrefixTree``), each stored once
    keys / values (the suffix)    [B, H_kv, L_s, D]       per-row tokens after the row's prefix, left-padded

With one prefix every row reads all of it; with several, a fork carries ``PrefixGroups`` (which segments each row
reads). ``get_seq_length() == P + L_s`` (``P`` the longest row prefix), so generate's position ids and masks line
up with the relay row layout (``prefix.RowLayout``). How ``update`` hands the parts to attention depends on the
model's attention implementation:

* ``"relay"`` (the model went through ``relay_hf.patch``): ``update`` returns ``RelayKV(prefix, suffix, ...)`` pairs so
  the relay attention function reads each prefix once per batch, and masks are sized over the suffix only
  (``kv_offset = P``; none at all where the cache carries its rows' extents).
* anything else: ``update`` returns each row's prefix expanded and concatenated to the suffix, so stock attention
  computes the exact same thing (slower, never wrong).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.utils import is_torchdynamo_compiling

from ._compat import attn_implementation
from .kernels import pin_tables
from .kernels.groups import PrefixGroups, window_kept
from .names import is_relay_name
from .prefill import prefill_tree
from .prefix import PrefixTree

PREFIX_ROUNDING = 256  # a static cache of several prefixes holds their packed positions rounded up to this
MIN_SEGMENT_CAPACITY = 4  # ... and plans its kernels for at least this many segments per level (a power of two)
class RelayOffset(int):
    """The ``kv_offset`` a ``RelayCache`` layer reports to transformers' mask creation: the prefix columns in front of
    the keys the mask covers. A type of its own because transformers' sliding-window layers also report
    ``kv_offset > 0`` (once their window is full): ``attention.relay_mask`` builds a relay mask for this type only and
    the own implementation's mask for every other offset."""

    __slots__ = ()


class RelayKV(NamedTuple):
    """Keys (or values) of one layer as two parts: ``prefix [1, H_kv, P, D]`` and ``suffix [B, H_kv, L_s, D]``.

    A static cache also hands over where its preallocated suffix is filled, as device tensors (so a captured CUDA
    graph replays correctly): ``end`` (0-d int64, filled positions) and ``lengths`` (``[B]`` int32, valid positions
    ending at ``end``: the left padding excluded). A dynamic cache whose rows were laid out by relay_hf hands over
    ``lengths`` alone; otherwise both are ``None`` and the padding comes from the attention mask. ``groups``: which
    packed prefix segments each row reads (``PrefixGroups``), or ``None``: every row reads all of ``prefix``.
    """

    prefix: torch.Tensor
    suffix: torch.Tensor
    lengths: torch.Tensor | None = None
    end: torch.Tensor | None = None
    groups: PrefixGroups | None = None


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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, relay: bool = True, **kwargs):
        self.append(key_states, value_states)
        if self.prefix_keys is None:
            return self.keys, self.values
        if relay:
            lengths = self._row_lengths(key_states.device)
            view = self.view(key_states.shape[0])
            return (RelayKV(self.prefix_keys, self.keys, lengths, None, view),
                    RelayKV(self.prefix_values, self.values, lengths, None, view))
        prefix_keys, prefix_values = self._expanded_prefix(self.keys.shape[0])
        return torch.cat([prefix_keys, self.keys], dim=-2), torch.cat([prefix_values, self.values], dim=-2)

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

    Where each row is filled travels with the keys (``RelayKV.lengths`` / ``RelayKV.end``), so attention needs no
    mask. ``suffix_padding`` (``[B]`` int) is each row's left padding at the start of its suffix.
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
        if not is_torchdynamo_compiling():  # fixed addresses, so CUDA graphs replay in place (as in StaticLayer)
            for t in (self.prefix_keys, self.prefix_values, self._kbuf, self._vbuf, self._end, self._lengths):
                torch._dynamo.mark_static_address(t)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, relay: bool = True, **kwargs):
        if not relay or self.prefix_keys is None:
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
        return (RelayKV(self.prefix_keys, self._kbuf, self._lengths, self._end, view),
                RelayKV(self.prefix_values, self._vbuf, self._lengths, self._end, view))

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

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a static RelayCache cannot be cropped")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            raise NotImplementedError("a static RelayCache cannot change its batch after the first forward")
        if self.suffix_padding is not None:
            self.suffix_padding = self.suffix_padding.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a static RelayCache cannot change its batch")


class RelayCache(Cache):
    """A transformers ``Cache`` that stores each shared prefix ONCE per layer and a suffix per row.

    Build one with ``RelayCache.from_prefix(model, prefix_ids)`` (prefills the prefix at batch 1), or with
    ``RelayCache.from_prefixes(model, [ids, ...])`` for several (system prompts; a prompt followed by documents that
    some of its rows share), and pass it to a patched model's ``generate`` as ``past_key_values=`` (or ``cache=`` on
    transformers >= 5.24) as often as you like: every call works on its own ``fork()``, so the cache you hold is never
    mutated, and each row reads the longest of its prefixes that the row starts with.

    Attributes:
        tree: the stored segments (``prefix.PrefixTree``), or ``None`` when built from raw KV.
        prefix_ids: ``[P]`` int64 token ids of the prefix when there is exactly one, else ``None``.
        prefix_length: ``P``: the prefix's tokens, or on a fork of several prefixes the longest a row reads.
    """

    def __init__(self, config, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 prefix_ids: torch.Tensor | None = None, tree: PrefixTree | None = None,
                 windows: list[int | None] | None = None):
        text_config = config.get_text_config(decoder=True)
        n_layers = text_config.num_hidden_layers
        if prefix_kv is not None and len(prefix_kv) != n_layers:
            raise ValueError(f"prefix_kv has {len(prefix_kv)} layers, the model has {n_layers}")
        prefix_kv = prefix_kv or [(None, None)] * n_layers
        if tree is None and prefix_ids is not None:
            tree = PrefixTree((torch.as_tensor(prefix_ids).reshape(-1).to("cpu", torch.int64),), (-1,))
        windows = windows or [None] * n_layers  # per layer: the sliding window its stored prefix is trimmed for
        super().__init__(layers=[RelayLayer(k, v, window=w, full_lengths=None if w is None else tree.lengths)
                                 for (k, v), w in zip(prefix_kv, windows)])
        self.config = config
        self.tree = tree
        self._groups = None  # a fork's PrefixGroups (every layer reads through it, or its windowed view)
        self._tables: dict = {}  # a static cache's kernel tables for several prefixes, per view (``_pin``)

    @property
    def prefix_ids(self) -> torch.Tensor | None:
        if self.tree is None or len(self.tree.ids) != 1:
            return None
        return self.tree.ids[0].to(self.prefix_device) if self.prefix_device is not None else self.tree.ids[0]

    # -- construction ----------------------------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_prefix(cls, model, prefix_ids) -> RelayCache:
        """Prefill ``prefix_ids`` once at batch 1 through ``model`` and keep its KV as the shared prefix.

        Args:
            model: a causal LM (patched or not).
            prefix_ids: ``[P]`` or ``[1, P]`` int token ids (tensor or list), ``1 <= P <= max_position_embeddings``.
        """
        return cls.from_prefixes(model, [_prefix_ids(prefix_ids, "prefix_ids")])

    @classmethod
    @torch.no_grad()
    def from_prefixes(cls, model, prefixes) -> RelayCache:
        """Prefill several prefixes once each and keep them, every shared part stored once.

        Args:
            model: a causal LM (patched or not).
            prefixes: a list of ``[P]`` integer token id sequences (tensors or lists), distinct and non-empty. A
                prefix that starts with another given one is stored as its continuation (``[system, system +
                document_a, system + document_b]`` keeps the system prompt once and two documents under it).
        """
        if isinstance(prefixes, torch.Tensor) or not prefixes:
            raise ValueError("prefixes must be a non-empty list of token id sequences")
        tree = PrefixTree.from_prefixes([_prefix_ids(p, f"prefixes[{i}]") for i, p in enumerate(prefixes)])
        return cls.from_tree(model, tree)

    @classmethod
    @torch.no_grad()
    def from_tree(cls, model, tree: PrefixTree) -> RelayCache:
        """Prefill the segments of ``tree`` (roots at position 0, each child after its parent's KV) at batch 1 and
        pack them (``prefill.prefill_tree``)."""
        kv, windows = prefill_tree(model, tree)
        return cls(model.config, kv, tree=tree, windows=windows)

    @classmethod
    def combine(cls, caches) -> RelayCache:
        """One cache holding the prefixes of several (of one model; packed, so their KV is copied once): how a
        pipeline serves a batch under several system prompts it prefilled in earlier calls."""
        caches = list(caches)
        if not caches or any(not isinstance(c, RelayCache) or c.tree is None for c in caches):
            raise ValueError("combine takes RelayCaches built with from_prefix / from_prefixes")
        if len(caches) == 1:
            return caches[0]
        ids, parents = [], []
        for c in caches:
            parents += [p + len(ids) if p >= 0 else -1 for p in c.tree.parents]
            ids += list(c.tree.ids)
        if any(c.config is not caches[0].config for c in caches):
            raise ValueError("combine takes RelayCaches of one model")
        # a layer one cache trimmed to its window (TRIM_AT_MOST) is trimmed in the combination; another cache's
        # prefixes are trimmed on the way (the packing copies them anyway)
        windows = [next((w for w in ws if w is not None), None)
                   for ws in zip(*[[lay.window for lay in c.layers] for c in caches])]
        kv = []
        for i, window in enumerate(windows):
            keys, values = [], []
            for c in caches:
                lay = c.layers[i]
                stored = window_kept(c.tree.lengths, lay.window)
                if lay.window is not None and lay.window != window:
                    raise ValueError("combine takes RelayCaches of one model")
                at = 0
                for n, keep in zip(stored, window_kept(stored, window)):
                    keys.append(lay.prefix_keys[:, :, at + n - keep:at + n])
                    values.append(lay.prefix_values[:, :, at + n - keep:at + n])
                    at += n
            kv.append((torch.cat(keys, 2), torch.cat(values, 2)))
        return cls(caches[0].config, kv, tree=PrefixTree(tuple(ids), tuple(parents)), windows=windows)

    def reserve(self, tokens: int) -> None:
        """Size every layer's suffix buffers for ``tokens`` positions when they are first allocated."""
        for layer in self.layers:
            layer.reserve(tokens)

    def groups_for(self, paths, capacity: int | None = None) -> PrefixGroups | None:
        """The ``PrefixGroups`` of rows reading these segment paths, or ``None`` when every row reads the one
        prefix (the ungrouped call)."""
        paths = [tuple(p) for p in paths]
        if self.tree is not None and len(self.tree.ids) == 1 and all(p == (0,) for p in paths):
            return None
        if self.tree is None:
            raise ValueError("a RelayCache built from raw KV holds one prefix: fork it without paths")
        return PrefixGroups(self.tree.lengths, paths, capacity)

    def fork(self, *, max_suffix_length: int | None = None, suffix_padding: torch.Tensor | None = None,
             paths=None) -> RelayCache:
        """A new cache sharing this one's prefix tensors (no copy) with an empty suffix.

        Args:
            max_suffix_length: if given, the fork is static and compileable (``StaticRelayLayer``): suffix buffers
                of this many positions (prompt after the prefix + new tokens), allocated once. ``torch.compile`` /
                CUDA graphs (transformers' generate compile path) can then run the decode step.
            suffix_padding: ``[B]`` int, each row's left padding at the start of its suffix (the rows' layout, as
                relay_hf's generate makes it). Without it a dynamic fork reads the rows' extents from the attention
                mask.
            paths: per row, the segments of ``tree`` it reads, root first (``PrefixTree.match`` finds them);
                required when the cache holds several prefixes (and then ``suffix_padding`` too).
        """
        groups = None
        if paths is not None:
            groups = self.groups_for(paths)
        elif self.tree is not None and len(self.tree.ids) > 1:
            raise ValueError(f"this RelayCache holds {len(self.tree.ids)} prefixes: fork(paths=...) says which each "
                             "row reads")
        if groups is not None and suffix_padding is None:
            raise ValueError("a fork of several prefixes needs suffix_padding (the rows' layout)")
        fork = type(self)(self.config, [(lay.prefix_keys, lay.prefix_values) for lay in self.layers], tree=self.tree,
                          windows=[lay.window for lay in self.layers])
        for lay in fork.layers:
            lay.suffix_padding = suffix_padding
        if max_suffix_length is not None:
            if self.layers[0].prefix_keys is None or self.prefix_length == 0:
                raise ValueError("a static RelayCache needs a prefix; build it with RelayCache.from_prefix")
            # the static fork owns its prefix (a copy), so ``refill`` can overwrite it in place for the next call;
            # several prefixes are held with room to spare, so the next call's may differ a little
            fork.layers = [StaticRelayLayer(*self._static_prefix(lay, groups), max_suffix_length, suffix_padding,
                                            window=lay.window, full_lengths=lay.full_lengths) for lay in self.layers]
            if groups is not None:
                groups = self.groups_for(paths, _segment_capacity(groups))
        fork._set_groups(groups)
        return fork

    @staticmethod
    def _static_prefix(layer: RelayLayer, groups: PrefixGroups | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A static cache's own prefix buffers: a copy, with rounded-up room when it holds several prefixes."""
        if groups is None:
            return layer.prefix_keys.clone(), layer.prefix_values.clone()
        P = layer.prefix_keys.shape[2]
        room = -(-max(P, 1) // PREFIX_ROUNDING) * PREFIX_ROUNDING
        out = []
        for t in (layer.prefix_keys, layer.prefix_values):
            buf = t.new_zeros(1, t.shape[1], room, t.shape[3])
            buf[:, :, :P] = t
            out.append(buf)
        return out[0], out[1]

    def _set_groups(self, groups: PrefixGroups | None) -> None:
        """Hand every layer this call's ``groups`` (trimmed sliding-window layers read them through one shared
        windowed view per window). A static cache on CUDA also writes the kernel tables of each view into buffers of
        its own (``_pin``), in place, so the decode step captured on them replays with this call's layout."""
        self._groups = groups
        rows = None
        padding = self.layers[0].suffix_padding if self.layers else None
        if groups is not None:
            rows = groups.rows
        elif padding is not None:
            rows = padding.shape[0]
        shared: dict[int, PrefixGroups | None] = {}
        for lay in self.layers:
            lay.set_groups(groups)
            if lay.window is not None and rows is not None:
                if lay.window not in shared:  # one windowed view per window, shared by its layers
                    shared[lay.window] = lay.view(rows)
                lay.set_groups(groups, rows, shared[lay.window])
        if self.is_static and self.prefix_device.type == "cuda":
            views = {0: groups, **shared}  # 0: the layers that read the call's groups as they are
            for key, view in views.items():
                if view is not None:
                    self._pin(key, view)

    def _pin(self, key: int, groups: PrefixGroups) -> None:
        lay = self.layers[0]
        G = self.config.get_text_config(decoder=True).num_attention_heads // lay.prefix_keys.shape[1]
        held = pin_tables(groups, lay.prefix_keys, lay.prefix_values, lay.suffix_padding.shape[0], G,
                          self._tables.get(key))
        if held is not None:
            self._tables[key] = held

    def can_refill(self, base: RelayCache, rows: int, max_suffix_length: int, max_rows: int | None = None,
                   paths=None) -> bool:
        """Whether this static cache can serve ``base``'s prefix for ``rows`` rows (up to ``max_rows`` rows of buffers:
        relay_hf's loop runs extra rows; ``None``: exactly ``rows``) and ``max_suffix_length`` suffix positions (or
        more, up to twice that) without new buffers; with several prefixes, rows reading ``paths`` (as many levels,
        at most the planned segments per level, packed within the room held)."""
        mine = self.layers[0]
        if not (self.is_static and mine.is_initialized and rows <= mine._kbuf.shape[0] <= (max_rows or rows)
                and max_suffix_length <= mine.max_suffix_length <= 2 * max_suffix_length):
            return False
        groups = None if paths is None else base.groups_for(paths)
        if (groups is None) != (self._groups is None):
            return False
        if groups is not None and not (groups.depth == self._groups.depth
                                       and groups.segments_per_level <= self._groups.segments_per_level):
            return False
        for lay, src in zip(self.layers, base.layers):
            held, need = lay.prefix_keys.shape, src.prefix_keys.shape
            if (lay.window != src.window or lay.prefix_keys.dtype != src.prefix_keys.dtype
                    or lay.prefix_keys.device != src.prefix_keys.device or held[:2] != need[:2]):
                return False
            if groups is None and held != need:  # one prefix: the kernels are planned for its exact length
                return False
            if groups is not None and not need[2] <= held[2] <= 2 * need[2] + PREFIX_ROUNDING:
                return False
        return True

    def refill(self, base: RelayCache, suffix_padding: torch.Tensor, paths=None) -> None:
        """Reuse this static cache for ``base``'s prefix and new rows: every buffer keeps its address, so the CUDA
        graphs captured for the previous call replay instead of being recorded again."""
        groups = None
        if paths is not None:
            groups = base.groups_for(paths, self._groups and self._groups.segments_per_level)
        for lay, src in zip(self.layers, base.layers):
            P = src.prefix_keys.shape[2]
            lay.prefix_keys[:, :, :P].copy_(src.prefix_keys)
            lay.prefix_values[:, :, :P].copy_(src.prefix_values)
            lay.suffix_padding = suffix_padding
            lay.full_lengths = src.full_lengths
            lay.reset()
        self.tree = base.tree
        self._set_groups(groups)

    @property
    def is_static(self) -> bool:
        return bool(self.layers) and isinstance(self.layers[0], StaticRelayLayer)

    # -- state -----------------------------------------------------------------------------------------------------
    @property
    def prefix_length(self) -> int:
        if self._groups is None and self.tree is not None and len(self.tree.ids) > 1:
            return max(self.tree.full_ids(j).numel() for j in range(len(self.tree.ids)))
        return self.layers[0].prefix_length if self.layers else 0

    @property
    def groups(self) -> PrefixGroups | None:
        """Which segments each row of this fork reads (``None``: every row reads the one prefix)."""
        return self._groups

    @property
    def relay_active(self) -> bool:
        """Whether attention goes through relay (patched model) rather than a stock implementation."""
        return is_relay_name(attn_implementation(self.config))

    @property
    def prefix_device(self) -> torch.device | None:
        return None if self.layers[0].prefix_keys is None else self.layers[0].prefix_keys.device

    @property
    def prefix_dtype(self) -> torch.dtype | None:
        return None if self.layers[0].prefix_keys is None else self.layers[0].prefix_keys.dtype

    def prefix_nbytes(self) -> int:
        """Bytes of storage behind the prefix tensors (counts real storage, so an expanded view would show)."""
        total = 0
        for lay in self.layers:
            for t in (lay.prefix_keys, lay.prefix_values):
                if t is not None:
                    total += t.untyped_storage().nbytes()
        return total

    # -- the Cache protocol ----------------------------------------------------------------------------------------
    # the rows' groups follow the suffixes, decided once for all layers
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self._groups is not None:
            # beam search reorders each input's beams among themselves, and they read the same prefixes: the groups
            # stay (one host read a step, not one a layer); any other reorder takes them along
            rows = beam_idx.tolist()
            if any(self._groups.paths[r] != self._groups.paths[b] for b, r in enumerate(rows)):
                self._set_groups(self._groups.select(rows))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self._groups is not None:
            self._set_groups(self._groups.select([b for b in range(self._groups.rows) for _ in range(repeats)]))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self._groups is not None:
            self._set_groups(self._groups.select(torch.arange(self._groups.rows)[indices.cpu()].tolist()))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, relay=self.relay_active)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length, relay=self.relay_active)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def __repr__(self) -> str:
        segments = "" if self.tree is None or len(self.tree.ids) == 1 else f", segments={len(self.tree.ids)}"
        return (f"RelayCache(layers={len(self.layers)}, prefix_length={self.prefix_length}{segments}, "
                f"suffix_length={self.layers[0].suffix_length if self.layers else 0})")


def _prefix_ids(ids, name: str) -> torch.Tensor:
    """``[P]`` integer token ids from a tensor or list (``[1, P]`` accepted), else ``ValueError`` naming ``name``."""
    ids = torch.as_tensor(ids)
    if ids.numel() == 0:  # checked first: an empty list becomes a float tensor
        raise ValueError(f"{name} is empty: a prefix needs at least one token")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be integer token ids, got dtype {ids.dtype}")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"{name} must be a non-empty [P] or [1, P] sequence, got shape {tuple(ids.shape)}")
    return ids


def _segment_capacity(groups: PrefixGroups) -> int:
    """Segments per level a static cache plans for: this layout's, rounded up to a power of two, at least
    ``MIN_SEGMENT_CAPACITY``, so later calls with a few more prompts replay the same capture."""
    return max(MIN_SEGMENT_CAPACITY, 1 << (groups.segments_per_level - 1).bit_length())
