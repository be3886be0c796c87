"""What is stored: ONE copy of each shared prefix's KV per layer, plus each row's own suffix KV.

Layout per layer (``layers.RelayLayer``, ``layers.StaticRelayLayer``)::

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

import torch
from transformers.cache_utils import Cache
from transformers.utils import is_torchdynamo_compiling

from ._compat import attn_implementation
from .kernels import pin_tables
from .kernels.groups import PrefixGroups
from .layers import RelayLayer, StaticRelayLayer, reset_static, share_groups
from .names import is_relay_name
from .prefill import pack_prefixes, prefill_prefixes, prefill_tree
from .prefix import PrefixTree

PREFIX_ROUNDING = 256  # a static cache of several prefixes holds their packed positions rounded up to this
MIN_SEGMENT_CAPACITY = 4  # ... and plans its kernels for at least this many segments per level (a power of two)


class _Constructors:
    """How a ``RelayCache`` is made from a model: each constructor prefills (or packs) the prefixes and calls
    ``cls(config, kv, tree=..., windows=...)``."""

    @classmethod
    def from_prefix(cls, model, prefix_ids) -> RelayCache:
        """Prefill ``prefix_ids`` once at batch 1 through ``model`` and keep its KV as the shared prefix.

        Args:
            model: a causal LM (patched or not).
            prefix_ids: ``[P]`` or ``[1, P]`` int token ids (tensor or list), ``1 <= P <= max_position_embeddings``.
        """
        kv, tree, windows = prefill_prefixes(model, [prefix_ids], ["prefix_ids"])
        return cls(model.config, kv, tree=tree, windows=windows)

    @classmethod
    def from_prefixes(cls, model, prefixes) -> RelayCache:
        """Prefill several prefixes once each and keep them, every shared part stored once.

        Args:
            model: a causal LM (patched or not).
            prefixes: a list of ``[P]`` integer token id sequences (tensors or lists), distinct and non-empty. A
                prefix that starts with another given one is stored as its continuation (``[system, system +
                document_a, system + document_b]`` keeps the system prompt once and two documents under it).
        """
        kv, tree, windows = prefill_prefixes(model, prefixes)
        return cls(model.config, kv, tree=tree, windows=windows)

    @classmethod
    def from_tree(cls, model, tree: PrefixTree, store=None, depends=None, pending: list | None = None,
                  launched: dict | None = None, check_row=None) -> RelayCache:
        """Prefill the segments of ``tree`` (roots at position 0, each child after its parent's KV) at batch 1 and
        pack them (``prefill.prefill_tree``; segments kept in ``store`` are not prefilled again: ``kept_tokens``
        says how many tokens came from it; ``pending``: their checks' verdicts, left unread; ``launched``: checks
        launched early, ``kept.launch_checks``; ``check_row``: the call's ``check_row.CheckRow``)."""
        kv, windows, kept = prefill_tree(model, tree, store, depends, pending, launched, check_row)
        cache = cls(model.config, kv, tree=tree, windows=windows)
        cache.kept_tokens = kept
        return cache

    @classmethod
    def combine(cls, caches) -> RelayCache:
        """One cache holding the prefixes of several (of one model; packed, so their KV is copied once): how a
        pipeline serves a batch under several system prompts it prefilled in earlier calls."""
        caches = _combinable(list(caches))
        if len(caches) == 1:
            return caches[0]
        kv, tree, windows = pack_prefixes([(c.tree, c.layers) for c in caches])
        return cls(caches[0].config, kv, tree=tree, windows=windows)


class RelayCache(_Constructors, Cache):
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
        n_layers = config.get_text_config(decoder=True).num_hidden_layers
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
        # window (None: the call's groups as they are) -> the kernel plans the layers reading that view share
        # (StepMetadata.plans): one plan per step for all layers, not one lookup per layer
        self._plans: dict = {}
        self.kept_tokens = 0  # prefix tokens taken from a prefix store instead of a prefill (from_tree)

    @property
    def prefix_ids(self) -> torch.Tensor | None:
        if self.tree is None or len(self.tree.ids) != 1:
            return None
        return self.tree.ids[0].to(self.prefix_device) if self.prefix_device is not None else self.tree.ids[0]

    def __getstate__(self):  # pickled without its kernel plans (compiled launches): a copy plans again
        return dict(self.__dict__, _plans={})

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
        if paths is None and self.tree is not None and len(self.tree.ids) > 1:
            raise ValueError(f"this RelayCache holds {len(self.tree.ids)} prefixes: fork(paths=...) says which each "
                             "row reads")
        groups = None if paths is None else self.groups_for(paths)
        if groups is not None and suffix_padding is None:
            raise ValueError("a fork of several prefixes needs suffix_padding (the rows' layout)")
        if max_suffix_length is not None:
            return StaticRelayCache.fork_of(self, max_suffix_length, suffix_padding, paths, groups)
        fork = RelayCache(self.config, [(lay.prefix_keys, lay.prefix_values) for lay in self.layers], tree=self.tree,
                          windows=[lay.window for lay in self.layers])
        for lay in fork.layers:
            lay.suffix_padding = suffix_padding
        fork._set_groups(groups)
        return fork

    def _set_groups(self, groups: PrefixGroups | None) -> dict[int, PrefixGroups | None]:
        """Hand every layer this call's ``groups``; the views by window, as ``layers.share_groups`` returns them."""
        self._groups = groups
        self._plans = {}  # plans bind the groups' tables: new groups, new plans
        return share_groups(self.layers, groups)

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
        return sum(t.untyped_storage().nbytes() for lay in self.layers for t in (lay.prefix_keys, lay.prefix_values)
                   if t is not None)

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
        return self.update_layer(self.layers[layer_idx], key_states, value_states)

    def fill_marks(self) -> list:
        """Each static layer's fill positions, copied (``StaticRelayLayer.fill_marks``; ``None`` for other layers):
        a forward that fails after some layers wrote their step is put back with ``rewind`` before it runs again."""
        return [getattr(layer, "fill_marks", lambda: None)() for layer in self.layers]

    def rewind(self, marks: list) -> None:
        """Put ``fill_marks``'s positions back."""
        for layer, mark in zip(self.layers, marks, strict=True):
            if mark is not None:
                layer.rewind(mark)

    def update_layer(self, layer: RelayLayer, key_states, value_states):
        """``update`` of the entry ``layer`` (one of ``self.layers``), for a caller that holds the entry rather than
        its index (``regional.LayerCacheView``: a compiled layer must not depend on its index)."""
        # relay attention reads RelayKV; any other implementation (or a layer with no prefix) gets stock's tensors
        if self.relay_active and (layer.prefix_keys is not None or layer.is_compileable):
            # a compiled step calls the custom op (no plans): nothing to share, nothing for dynamo to mutate
            plans = None if is_torchdynamo_compiling() else self._plans.setdefault(layer.window, {})
            return layer.relay_update(key_states, value_states, plans)
        return layer.update(key_states, value_states)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length, relay=self.relay_active)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def __repr__(self) -> str:
        segments = "" if self.tree is None or len(self.tree.ids) == 1 else f", segments={len(self.tree.ids)}"
        return (f"RelayCache(layers={len(self.layers)}, prefix_length={self.prefix_length}{segments}, "
                f"suffix_length={self.layers[0].suffix_length if self.layers else 0})")


class StaticRelayCache(RelayCache):
    """A ``RelayCache`` of ``StaticRelayLayer``s (``RelayCache.fork(max_suffix_length=...)``): its own copy of the
    prefixes and fixed suffix buffers, so compiled and captured decode steps run on it, and ``refill`` reuses every
    buffer in place for the next call (the captured graphs replay). On CUDA it also holds the kernels' work tables of
    its call's groups (``kernels.pin_tables``), rewritten in place per call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tables: dict = {}  # window (0: none) -> the pinned tables of that view
        self._filled_from: list | None = None  # per layer (prefix keys, version), (values, version) copied in last

    @classmethod
    def fork_of(cls, base: RelayCache, max_suffix_length: int, suffix_padding: torch.Tensor | None, paths,
                groups: PrefixGroups | None) -> StaticRelayCache:
        """``base.fork(max_suffix_length=..., suffix_padding=..., paths=...)``, ``groups`` being ``base``'s groups of
        ``paths`` (``None``: one prefix for every row)."""
        if base.layers[0].prefix_keys is None or base.prefix_length == 0:
            raise ValueError("a static RelayCache needs a prefix; build it with RelayCache.from_prefix")
        fork = cls(base.config, tree=base.tree)
        # the static fork owns its prefix (a copy), so ``refill`` can overwrite it in place for the next call;
        # several prefixes are held with room to spare, so the next call's may differ a little
        fork.layers = [StaticRelayLayer(*_static_prefix(lay, groups), max_suffix_length, suffix_padding,
                                        window=lay.window, full_lengths=lay.full_lengths) for lay in base.layers]
        fork._set_groups(None if groups is None else base.groups_for(paths, _segment_capacity(groups)))
        fork._filled_from = [(t, t._version) for src in base.layers for t in (src.prefix_keys, src.prefix_values)]
        return fork

    def _set_groups(self, groups: PrefixGroups | None) -> dict[int, PrefixGroups | None]:
        views = super()._set_groups(groups)
        if self.is_static and self.prefix_device.type == "cuda":
            for key, view in views.items():
                if view is not None:
                    self._pin(key, view)
        return views

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
        if not (self.is_static and mine.is_initialized and rows <= mine.keys.shape[0] <= (max_rows or rows)
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
        # the same kept prefix as the last fill (a prefix store hit hands the very same tensors): nothing to copy
        source = [(t, t._version) for src in base.layers for t in (src.prefix_keys, src.prefix_values)]
        same = self._filled_from is not None and all(
            t is u and v == w for (t, v), (u, w) in zip(source, self._filled_from))
        for lay, src in zip(self.layers, base.layers):
            P = src.prefix_keys.shape[2]
            if not same:
                lay.prefix_keys[:, :, :P].copy_(src.prefix_keys)
                lay.prefix_values[:, :, :P].copy_(src.prefix_values)
            lay.suffix_padding = suffix_padding
            lay.full_lengths = src.full_lengths
        reset_static(self.layers)  # every layer's reset, in a few launches
        self.tree = base.tree
        self._filled_from = source
        self._set_groups(groups)


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


def _combinable(caches: list) -> list[RelayCache]:
    """``caches`` when ``RelayCache.combine`` can pack them (built from token ids, of one model), else
    ``ValueError``."""
    if not caches or any(not isinstance(c, RelayCache) or c.tree is None for c in caches):
        raise ValueError("combine takes RelayCaches built with from_prefix / from_prefixes")
    if any(c.config is not caches[0].config for c in caches):
        raise ValueError("combine takes RelayCaches of one model")
    return caches


def _segment_capacity(groups: PrefixGroups) -> int:
    """Segments per level a static cache plans for: this layout's, rounded up to a power of two, at least
    ``MIN_SEGMENT_CAPACITY``, so later calls with a few more prompts replay the same capture."""
    return max(MIN_SEGMENT_CAPACITY, 1 << (groups.segments_per_level - 1).bit_length())
