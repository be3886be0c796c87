"""The Triton kernels of the paged relay decode step (``paged.py`` launches them).

1. ``_write_kernel`` — grid ``(B, H_kv)``: the step's new K/V of a row into its page (padding rows write nothing).
2. ``_prefix_kernel`` — grid ``(programs, H_kv, splits)``: prefix units. A unit is one tile of up to
   ``rows_per_tile`` members of a group (``grouping.Groups.tiles``) with the GQA group of one KV head, folded into
   ``BLOCK_M`` query rows, streaming one split of the group's shared pages through the leader's block-table row:
   those pages come from HBM once for the whole tile. A program loops over the step's live tiles.
3. ``_suffix_kernel`` — grid ``(B, H_kv, splits)``: suffix units, one row's GQA group against one split of its
   suffix: its pages after the shared prefix, the new token included.

   Every unit writes a normalised fp32 partial output and its natural-log fp32 LSE into its slot (``PO``/``PLSE``):
   level-1 split ``s`` -> slot ``s``, level-2 -> ``splits + s``, suffix split ``t`` -> ``2 * splits + t``.
4. ``_merge_kernel`` — grid ``(B, H_q)``: weights the slots of a row by their LSE (plus an attention sink) and writes
   the output in the query's dtype.

Scores are in the log2 domain inside the kernels (``exp2``); every LSE that leaves a kernel is natural-log fp32.
Keys are addressed token by token through the block table (``page = BT[t // page_size]``), so a tile may straddle
pages and any page size works.
"""

from __future__ import annotations

import math

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - without Triton, paged.py runs its PyTorch path
    from types import SimpleNamespace

    triton, tl = SimpleNamespace(jit=lambda fn: fn), SimpleNamespace(constexpr=lambda value: value)

_LOG2E = tl.constexpr(1.0 / math.log(2.0))
_LN2 = tl.constexpr(math.log(2.0))


@triton.jit
def _write_kernel(K, V, KC, VC, BT, PAST, k_st, v_st, kc_st, vc_st, bt_b, page_size, D, BLOCK_D: tl.constexpr):
    """``K``/``V [B, 1, H_kv, D]`` (strides ``k_st``/``v_st`` of b, h, d) into ``KC``/``VC [P, page_size, H_kv, D]``
    at token ``PAST[b]`` of row ``b``'s pages; ``PAST[b] < 0`` (padding) or an unallocated page writes nothing."""
    b, h = tl.program_id(0), tl.program_id(1)
    pos = tl.load(PAST + b)
    page = tl.load(BT + b * bt_b + tl.maximum(pos, 0) // page_size)
    d = tl.arange(0, BLOCK_D)
    d_ok = (d < D) & (d * 0 + pos >= 0) & (d * 0 + page >= 0)  # as blocks: the interpreter masks with blocks only
    slot = page.to(tl.int64) * kc_st[0] + (pos % page_size) * kc_st[1] + h * kc_st[2]
    k = tl.load(K + b * k_st[0] + h * k_st[1] + d * k_st[2], mask=d_ok)
    tl.store(KC + slot + d * kc_st[3], k.to(KC.dtype.element_ty), mask=d_ok)
    slot = page.to(tl.int64) * vc_st[0] + (pos % page_size) * vc_st[1] + h * vc_st[2]
    v = tl.load(V + b * v_st[0] + h * v_st[1] + d * v_st[2], mask=d_ok)
    tl.store(VC + slot + d * vc_st[3], v.to(VC.dtype.element_ty), mask=d_ok)


@triton.jit
def _attend(q, KC, VC, bt_row, lo, hi, h, kc_st, vc_st, page_size, d, d_ok, scale_log2, softcap,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
            IEEE: tl.constexpr):
    """Attention of ``q [BLOCK_M, BLOCK_D]`` over tokens ``[lo, hi)`` of KV head ``h`` of the pages listed at
    ``bt_row``: the normalised output ``[BLOCK_M, BLOCK_D]`` fp32 and its log2-domain LSE ``[BLOCK_M]``."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in tl.range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        page = tl.load(bt_row + cols // page_size, mask=col_ok, other=0).to(tl.int64)
        within = cols % page_size
        k_at = page * kc_st[0] + within * kc_st[1] + h * kc_st[2]
        v_at = page * vc_st[0] + within * vc_st[1] + h * vc_st[2]
        k = tl.load(KC + k_at[None, :] + d[:, None] * kc_st[3], mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(VC + v_at[:, None] + d[None, :] * vc_st[3], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if SOFTCAP:  # softcap * tanh(scale * s / softcap), tanh through exp2; scale_log2 is scale*log2(e)/softcap
            e = tl.exp2(s * (2.0 * scale_log2))
            s = softcap * (1.0 - 2.0 / (e + 1.0)) * _LOG2E
        else:
            s = s * scale_log2
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        den = den * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    seen = den > 0.0
    out = acc / tl.where(seen, den, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log2(tl.where(seen, den, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _unit(Q, KC, VC, PO, PLSE, rows, row_ok, lo, hi, bt_row, slot, h, split, q_st, kc_st, vc_st, po_st, plse_st,
          page_size, G, D, scale_log2, softcap, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
          SPLITS: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """One unit: query rows ``rows`` (each with the GQA group of KV head ``h``; ``row_ok`` the live ones) against
    split ``split`` of tokens ``[lo, hi)`` of the pages listed at ``bt_row``, written to ``slot``."""
    i = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    span = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), SPLITS), BLOCK_N) * BLOCK_N
    lo_s = lo + split * span
    hi_s = tl.minimum(hi, lo_s + span)
    heads = h * G + i % G
    q = tl.load(Q + rows.to(tl.int64)[:, None] * q_st[0] + heads[:, None] * q_st[1] + d[None, :] * q_st[2],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    out, lse = _attend(q, KC, VC, bt_row, lo_s, hi_s, h, kc_st, vc_st, page_size, d, d_ok, scale_log2, softcap,
                       BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, SOFTCAP=SOFTCAP, IEEE=IEEE)
    at = slot * po_st[0] + rows.to(tl.int64) * po_st[1] + heads * po_st[2]
    tl.store(PO + at[:, None] + d[None, :] * po_st[3], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(PLSE + slot * plse_st[0] + rows.to(tl.int64) * plse_st[1] + heads * plse_st[2], lse * _LN2, mask=row_ok)


@triton.jit
def _prefix_kernel(Q, KC, VC, BT, TILES, COUNTS, MEMBERS, BOUNDS, PO, PLSE, q_st, kc_st, vc_st, po_st, plse_st,
                   n_rows, bt_b, page_size, G, D, scale_log2, softcap, PROGRAMS: tl.constexpr,
                   ROWS_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   SPLITS: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Prefix units: program ``p`` takes tiles ``p, p + PROGRAMS, ...`` of the step's live tiles (``COUNTS``: how
    many of each level; level 1's sit at the front of ``TILES``, level 2's from row ``n_rows`` on). Looping over
    the live tiles keeps the grid small whatever the groups (their number is known on the device only)."""
    p, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n1 = tl.load(COUNTS)
    live = n1 + tl.load(COUNTS + 1)
    member = tl.arange(0, BLOCK_M) // G
    for t in range(p, live, PROGRAMS):
        at = tl.where(t < n1, t, n_rows + t - n1)
        level = tl.load(TILES + at * 4)
        lead = tl.load(TILES + at * 4 + 1)
        first = tl.load(TILES + at * 4 + 2)
        count = tl.load(TILES + at * 4 + 3)
        row_ok = (member < count) & (member < ROWS_PER_TILE)
        rows = tl.load(MEMBERS + (level - 1) * n_rows + first + member, mask=row_ok, other=0)
        lo = tl.where(level == 1, 0, tl.load(BOUNDS + lead * 3)) * page_size
        hi = tl.load(BOUNDS + lead * 3 + level - 1) * page_size
        _unit(Q, KC, VC, PO, PLSE, rows, row_ok, lo, hi, BT + lead * bt_b, (level - 1) * SPLITS + split, h, split,
              q_st, kc_st, vc_st, po_st, plse_st, page_size, G, D, scale_log2, softcap, BLOCK_M=BLOCK_M,
              BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, SPLITS=SPLITS, SOFTCAP=SOFTCAP, IEEE=IEEE)


@triton.jit
def _suffix_kernel(Q, KC, VC, BT, PAST, BOUNDS, PO, PLSE, q_st, kc_st, vc_st, po_st, plse_st, bt_b, page_size, G, D,
                scale_log2, softcap, slot0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                SPLITS: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr, WROTE: tl.constexpr):
    """Suffix units: row ``b``'s tokens after its shared prefix (``BOUNDS[b, 2]`` pages) up to its length:
    ``PAST[b]`` cached tokens, plus the step's new one where this call wrote it (``WROTE``); none for padding."""
    b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = tl.arange(0, BLOCK_M)
    lo = tl.load(BOUNDS + b * 3 + 2) * page_size
    past = tl.load(PAST + b)
    seq = tl.where(past >= 0, past + WROTE, 0)
    _unit(Q, KC, VC, PO, PLSE, tl.zeros([BLOCK_M], tl.int32) + b, i < G, lo, seq, BT + b * bt_b,
          slot0 + split, h, split, q_st, kc_st, vc_st, po_st, plse_st, page_size, G, D, scale_log2, softcap,
          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, SPLITS=SPLITS, SOFTCAP=SOFTCAP, IEEE=IEEE)


@triton.jit
def _merge_kernel(PO, PLSE, OUT, SINKS, po_st, plse_st, o_st, D, slots, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    """``OUT [B, 1, H_q, D]`` (strides of b, h, d) of row ``b``, query head ``h``: the ``slots`` partials weighted by
    their LSE; ``SINKS [H_q]`` adds ``exp(sink)`` to the denominator (natural-log logits, not scaled). A row with
    no key at all (padding) gets zeros. All slots are loaded at once (one head's ``[slots, D]``: a loop over the
    slots waited on one load after another); a slot that holds nothing (``-inf``) is not read."""
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    lse = tl.load(PLSE + s * plse_st[0] + b * plse_st[1] + h * plse_st[2], mask=s < slots,
                  other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2((lse - m_safe) * _LOG2E)  # [BLOCK_S]
    den = tl.sum(w, 0)
    if HAS_SINKS:
        den += tl.exp2((sink - m_safe) * _LOG2E)
    part = tl.load(PO + s[:, None] * po_st[0] + b * po_st[1] + h * po_st[2] + d[None, :] * po_st[3],
                   mask=(w[:, None] > 0.0) & d_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(w[:, None] * part, 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(OUT + b * o_st[0] + h * o_st[1] + d * o_st[2], out.to(OUT.dtype.element_ty), mask=d_ok)
