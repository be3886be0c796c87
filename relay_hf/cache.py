"""What is stored: ONE copy of the shared prefix KV per layer, plus each row's own suffix KV.

Layout per layer (``RelayLayer``)::

    prefix_keys / prefix_values   [1, H_kv, P, D]    the system prompt, shared by every row, never expanded
    keys / values (the suffix)    [B, H_kv, L_s, D]  per-row tokens after the prefix, left-padded

``get_seq_length() == P + L_s``, so generate's position ids and masks line up with a row that would have held the
prefix itself. How ``update`` hands the two parts to attention depends on the model's attention implementation:

* ``"relay"`` (the model went through ``relay_hf.patch``): ``update`` returns ``RelayKV(prefix, suffix)`` pairs so the
  relay attention function reads the prefix once per batch, and masks are sized over the suffix only
  (``kv_offset = P``).
* anything else: ``update`` returns the prefix expanded and concatenated to the suffix, so stock attention
  computes the exact same thing (slower, never wrong).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache
from transformers.utils import is_torchdynamo_compiling

from ._compat import attn_implementation, cache_kwarg_name

ATTN_NAME = "relay"
# The name a patched model runs under says which implementation it runs without a relay prefix, so a copied or
# unpickled model keeps it. (No "flash" in these names: transformers treats such names as flash attention.)
RELAY_NAMES = {"sdpa": ATTN_NAME, "eager": "relay_eager", "flash_attention_2": "relay_fa2",
               "flash_attention_3": "relay_fa3", "flash_attention_4": "relay_fa4", "flex_attention": "relay_flex"}
STOCK_OF = {relay: stock for stock, relay in RELAY_NAMES.items()}


def is_relay_name(name: str | None) -> bool:
    """Whether ``name`` is one of the attention implementations relay_hf registers."""
    return name in STOCK_OF


class RelayKV(NamedTuple):
    """Keys (or values) of one layer as two parts: ``prefix [1, H_kv, P, D]`` and ``suffix [B, H_kv, L_s, D]``.

    A static cache also hands over where its preallocated suffix is filled, as device tensors (so a captured CUDA
    graph replays correctly): ``end`` (0-d int64, filled positions) and ``lengths`` (``[B]`` int32, valid positions
    ending at ``end``: the left padding excluded). Both are ``None`` for the dynamic cache, whose suffix is exactly
    the filled part and whose padding comes from the attention mask.
    """

    prefix: torch.Tensor
    suffix: torch.Tensor
    lengths: torch.Tensor | None = None
    end: torch.Tensor | None = None


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
                 suffix_padding: torch.Tensor | None = None):
        self._kbuf = self._vbuf = None  # suffix buffers [B, H_kv, capacity, D]
        self._len = 0  # valid suffix positions in the buffers
        self._reserve = 0  # capacity to allocate on first append
        super().__init__()
        self.prefix_keys = prefix_keys  # [1, H_kv, P, D] or None before the prefix is set
        self.prefix_values = prefix_values
        # [B] int: each row's left padding at the start of its suffix, when the caller laid the rows out (relay_hf's
        # generate does); then attention reads each row's extent from the cache, else from the attention mask
        self.suffix_padding = suffix_padding

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
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[-2]

    @property
    def suffix_length(self) -> int:
        return self._len

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
            lengths = None
            if self.suffix_padding is not None:  # [B] int32 valid suffix positions of each row
                self.suffix_padding = self.suffix_padding.to(device=key_states.device, dtype=torch.int32)
                lengths = self._len - self.suffix_padding
            return (RelayKV(self.prefix_keys, self.keys, lengths), RelayKV(self.prefix_values, self.values, lengths))
        B = self.keys.shape[0]
        keys = torch.cat([self.prefix_keys.expand(B, -1, -1, -1), self.keys], dim=-2)
        values = torch.cat([self.prefix_values.expand(B, -1, -1, -1), self.values], dim=-2)
        return keys, values

    def get_seq_length(self) -> int:
        return self.prefix_length + self.suffix_length

    def get_mask_sizes(self, query_length: int, relay: bool = False) -> tuple[int, int]:
        if relay and self.prefix_keys is not None:
            return self.suffix_length + query_length, self.prefix_length
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
                 suffix_padding: torch.Tensor | None = None):
        super().__init__(prefix_keys, prefix_values)
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
        return (RelayKV(self.prefix_keys, self._kbuf, self._lengths, self._end),
                RelayKV(self.prefix_values, self._vbuf, self._lengths, self._end))

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
    """A transformers ``Cache`` that stores the shared prefix ONCE per layer and a suffix per row.

    Build one with ``RelayCache.from_prefix(model, prefix_ids)`` (prefills the prefix at batch 1) and pass it to a
    patched model's ``generate`` as ``past_key_values=`` (or ``cache=`` on transformers >= 5.24) as often as you
    like: every call works on its own ``fork()``, so the cache you hold is never mutated.

    Attributes:
        prefix_ids: ``[P]`` int64 token ids of the prefix, or ``None`` when built from raw KV.
        prefix_length: ``P``.
    """

    def __init__(self, config, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 prefix_ids: torch.Tensor | None = None):
        text_config = config.get_text_config(decoder=True)
        n_layers = text_config.num_hidden_layers
        if prefix_kv is not None and len(prefix_kv) != n_layers:
            raise ValueError(f"prefix_kv has {len(prefix_kv)} layers, the model has {n_layers}")
        prefix_kv = prefix_kv or [(None, None)] * n_layers
        super().__init__(layers=[RelayLayer(k, v) for k, v in prefix_kv])
        self.config = config
        self.prefix_ids = prefix_ids

    # -- construction ----------------------------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_prefix(cls, model, prefix_ids) -> RelayCache:
        """Prefill ``prefix_ids`` once at batch 1 through ``model`` and keep its KV as the shared prefix.

        Args:
            model: a causal LM (patched or not).
            prefix_ids: ``[P]`` or ``[1, P]`` int token ids (tensor or list), ``1 <= P <= max_position_embeddings``.
        """
        ids = torch.as_tensor(prefix_ids)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"prefix_ids must be integer token ids, got dtype {ids.dtype}")
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"prefix_ids must be a non-empty [P] or [1, P] sequence, got shape {tuple(ids.shape)}")
        text_config = model.config.get_text_config(decoder=True)
        max_pos = getattr(text_config, "max_position_embeddings", None)
        if max_pos is not None and ids.numel() > max_pos:
            raise ValueError(f"prefix of {ids.numel()} tokens is longer than the model's max_position_embeddings "
                             f"({max_pos})")
        ids = ids.to(model.device)
        scratch = DynamicCache()  # no config: plain full layers, nothing windowed away
        model.base_model(input_ids=ids[None], use_cache=True, **{cache_kwarg_name(model): scratch})
        kv = [(layer.keys, layer.values) for layer in scratch.layers]
        return cls(model.config, kv, prefix_ids=ids)

    def reserve(self, tokens: int) -> None:
        """Size every layer's suffix buffers for ``tokens`` positions when they are first allocated."""
        for layer in self.layers:
            layer.reserve(tokens)

    def fork(self, *, max_suffix_length: int | None = None, suffix_padding: torch.Tensor | None = None
             ) -> RelayCache:
        """A new cache sharing this one's prefix tensors (no copy) with an empty suffix.

        Args:
            max_suffix_length: if given, the fork is static and compileable (``StaticRelayLayer``): suffix buffers
                of this many positions (prompt after the prefix + new tokens), allocated once. ``torch.compile`` /
                CUDA graphs (transformers' generate compile path) can then run the decode step.
            suffix_padding: ``[B]`` int, each row's left padding at the start of its suffix (the rows' layout, as
                relay_hf's generate makes it). Without it a dynamic fork reads the rows' extents from the attention
                mask.
        """
        fork = type(self)(self.config, [(lay.prefix_keys, lay.prefix_values) for lay in self.layers], self.prefix_ids)
        for lay in fork.layers:
            lay.suffix_padding = suffix_padding
        if max_suffix_length is not None:
            if self.prefix_length == 0:
                raise ValueError("a static RelayCache needs a prefix; build it with RelayCache.from_prefix")
            # the static fork owns its prefix (a copy), so ``refill`` can overwrite it in place for the next call
            fork.layers = [StaticRelayLayer(lay.prefix_keys.clone(), lay.prefix_values.clone(), max_suffix_length,
                                            suffix_padding) for lay in self.layers]
        return fork

    def can_refill(self, base: RelayCache, rows: int, max_suffix_length: int, max_rows: int | None = None) -> bool:
        """Whether this static cache can serve ``base``'s prefix for ``rows`` rows (up to ``max_rows`` rows of buffers:
        relay_hf's loop runs extra rows; ``None``: exactly ``rows``) and ``max_suffix_length`` suffix positions (or
        more, up to twice that) without new buffers."""
        mine, theirs = self.layers[0], base.layers[0]
        held = mine._kbuf.shape[0] if mine.is_initialized else -1
        return (self.is_static and mine.is_initialized and rows <= held <= (max_rows or rows)
                and max_suffix_length <= mine.max_suffix_length <= 2 * max_suffix_length
                and mine.prefix_keys.shape == theirs.prefix_keys.shape
                and mine.prefix_keys.dtype == theirs.prefix_keys.dtype
                and mine.prefix_keys.device == theirs.prefix_keys.device)

    def refill(self, base: RelayCache, suffix_padding: torch.Tensor) -> None:
        """Reuse this static cache for ``base``'s prefix and new rows: every buffer keeps its address, so the CUDA
        graphs transformers captured for the previous call replay instead of being recorded again."""
        for lay, src in zip(self.layers, base.layers):
            lay.prefix_keys.copy_(src.prefix_keys)
            lay.prefix_values.copy_(src.prefix_values)
            lay.suffix_padding = suffix_padding
            lay.reset()
        self.prefix_ids = base.prefix_ids

    @property
    def is_static(self) -> bool:
        return bool(self.layers) and isinstance(self.layers[0], StaticRelayLayer)

    # -- state -----------------------------------------------------------------------------------------------------
    @property
    def prefix_length(self) -> int:
        return self.layers[0].prefix_length if self.layers else 0

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
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, relay=self.relay_active)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length, relay=self.relay_active)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def __repr__(self) -> str:
        return (f"RelayCache(layers={len(self.layers)}, prefix_length={self.prefix_length}, "
                f"suffix_length={self.layers[0].suffix_length if self.layers else 0})")
