"""Relay attention over transformers' paged KV cache (continuous batching): one step's layout, found on the host
from the cache's read index (``paged_step``), and the attention that runs on it (``paged_relay_attention``).

Continuous batching packs a step's requests into one sequence: request ``i`` owns the query tokens
``cu_q[i]:cu_q[i+1]`` and reads its whole KV (cached tokens, then the new ones) through ``read_index[cu_k[i]:
cu_k[i+1]]``, physical token rows of the paged cache. Requests that hold the same leading blocks (transformers' block
sharing) list the same physical rows first. ``paged_step`` finds those runs (a system prompt, then maybe a document
shared by some of its requests: two levels, as ``PrefixGroups``) and rewrites the read index so the cache's own
gather reads each shared run once per step instead of once per request::

    read_index, stock:  | req 0: S S S a a | req 1: S S S b | req 2: c c c |
    read_index, relay:  | S S S | decoding requests' own rows, left-padded [B, L] | each prefilling request's whole KV |

Relay attention then reads that packed prefix once for all decoding requests, each one's own rows separately, and
merges them by log-sum-exp (``kernels.attend``), exactly. A request that prefills (a prompt or a chunk of one:
compute-bound) attends over its whole KV as stock does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.bias import causal_lower_right

from .kernels import AttentionOptions, StepMetadata, attend
from .kernels.groups import PrefixGroups

MAX_DEPTH = 2  # shared levels per request (PrefixGroups' tree): a system prompt, then a document under it


@dataclass(frozen=True)
class RowBlock:
    """The requests of one step that decode (one query each), laid out left-padded in the rewritten KV after the
    packed prefix. Index tensors live on the step's device.

    Attributes:
        start: first position of the block in the rewritten KV (the packed prefix's length).
        rows, length: ``B`` requests, each padded to ``length`` KV positions: the block spans ``B * length``.
        query_index: each request's query position in the step's packed queries: a ``slice`` where they are
            consecutive (the scheduler puts decoding requests first: views, no gather), else ``[B]`` int64.
        step: the block's ``StepMetadata``: ``suffix_lengths [B]`` int32 each request's own KV positions (the last
            ones of its padded row), ``groups`` which prefix segments each request reads (``None`` when every
            request reads the whole packed prefix), and the kernel plans the step's layers share.
    """

    start: int
    rows: int
    length: int
    query_index: slice | torch.Tensor
    step: StepMetadata


@dataclass(frozen=True)
class PagedStep:
    """One continuous-batching step laid out for relay attention (built once per step, read by every layer).

    Attributes:
        read_index: ``[N]`` int64 the rewritten physical read index, or ``None`` when the step reads no cache (only
            fresh prefills: the KV is the new tokens, packed as the queries, and stays as it is).
        prefix_length: packed prefix positions at the front of the rewritten KV.
        decode: the ``RowBlock`` of the requests with one query, or ``None``.
        prefill: per request with several queries (a prompt, or a chunk of it), ``(q_start, q_end, kv_start,
            kv_end)``: its queries and its whole KV (prefix included), contiguous in the rewritten KV. Prefill is
            compute-bound: it attends stock's way (SDPA), a shared prefix gathered per request.
        tokens: query tokens of the step (``T``; positions no request owns get zeros).
        shared_tokens: KV positions (per layer and head) this step does not read again because decoding requests
            share them: ``sum over segments of (readers - 1) * length``.
    """

    read_index: torch.Tensor | None
    prefix_length: int
    decode: RowBlock | None
    prefill: tuple[tuple[int, int, int, int], ...]
    tokens: int
    shared_tokens: int


def _shared_segments(source: torch.Tensor, starts: torch.Tensor, past: torch.Tensor, min_shared: int
                     ) -> tuple[list[tuple[int, int, int]], list[list[int]]]:
    """The shared runs of some requests' read indices, as a tree of at most ``MAX_DEPTH`` levels.

    Args:
        source: ``[N]`` int64 the step's read index (CPU). ``starts``: ``[B]`` int64 where each request's part of it
            begins; ``past``: ``[B]`` int64 its cached positions (a run is shared only over positions every reader
            has cached).

    Returns ``(segments, paths)``: per segment ``(owner request, offset, length)`` (its physical rows are the owner's
    ``offset : offset + length``), per request the segments it reads, root first. A run is shared only by two
    requests or more, and only from ``min_shared`` tokens.
    """
    segments: list[tuple[int, int, int]] = []
    paths: list[list[int]] = [[] for _ in range(starts.numel())]

    def split(rows: torch.Tensor, offset: int, depth: int) -> None:
        rows = rows[past[rows] > offset]
        if rows.numel() < 2:
            return
        firsts = source[starts[rows] + offset]
        values, which = torch.unique(firsts, return_inverse=True)
        for k in range(values.numel()):
            group = rows[which == k]
            if group.numel() < 2:
                continue
            n = int(past[group].min()) - offset
            window = source[starts[group, None] + offset + torch.arange(n)]  # [G, n] their next n rows
            same = (window == window[:1]).all(0)
            run = n if bool(same.all()) else int((~same).nonzero()[0])
            if run < min_shared:
                continue
            segments.append((int(group[0]), offset, run))
            for i in group.tolist():
                paths[i].append(len(segments) - 1)
            if depth + 1 < MAX_DEPTH:
                split(group, offset + run, depth + 1)

    split(torch.arange(starts.numel()), 0, 0)
    return segments, paths


def paged_step(read_index: torch.Tensor, cu_q: list[int], cu_k: list[int], min_shared: int,
               device: torch.device) -> PagedStep:
    """Lay one step out: find the runs decoding requests share and lay the KV out as the module docstring shows.

    Args:
        read_index: ``[N]`` int64 physical rows each request reads, request after request (CPU or device); empty
            when the step reads no cache.
        cu_q, cu_k: ``R + 1`` cumulative query and KV positions of the step's ``R`` requests (host ints).
        min_shared: shortest run worth reading once (``patch(min_prefix_length=...)``).
        device: where the step runs.
    """
    R = len(cu_q) - 1
    queries = [cu_q[i + 1] - cu_q[i] for i in range(R)]
    if read_index.numel() == 0:
        prefill = tuple((cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]) for i in range(R) if queries[i])
        return PagedStep(None, 0, None, prefill, cu_q[-1], 0)
    source = read_index.cpu()
    decoding = [i for i in range(R) if queries[i] == 1]
    starts = torch.tensor([cu_k[i] for i in decoding], dtype=torch.int64)
    ends = torch.tensor([cu_k[i + 1] for i in decoding], dtype=torch.int64)
    segments, paths = _shared_segments(source, starts, ends - starts - 1, min_shared)
    lengths = [n for _, _, n in segments]
    parts = [source[cu_k[decoding[o]] + off:cu_k[decoding[o]] + off + n] for o, off, n in segments]
    start = sum(lengths)
    block = None
    if decoding:
        own = torch.tensor([sum(lengths[j] for j in path) for path in paths], dtype=torch.int64)
        mine = ends - starts - own  # [B] each request's own rows
        L = int(mine.max())
        # [B, L]: each request's own rows, left-padded with its first (a row it reads: finite values, masked out)
        positions = torch.maximum(ends[:, None] - L + torch.arange(L), (starts + own)[:, None])
        parts.append(source[positions].reshape(-1))
        groups = None  # one segment every request reads: the plain (ungrouped) kernels
        if segments and (len(segments) > 1 or any(p != [0] for p in paths)):
            groups = PrefixGroups(lengths, paths)
        query_at = torch.tensor([cu_q[i] for i in decoding], dtype=torch.int64)
        contiguous = bool((query_at == query_at[0] + torch.arange(len(decoding))).all())
        block = RowBlock(start, len(decoding), L,
                         slice(int(query_at[0]), int(query_at[0]) + len(decoding)) if contiguous else
                         query_at.to(device), StepMetadata(mine.to(device=device, dtype=torch.int32), None, groups))
        start += len(decoding) * L
    prefill = []
    for i in range(R):
        if queries[i] > 1:
            parts.append(source[cu_k[i]:cu_k[i + 1]])
            prefill.append((cu_q[i], cu_q[i + 1], start, start + cu_k[i + 1] - cu_k[i]))
            start += cu_k[i + 1] - cu_k[i]
    readers = [sum(j in p for p in paths) for j in range(len(segments))]
    return PagedStep(torch.cat(parts).to(device), sum(lengths), block, tuple(prefill), cu_q[-1],
                     sum((r - 1) * n for r, n in zip(readers, lengths)))


def paged_relay_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step: PagedStep,
                          options: AttentionOptions) -> torch.Tensor:
    """Relay attention of one continuous-batching step.

    Args:
        query: ``[1, H_q, T', D]`` the step's packed queries (``T' >= step.tokens``).
        key, value: ``[1, H_kv, N, D]`` / ``[1, H_kv, N, D_v]`` the KV the cache gathered through
            ``step.read_index`` (or, when the step reads no cache, the step's new KV as it is), any strides.
        options: the module's ``AttentionOptions``.

    Returns:
        ``[1, T', H_q, D_v]`` (an attention function's layout); positions no request owns are zeros.
    """
    H_q, T = query.shape[1], query.shape[2]
    D_v = value.shape[-1]
    blk = step.decode
    whole = blk is not None and not step.prefill and blk.rows == T and isinstance(blk.query_index, slice)
    out = None if whole else query.new_zeros(T, H_q, D_v)  # a decode-only step answers every position itself
    if blk is not None:
        P = step.prefix_length
        span = slice(blk.start, blk.start + blk.rows * blk.length)
        # [H_kv, B * L, D] -> [B, H_kv, L, D]: a view (the gathered KV is token-major)
        suffix_key = key[0, :, span].unflatten(1, (blk.rows, blk.length)).transpose(0, 1)
        suffix_value = value[0, :, span].unflatten(1, (blk.rows, blk.length)).transpose(0, 1)
        q = query[0][:, blk.query_index].transpose(0, 1).unsqueeze(2)  # [B, H_q, 1, D] (a view when contiguous)
        o = attend(blk.step, options, q, key[:, :, :P], value[:, :, :P], suffix_key, suffix_value)  # [B, H_q, 1, D_v]
        if whole:
            return o[:, :, 0].unsqueeze(0)
        out[blk.query_index] = o[:, :, 0]
    for q_start, q_end, kv_start, kv_end in step.prefill:
        out[q_start:q_end] = _prefill_attention(query[:, :, q_start:q_end], key[:, :, kv_start:kv_end],
                                                value[:, :, kv_start:kv_end], options)
    return out.unsqueeze(0)


def _prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       options: AttentionOptions) -> torch.Tensor:
    """One request's queries ``[1, H_q, L_q, D]`` over its whole KV ``[1, H_kv, L_k, D]``, causal with the queries
    last: SDPA, as stock's continuous batching (relay's exact kernels where SDPA lacks the options' softmax).
    Returns ``[L_q, H_q, D_v]``."""
    if options.plain_softmax:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(query.shape[2], key.shape[2]), scale=options.scale,
            enable_gqa=True)
    else:
        out = attend(StepMetadata(), options, query, key[:, :, :0], value[:, :, :0], key, value)
    return out[0].transpose(0, 1)
