"""Relay attention over transformers' paged KV cache (continuous batching): one step's layout, planned on the host
from the cache's read index (``plan_paged_step``), and the attention that runs on it (``paged_relay_attention``).

Continuous batching packs a step's requests into one sequence: request ``i`` owns the query tokens
``cu_q[i]:cu_q[i+1]`` and reads its whole KV (cached tokens, then the new ones) through ``read_index[cu_k[i]:
cu_k[i+1]]``, physical token rows of the paged cache. Requests that hold the same leading blocks (transformers' block
sharing) list the same physical rows first. The plan finds those runs (a system prompt, then maybe a document shared
by some of its requests: two levels, as ``PrefixGroups``) and rewrites the read index so the cache's own gather reads
each shared run once per step instead of once per request::

    read_index, stock:  | req 0: S S S a a | req 1: S S S b | req 2: c c c |
    read_index, relay:  | S S S | rows of one query, left-padded [B_1, L_1] | rows of several, left-padded [B_n, L_n] |

Relay attention then reads that packed prefix once for all its requests' queries, each request's own tokens
separately, and merges them by log-sum-exp (``relay_attention``), exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import relay_attention
from .kernels.groups import PrefixGroups

MAX_DEPTH = 2  # shared levels per request (PrefixGroups' tree): a system prompt, then a document under it


@dataclass(frozen=True)
class RowBlock:
    """The requests of one step that share a query length class (one query each, or several: prefill chunks), laid
    out left-padded in the rewritten KV. All index tensors live on the step's device.

    Attributes:
        start: first position of the block in the rewritten KV (after the packed prefix).
        rows, length: ``B`` requests, each padded to ``length`` KV positions: the block spans ``B * length``.
        query_index: ``[B, L_q]`` int64 positions of each request's queries in the step's packed queries, its own
            last, left-padded with its first (padding outputs are dropped).
        output_index: ``[n]`` int64 the packed query positions the block answers; ``output_from``: ``[n]`` int64
            where each answer sits in the block's flattened ``[B * L_q]`` outputs.
        suffix_lengths: ``[B]`` int32 each request's own KV positions (the last ones of its padded row).
        groups: which prefix segments each request reads, ``None`` when every request reads the whole packed prefix.
    """

    start: int
    rows: int
    length: int
    query_index: torch.Tensor
    output_index: torch.Tensor
    output_from: torch.Tensor
    suffix_lengths: torch.Tensor
    groups: PrefixGroups | None


@dataclass(frozen=True)
class PagedPlan:
    """One continuous-batching step laid out for relay attention (built once per step, read by every layer).

    Attributes:
        read_index: ``[N]`` int64 the rewritten physical read index (``None`` when the step reads no cache: then
            ``kv_index`` picks the layout from the new tokens themselves).
        kv_index: ``[N]`` int64 positions in the step's new KV, or ``None``.
        prefix_length: packed prefix positions at the front of the rewritten KV.
        blocks: the ``RowBlock`` of each query length class present.
        tokens: query tokens of the step (``T``; positions no request owns get zeros).
        shared_tokens: per step, KV positions (per layer and head) not read again because they are shared:
            ``sum over segments of (readers - 1) * length``.
    """

    read_index: torch.Tensor | None
    kv_index: torch.Tensor | None
    prefix_length: int
    blocks: tuple[RowBlock, ...]
    tokens: int
    shared_tokens: int


def _shared_segments(seqs: list[torch.Tensor], past: list[int], min_shared: int
                     ) -> tuple[list[tuple[int, int, int]], list[list[int]]]:
    """The shared runs of the requests' read indices, as a tree of at most ``MAX_DEPTH`` levels.

    Returns ``(segments, paths)``: per segment ``(owner request, offset, length)`` (its physical rows are the owner's
    ``offset : offset + length``), per request the segments it reads, root first. A run is shared only by two
    requests or more, only over positions every reader has cached (``past``), and only from ``min_shared`` tokens.
    """
    segments: list[tuple[int, int, int]] = []
    paths: list[list[int]] = [[] for _ in seqs]

    def split(rows: list[int], offset: int, depth: int) -> None:
        by_first: dict[int, list[int]] = {}
        for i in rows:
            if past[i] > offset:
                by_first.setdefault(int(seqs[i][offset]), []).append(i)
        for group in by_first.values():
            if len(group) < 2:
                continue
            n = min(past[i] for i in group) - offset
            head = seqs[group[0]][offset:offset + n]
            same = torch.stack([seqs[i][offset:offset + n] == head for i in group[1:]]).all(0)
            run = int(n if bool(same.all()) else int((~same).nonzero()[0]))
            if run < min_shared:
                continue
            segments.append((group[0], offset, run))
            for i in group:
                paths[i].append(len(segments) - 1)
            if depth + 1 < MAX_DEPTH:
                split(group, offset + run, depth + 1)

    split(list(range(len(seqs))), 0, 0)
    return segments, paths


def plan_paged_step(read_index: torch.Tensor, cu_q: list[int], cu_k: list[int], min_shared: int,
                    device: torch.device) -> PagedPlan:
    """Plan one step: find the shared runs and lay the KV out as the module docstring shows.

    Args:
        read_index: ``[N]`` int64 physical rows each request reads, request after request (CPU or device); empty
            when the step reads no cache (fresh prefills only: the KV is the new tokens, packed as the queries).
        cu_q, cu_k: ``R + 1`` cumulative query and KV positions of the step's ``R`` requests (host ints).
        min_shared: shortest run worth reading once (``patch(min_prefix_length=...)``).
        device: where the step runs.
    """
    reads_cache = read_index.numel() > 0
    source = read_index.cpu() if reads_cache else torch.arange(cu_k[-1])
    R = len(cu_q) - 1
    seqs = [source[cu_k[i]:cu_k[i + 1]] for i in range(R)]
    queries = [cu_q[i + 1] - cu_q[i] for i in range(R)]
    past = [len(seqs[i]) - queries[i] if queries[i] else 0 for i in range(R)]
    segments, paths = _shared_segments(seqs, past, min_shared) if reads_cache else ([], [[] for _ in seqs])
    lengths = [n for _, _, n in segments]
    own = [sum(lengths[j] for j in paths[i]) for i in range(R)]  # prefix positions of each request
    parts = [seqs[o][off:off + n] for o, off, n in segments]
    start = sum(lengths)
    blocks = []
    for rows in ([i for i in range(R) if queries[i] == 1], [i for i in range(R) if queries[i] > 1]):
        if not rows:
            continue
        L = max(len(seqs[i]) - own[i] for i in rows)
        L_q = max(queries[i] for i in rows)
        index, q_index, out_index, out_from = [], [], [], []
        for b, i in enumerate(rows):
            mine = seqs[i][own[i]:]
            index.append(torch.cat([mine[:1].expand(L - len(mine)), mine]))  # padding repeats a row it reads
            q = torch.arange(cu_q[i], cu_q[i + 1])
            q_index.append(torch.cat([q[:1].expand(L_q - len(q)), q]))
            out_index.append(q)
            out_from.append(torch.arange(L_q - len(q), L_q) + b * L_q)
        parts.extend(index)
        paths_b = [paths[i] for i in rows]
        groups = None  # one segment every request reads: the plain (ungrouped) kernels
        if segments and (len(segments) > 1 or any(p != [0] for p in paths_b)):
            groups = PrefixGroups(lengths, paths_b)
        blocks.append(RowBlock(
            start, len(rows), L, torch.stack(q_index).to(device), torch.cat(out_index).to(device),
            torch.cat(out_from).to(device),
            torch.tensor([len(seqs[i]) - own[i] for i in rows], dtype=torch.int32, device=device), groups))
        start += len(rows) * L
    layout = torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    readers = [sum(j in p for p in paths) for j in range(len(segments))]
    return PagedPlan(layout if reads_cache else None, None if reads_cache else layout, sum(lengths), tuple(blocks),
                     cu_q[-1], sum((r - 1) * n for r, n in zip(readers, lengths)))


def paged_relay_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: PagedPlan, *,
                          scale: float | None = None, softcap: float | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Relay attention of one continuous-batching step.

    Args:
        query: ``[1, H_q, T', D]`` the step's packed queries (``T' >= plan.tokens``).
        key, value: ``[1, H_kv, N, D]`` / ``[1, H_kv, N, D_v]`` the KV the cache gathered through
            ``plan.read_index`` (or the step's new KV, which ``plan.kv_index`` lays out), any strides.

    Returns:
        ``[1, T', H_q, D_v]`` (an attention function's layout); positions no request owns are zeros.
    """
    if plan.kv_index is not None:
        key, value = key[:, :, plan.kv_index], value[:, :, plan.kv_index]
    H_q, T = query.shape[1], query.shape[2]
    D_v = value.shape[-1]
    P = plan.prefix_length
    prefix_key, prefix_value = key[:, :, :P], value[:, :, :P]  # [1, H_kv, P, D]
    out = query.new_zeros(T, H_q, D_v)
    for blk in plan.blocks:
        span = slice(blk.start, blk.start + blk.rows * blk.length)
        # [H_kv, B * L, D] -> [B, H_kv, L, D]: a view (the gathered KV is token-major)
        suffix_key = key[0, :, span].unflatten(1, (blk.rows, blk.length)).transpose(0, 1)
        suffix_value = value[0, :, span].unflatten(1, (blk.rows, blk.length)).transpose(0, 1)
        q = query[0][:, blk.query_index].transpose(0, 1)  # [B, H_q, L_q, D]
        o = relay_attention(q, prefix_key, prefix_value, suffix_key, suffix_value, scale=scale,
                            suffix_lengths=blk.suffix_lengths, softcap=softcap, sinks=sinks,
                            prefix_groups=blk.groups)  # [B, H_q, L_q, D_v]
        out.index_copy_(0, blk.output_index, o.transpose(1, 2).reshape(-1, H_q, D_v)[blk.output_from])
    return out.unsqueeze(0)
