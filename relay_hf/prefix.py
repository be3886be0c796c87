"""Finding what rows share, and moving between the stock and the relay row layouts.

What is shared is a ``PrefixTree``: segments of tokens, each stored once, each either a root (a system prompt) or
the continuation of its parent (a document or few-shot block that some of that prompt's rows share). Each row reads
a path of segments, root first, then its own suffix. ``find_groups`` picks the tree for a batch from its token ids
(the grouping that saves the most KV reads, every segment at least ``min_length`` tokens and shared by two rows);
``PrefixTree.match`` assigns a batch's rows to the tree of a ``RelayCache`` the caller built.

Stock layout of row ``b`` (what the user passes, what ``generate`` returns)::

    [ pad * n_b | prefix_b (P_b tokens) | suffix_b (s_b tokens) ]

Relay layout (``RowLayout``; what the patched ``generate`` feeds the model), ``P = max P_b`` columns for the prefix::

    [ prefix_b (P_b) | masked (P - P_b) | masked (S - s_b) | suffix_b (s_b) ]      S = max s_b

The prefix columns are never fed to the model (the ``RelayCache`` holds them: ``get_seq_length() == P``), so
``generate`` prefills only the ``S`` suffix columns. Position ids come out as stock's, since they derive from the
mask: row ``b``'s suffix starts at position ``P_b``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .host import to_device


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Pads in front of each row, ``[B]`` int64 on the CPU, or ``None`` if some row is not of the form ``0..0 1..1``
    with >= 1 token. Worked out where the mask is and read back once (``[B + 1]``: the counts and whether the mask is
    a padding mask): for a mask on a GPU the host never works through the ``[B, T]`` table
    (``benchmarks/generate.py --only ttft``, 64 rows)."""
    mask = attention_mask.to(torch.int64)
    bad = ((mask != 0) & (mask != 1)).any() | (mask[:, 1:] < mask[:, :-1]).any() | (mask[:, -1] == 0).any()
    out = torch.cat([(mask == 0).sum(-1), bad.long()[None]]).cpu()
    return None if out[-1] else out[:-1]


def _aligned_tokens(input_ids: torch.Tensor, n_pad: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length]``: the first ``length`` real tokens of every row."""
    idx = n_pad.to(input_ids.device)[:, None] + torch.arange(length, device=input_ids.device)[None]
    return input_ids.gather(1, idx)


def common_prefix_length(input_ids: torch.Tensor, n_pad: torch.Tensor) -> int:
    """Longest common token prefix of the rows' real tokens, leaving at least one token after it in every row."""
    T = input_ids.shape[1]
    shortest = int(T - n_pad.max())
    if shortest <= 1:
        return 0
    tokens = _aligned_tokens(input_ids, n_pad, shortest - 1)
    same = (tokens == tokens[:1]).all(0)
    return int(same.numel() if bool(same.all()) else int((~same).int().argmax()))


def first_mismatch(input_ids: torch.Tensor, n_pad: torch.Tensor, prefix_ids: torch.Tensor) -> tuple[int, int] | None:
    """``(row, position)`` of the first row whose real tokens do not start with ``prefix_ids`` followed by at
    least one more token (position ``P`` means the row has nothing after the prefix); ``None`` if all match."""
    P, T = prefix_ids.numel(), input_ids.shape[1]
    lengths = T - n_pad
    for b in torch.nonzero(lengths <= P).flatten().tolist()[:1]:
        return b, int(lengths[b])
    tokens = _aligned_tokens(input_ids, n_pad, P)
    bad = tokens != prefix_ids.to(tokens.device)[None]
    if not bool(bad.any()):
        return None
    row = int(bad.any(1).int().argmax())
    return row, int(bad[row].int().argmax())


# -- what is shared --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PrefixTree:
    """Shared token segments, each stored once: ``ids[j]`` (``[n_j]`` int64, CPU) continues segment
    ``parents[j]`` (``-1``: a root, starting at position 0). Segment ``j``'s full prefix is its ancestors' ids then
    its own."""

    ids: tuple[torch.Tensor, ...]
    parents: tuple[int, ...]

    @classmethod
    def from_prefixes(cls, prefixes) -> PrefixTree:
        """One node per given prefix (``[P]`` token ids each, distinct, non-empty): its parent is the longest other
        given prefix that it strictly starts with, so ``[system, system + document_a, system + document_b]`` stores
        the system prompt once with two children."""
        full = [torch.as_tensor(p).reshape(-1).to("cpu", torch.int64) for p in prefixes]
        order = sorted(range(len(full)), key=lambda j: full[j].numel())
        parents = []
        for j in range(len(full)):
            candidates = [i for i in order if full[i].numel() < full[j].numel()
                          and torch.equal(full[j][:full[i].numel()], full[i])]
            parents.append(candidates[-1] if candidates else -1)
        for j in range(len(full)):
            if any(i != j and torch.equal(full[i], full[j]) for i in range(j)):
                raise ValueError(f"prefix {j} is given twice")
        own = tuple(full[j][full[parents[j]].numel() if parents[j] >= 0 else 0:] for j in range(len(full)))
        return cls(own, tuple(parents))

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(t.numel() for t in self.ids)

    def starts(self) -> tuple[int, ...]:
        """Absolute position of each segment's first token (its ancestors' lengths)."""
        out = []
        for j in range(len(self.ids)):
            at, up = 0, self.parents[j]
            while up >= 0:
                at += self.ids[up].numel()
                up = self.parents[up]
            out.append(at)
        return tuple(out)

    def path(self, j: int) -> tuple[int, ...]:
        """Segment ``j`` and its ancestors, root first."""
        out = [j]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return tuple(reversed(out))

    def full_ids(self, j: int) -> torch.Tensor:
        """``[P]`` the whole prefix ending with segment ``j``."""
        return torch.cat([self.ids[i] for i in self.path(j)])

    def match(self, input_ids: torch.Tensor, n_pad: torch.Tensor, allow_none: bool = False) -> list[tuple[int, ...]]:
        """Each row's path: the deepest segment whose full prefix its real tokens start with, leaving at least one
        token after it. A row that matches no root raises ``ValueError`` naming it (and, for a one-prefix tree, the
        position where it differs), or with ``allow_none`` gets the empty path (it reads no prefix) as long as some
        row matches one."""
        ids, n_pad = input_ids.cpu(), n_pad.cpu()
        best: list[tuple[int, ...]] = [() for _ in range(ids.shape[0])]
        for j in sorted(range(len(self.ids)), key=lambda j: len(self.path(j))):
            full = self.full_ids(j)
            if first_mismatch(ids, n_pad, full) is None:
                hits = range(ids.shape[0])
            else:
                lengths = ids.shape[1] - n_pad
                ok = lengths > full.numel()
                tokens = _aligned_tokens(ids[ok], n_pad[ok], full.numel()) if bool(ok.any()) else None
                rows = torch.nonzero(ok).flatten()
                hits = [] if tokens is None else rows[(tokens == full[None]).all(1)].tolist()
            for b in hits:
                if len(self.path(j)) > len(best[b]):
                    best[b] = self.path(j)
        if allow_none and any(best):
            return best
        for b, path in enumerate(best):
            if not path:
                if len(self.ids) == 1:
                    bad = first_mismatch(ids[b:b + 1], n_pad[b:b + 1], self.ids[0])
                    pos = bad[1] if bad is not None else 0
                    what = ("has no token after it" if pos >= self.ids[0].numel() else
                            f"differs at prefix position {pos}")
                    raise ValueError(f"RelayCache prefix ({self.ids[0].numel()} tokens) does not match the input: "
                                     f"row {b} {what}")
                raise ValueError(f"row {b} starts with none of the RelayCache's {len(self.ids)} prefixes (or has no "
                                 "token after it)")
        return best


@dataclass(frozen=True, eq=False)
class Grouping:
    """What ``find_groups`` chose for a batch: the tree to prefill and each input row's path in it."""

    tree: PrefixTree
    paths: tuple[tuple[int, ...], ...]

    @property
    def single(self) -> bool:
        """One segment read by every row: the ungrouped relay call."""
        return len(self.tree.ids) == 1 and all(p == (0,) for p in self.paths)

    def prefix_lengths(self) -> list[int]:
        lengths = self.tree.lengths
        return [sum(lengths[j] for j in p) for p in self.paths]

    def shared_tokens(self) -> int:
        """Rows x tokens read from shared segments (what stock would read once per row)."""
        return sum(self.prefix_lengths())


def split_at_pinned(grouping: Grouping, pinned: list[torch.Tensor], min_length: int) -> Grouping:
    """``grouping`` with each root segment that has no segment under it and starts with a pinned prompt (``pinned``:
    ``[P]`` int64 ids, ``relay_hf.pin``) strictly shorter than itself cut there: the longest such prompt becomes the
    root (its KV is kept: nothing to prefill) and the rest a segment under it when it is ``min_length`` tokens or
    more (else it joins each row's own tokens). Rows that share more than a pinned system prompt (its chat template's
    next tokens, a document) then read the pinned KV instead of prefilling the longer prefix. Roots with segments
    under them are left as they are (two levels at most)."""
    tree = grouping.tree
    ids, parents = list(tree.ids), list(tree.parents)
    paths = [list(p) for p in grouping.paths]
    for j, root in enumerate(tree.ids):
        if tree.parents[j] != -1 or j in tree.parents:
            continue
        cuts = [k.numel() for k in pinned if k.numel() < root.numel() and torch.equal(root[:k.numel()], k)]
        if not cuts:
            continue
        n = max(cuts)
        ids[j] = root[:n]
        if root.numel() - n >= min_length:
            ids.append(root[n:])
            parents.append(j)
            for path in paths:
                if path == [j]:
                    path.append(len(ids) - 1)
    return Grouping(PrefixTree(tuple(ids), tuple(parents)), tuple(tuple(p) for p in paths))


MAX_SEGMENTS = 64  # segments find_groups keeps at most (each costs a prefill and a few kernel work items)
_SIGN = np.uint64(1 << 63)  # flipped, int64 values order as their unsigned bits do


def find_groups(input_ids: torch.Tensor, n_pad: torch.Tensor, min_length: int, levels: int = 2,
                max_segments: int = MAX_SEGMENTS) -> Grouping | None:
    """The shared segments that save the most KV reads per decode step, or ``None`` when no two rows share
    ``min_length`` tokens.

    A segment of ``n`` tokens read by ``m`` rows is stored and read once instead of ``m`` times: it saves
    ``(m - 1) * n``. Candidates are the nodes of the rows' longest-common-prefix tree (rows sorted, then the LCP of
    neighbours): the rows below a node share its first ``depth`` tokens. Up to ``levels`` segments per row (a
    system prompt, then a block some of its rows share), each read by at least two rows and at least ``min_length``
    tokens long, every row keeping at least one token after its prefix; the best choice is found exactly by dynamic
    programming over the tree. Rows under no chosen segment read none (their prompt is their suffix)."""
    B = input_ids.shape[0]
    if B < 2:
        return None
    ids, pads = input_ids.cpu().numpy(), n_pad.cpu().tolist()
    usable = [ids.shape[1] - n - 1 for n in pads]  # tokens a row may share: one stays for its suffix
    if max(usable) < max(1, min_length):
        return None
    rows = [ids[b, pads[b]:pads[b] + usable[b]] for b in range(B)]  # each row's shareable tokens (views)
    order = token_order(rows)
    lcp = [_common(rows[a], rows[b]) for a, b in zip(order, order[1:])]
    root = _lcp_tree(lcp, [usable[b] for b in order])
    floor = max(1, min_length)

    def pays(node: _Node, base: int) -> bool:
        return node.rows >= 2 and node.depth - base >= floor

    order_post = _post_order(root)  # children before parents: no recursion, however deep the tree
    below: dict[tuple[int, int], tuple[int, list]] = {}  # (node, base) -> best inner segments starting at base

    def inner(node: _Node, base: int) -> tuple[int, list]:
        """Best savings of segments starting at ``base`` among ``node`` and its descendants (an antichain)."""
        key = (id(node), base)
        if key not in below:
            for n in _post_order(node):
                k = (id(n), base)
                if k not in below:
                    options = _total([below[(id(c), base)] for c in n.children])
                    take = (n.rows - 1) * (n.depth - base) if pays(n, base) else 0
                    below[k] = (take, [(n, base)]) if take > 0 and take >= options[0] else options
        return below[key]

    best: dict[int, tuple[int, list]] = {}  # node -> best root segments of its subtree, with their inner ones
    for node in order_post:
        options = _total([best[id(c)] for c in node.children])
        if pays(node, 0):
            nested = _total([inner(c, node.depth) for c in node.children]) if levels > 1 else (0, [])
            take = (node.rows - 1) * node.depth + nested[0]
            if take >= options[0]:
                options = (take, [(node, 0), *nested[1]])
        best[id(node)] = options
    saved, chosen = best[id(root)]
    if saved <= 0:
        return None
    return _grouping(_cap_segments(chosen, max_segments), rows, order)


def _grouping(chosen: list, rows: list, order: list[int]) -> Grouping:
    """The ``Grouping`` of ``find_groups``' chosen segments: ``(node, base)`` pairs, each the tokens ``base`` to
    ``node.depth`` that the rows below ``node`` share (``base`` 0: a root; else a block under the root that holds
    it), read off ``rows`` (each row's shareable tokens, ``[n_b]`` integer arrays) in ``order`` (the rows sorted)."""
    roots = sorted((n for n, base in chosen if base == 0), key=lambda n: n.lo)
    inner = sorted(((n, base) for n, base in chosen if base > 0), key=lambda nb: nb[0].lo)
    seg_ids, parents, paths = [], [], [[] for _ in rows]
    for node, base in [(n, 0) for n in roots] + inner:
        parent = -1 if base == 0 else next(j for j, r in enumerate(roots) if r.lo <= node.lo and node.hi <= r.hi)
        seg_ids.append(torch.from_numpy(rows[order[node.lo]][base:node.depth].astype(np.int64)))
        parents.append(parent)
        for b in order[node.lo:node.hi]:
            paths[b].append(len(seg_ids) - 1)
    return Grouping(PrefixTree(tuple(seg_ids), tuple(parents)), tuple(tuple(p) for p in paths))


def token_order(rows: list) -> list[int]:
    """The indices of ``rows`` (``[n_b]`` integer arrays) in the order of their token lists, as ``sorted`` orders
    lists: a row before the rows it is a prefix of, equal rows as given. By byte strings that order as the lists do
    (int64, sign bit flipped, big-endian): a comparison is a ``memcmp``, not a walk of two Python lists, and no padded
    ``[B, T]`` table is built (``find_groups`` on 64 rows of a 4,096-token prompt)."""
    keys = [(row.astype(np.int64, copy=False).view(np.uint64) ^ _SIGN).astype(">u8").tobytes() for row in rows]
    return sorted(range(len(rows)), key=keys.__getitem__)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens ``a`` and ``b`` (``[n]`` integer arrays) share from their start."""
    m = min(a.size, b.size)
    differ = a[:m] != b[:m]
    return int(differ.argmax()) if differ.any() else m


def _post_order(root: _Node) -> list[_Node]:
    """``root``'s subtree, every node after its children."""
    out, stack = [], [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            out.append(node)
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in node.children)
    return out


def _total(parts: list[tuple[int, list]]) -> tuple[int, list]:
    """Savings and segments of independent subtrees, together."""
    return sum(p[0] for p in parts), [x for p in parts for x in p[1]]


def _cap_segments(chosen: list, limit: int) -> list:
    """At most ``limit`` segments: drop the inner (second-level) ones that save least, then the roots that save
    least with their inner ones."""
    saving = lambda nb: (nb[0].rows - 1) * (nb[0].depth - nb[1])  # noqa: E731
    while len(chosen) > limit:
        inner = [nb for nb in chosen if nb[1] > 0]
        if inner:
            chosen.remove(min(inner, key=saving))
            continue
        worst = min(chosen, key=saving)
        chosen = [nb for nb in chosen if nb is not worst and not (nb[1] > 0 and worst[0].lo <= nb[0].lo
                                                                     and nb[0].hi <= worst[0].hi)]
    return chosen


class _Node:
    """An LCP interval: sorted rows ``lo .. hi - 1`` share their first ``depth`` tokens."""

    __slots__ = ("depth", "lo", "hi", "children")

    def __init__(self, depth: int, lo: int, hi: int = -1):
        self.depth, self.lo, self.hi, self.children = depth, lo, hi, []

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def _lcp_tree(lcp: list[int], usable: list[int]) -> _Node:
    """The LCP-interval tree of sorted rows (``lcp[i]``: shared tokens of rows ``i`` and ``i + 1``; ``usable[i]``:
    row ``i``'s own depth, as a leaf), built in one pass with a stack of open intervals."""
    n = len(usable)
    root = _Node(0, 0)
    stack = [root]
    for i in range(n):
        child = _Node(usable[i], i, i + 1)
        h = lcp[i] if i < n - 1 else 0  # the boundary after row i; 0 at the end closes everything
        while stack[-1].depth > h:  # intervals deeper than the boundary end at row i
            top = stack.pop()
            top.children.append(child)
            top.hi = i + 1
            child = top
        if stack[-1].depth < h:  # a new interval starts with what just closed
            node = _Node(h, child.lo)
            node.children.append(child)
            stack.append(node)
        else:
            stack[-1].children.append(child)
    root.hi = n
    return root


# -- the relay layout ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RowLayout:
    """One call's rows in the relay layout (module docstring) and the way back.

    Attributes:
        ids, mask: ``[B, P + S]`` relay layout. ``suffix_padding``: ``[B]`` int64, masked columns in front of each
        row's suffix (``S - s_b``). ``prefix_columns``: ``P`` (the longest row prefix). ``stock_ids``: ``[B, T]`` the
        rows as given.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    suffix_padding: torch.Tensor
    prefix_columns: int
    stock_ids: torch.Tensor

    @property
    def columns(self) -> int:
        return self.ids.shape[1]

    def to_stock(self, ids: torch.Tensor) -> torch.Tensor:
        """``[R, P + S + t]`` relay-layout ids (``R`` a multiple of ``B``: rows expanded per input row) to the stock
        layout ``[R, T + t]``: the given prompt, then the generated columns unchanged."""
        per = ids.shape[0] // self.stock_ids.shape[0]
        return torch.cat([self.stock_ids.repeat_interleave(per, 0).to(ids.device), ids[:, self.columns:]], 1)


def relay_layout(input_ids: torch.Tensor, mask: torch.Tensor, n_pad: torch.Tensor, prefix_lengths,
                 suffix_columns: int = 0) -> RowLayout:
    """Lay left-padded rows out for relay: row ``b``'s first ``prefix_lengths[b]`` real tokens in the prefix columns,
    its remaining ones right-aligned after them (module docstring), in at least ``suffix_columns`` suffix columns (a
    recorded prefill's length: more masked columns in front). Masked columns hold the batch's own pad token (``0``
    when nothing is padded).

    The per-row counts are worked out on the host from ``n_pad`` (``[B]``; its CPU copy) and copied to the device
    once (``[3, B]`` int64, through pinned memory); the ``[B, P + S]`` tables are built there. So nothing here waits
    for work the call queued before it (a kept prefix's check, ``kept.launch_checks``), and neither the host's
    arithmetic nor its copies grow with the prompt (``left_padding``)."""
    B, T = input_ids.shape
    dev = input_ids.device
    n_pad = n_pad.to("cpu", torch.int64)
    P_b = torch.as_tensor(prefix_lengths).to("cpu", torch.int64).reshape(-1).expand(B)
    s_b = T - n_pad - P_b  # [B] suffix tokens
    P, S = int(P_b.max()), max(int(s_b.max()), suffix_columns)
    cols = P + S
    padded = torch.nonzero(n_pad).flatten()[:1].tolist()  # the first padded row: its column 0 is the first pad
    fill = input_ids[padded[0], :1] if padded else torch.zeros(1, dtype=input_ids.dtype, device=dev)
    n_pad, P_b, s_b = to_device(torch.stack([n_pad, P_b, s_b]), dev)[:, :, None]  # [B, 1] each
    j = torch.arange(cols, device=dev)[None]  # [1, cols]
    in_prefix = j < P_b
    valid = in_prefix | (j >= cols - s_b)  # [B, cols]
    src = torch.where(in_prefix, n_pad + j, j - (cols - T)).clamp(0, T - 1)  # [B, cols]
    ids = torch.where(valid, input_ids.gather(1, src), fill)
    pads = S - s_b[:, 0]  # [B] int64
    return RowLayout(ids, valid.to(mask.dtype), pads, P, input_ids)
