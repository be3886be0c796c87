"""The Triton kernels of the paged relay decode step (``paged.py`` launches them).

1. ``_prefix_kernel`` — grid ``(programs, H_kv, splits)``: prefix units. A unit is one tile of up to
   ``rows_per_tile`` members of a group (``grouping.Groups.tiles``) with the GQA group of one KV head, folded into
   ``BLOCK_M`` query rows, streaming one split of the group's shared pages through the leader's block-table row:
   those pages come from HBM once for the whole tile. A program loops over the step's live tiles. Each unit writes a
   normalised partial output (fp32, or the query's dtype: ``Tiles.half_partials``) and its natural-log fp32 LSE into
   its slot (``PO``/``PLSE``): level-1 split ``s`` -> slot ``s``, level-2 -> ``splits + s``.
2. ``_suffix_kernel`` — grid ``(B, H_kv, splits)``: suffix units, one row's GQA group against one split of its
   suffix: its cached pages after the shared prefix, then (last split) the step's new token, read from the call's
   ``k``/``v`` while split 0 writes it into its page (no write launch; no unit reads that slot of the cache in this
   step). With one split (``MERGE``) the unit merges the row's prefix slots into its own result and writes the output:
   no merge launch and no suffix partial; with ``OVERLAP`` (Hopper+) this launch is a programmatic dependent launch
   that starts while the prefix launch runs and waits for it (``gdc_wait``) only before that merge. Otherwise split
   ``t`` writes slot ``2 * prefix splits + t``.
3. ``_merge_kernel`` — grid ``(B, H_q)``, only for a split suffix: weights the slots of a row by their LSE (plus an
   attention sink) and writes the output in the query's dtype.

Which prefix slots of a row hold a result follows from its ``Groups.bounds`` (a level's slots are written for every
member of a group of that level, and only for them), so the slots need no ``-inf`` fill before a step.
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
def _scores(s, scale_log2, softcap, SOFTCAP: tl.constexpr):
    """q.k products -> log2-domain scores: ``scale * s``, or ``softcap * tanh(scale * s / softcap)`` (tanh through
    exp2; with a softcap ``scale_log2`` is ``scale * log2(e) / softcap``)."""
    if SOFTCAP:
        e = tl.exp2(s * (2.0 * scale_log2))
        out = softcap * (1.0 - 2.0 / (e + 1.0)) * _LOG2E
    else:
        out = s * scale_log2
    return out


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
        s = tl.where(col_ok[None, :], _scores(s, scale_log2, softcap, SOFTCAP), float("-inf"))
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
    tl.store(PO + at[:, None] + d[None, :] * po_st[3], out.to(PO.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(PLSE + slot * plse_st[0] + rows.to(tl.int64) * plse_st[1] + heads * plse_st[2], lse * _LN2, mask=row_ok)


@triton.jit
def _prefix_kernel(Q, KC, VC, BT, TILES, COUNTS, MEMBERS, BOUNDS, PO, PLSE, q_st, kc_st, vc_st, po_st, plse_st,
                   n_rows, bt_b, page_size, G, D, scale_log2, softcap, OVERLAP: tl.constexpr, PROGRAMS: tl.constexpr,
                   ROWS_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   SPLITS: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Prefix units: program ``p`` takes tiles ``p, p + PROGRAMS, ...`` of the step's live tiles (``COUNTS``: how
    many of each level; level 1's sit at the front of ``TILES``, level 2's from row ``n_rows`` on). Looping over
    the live tiles keeps the grid small whatever the groups (their number is known on the device only)."""
    p, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if OVERLAP:  # the suffix launch may start now; its units wait for this launch before they merge
        tl.extra.cuda.gdc_launch_dependents()
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
def _suffix_kernel(Q, K, V, KC, VC, BT, PAST, BOUNDS, PO, PLSE, OUT, SINKS, q_st, k_st, v_st, kc_st, vc_st, po_st,
                   plse_st, o_st, bt_b, capacity, page_size, G, D, scale_log2, softcap, PREFIX_SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                   SOFTCAP: tl.constexpr, IEEE: tl.constexpr, WRITE: tl.constexpr, MERGE: tl.constexpr,
                   HAS_SINKS: tl.constexpr, OVERLAP: tl.constexpr = False):
    """Suffix units: row ``b``'s cached tokens after its shared prefix (``BOUNDS[b, 2]`` pages) up to ``PAST[b]``,
    then, where this call writes it (``WRITE``), the new token from ``K``/``V [B, 1, H_kv, D]``; none for padding
    (``PAST[b] < 0``) or a row with more than ``capacity`` cached tokens (its table's pages, less the new token's
    slot: a malformed call, which then reads and writes nothing outside the table). ``MERGE`` (one split): the
    row's prefix slots merged in and ``OUT`` written."""
    b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    row_ok = i < G
    heads = h * G + i % G
    past = tl.load(PAST + b)
    past = tl.where(past <= capacity, past, -1)  # tokens past the table's pages: read and write nothing
    bt_row = BT + b * bt_b
    lo = tl.load(BOUNDS + b * 3 + 2) * page_size
    hi = tl.maximum(past, 0)
    span = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), SPLITS), BLOCK_N) * BLOCK_N
    lo_s = lo + split * span
    q = tl.load(Q + b.to(tl.int64) * q_st[0] + heads[:, None] * q_st[1] + d[None, :] * q_st[2],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    out, lse = _attend(q, KC, VC, bt_row, lo_s, tl.minimum(hi, lo_s + span), h, kc_st, vc_st, page_size, d, d_ok,
                       scale_log2, softcap, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, SOFTCAP=SOFTCAP,
                       IEEE=IEEE)
    if WRITE:
        out, lse = _new_token(out, lse, q, K, V, KC, VC, bt_row, b, h, past, split, k_st, v_st, kc_st, vc_st,
                              page_size, d, d_ok, scale_log2, softcap, SPLITS=SPLITS, SOFTCAP=SOFTCAP)
    if MERGE:
        if OVERLAP:  # started beside the prefix launch: its slots are complete (and visible) after this wait, which
            tl.extra.cuda.gdc_wait()  # also makes whatever follows this launch in the stream follow the prefix launch
        out = _merged(out, lse, PO, PLSE, SINKS, BOUNDS, b, heads, row_ok, d, d_ok, po_st, plse_st,
                      PREFIX_SPLITS=PREFIX_SPLITS, HAS_SINKS=HAS_SINKS)
        tl.store(OUT + b.to(tl.int64) * o_st[0] + heads[:, None] * o_st[1] + d[None, :] * o_st[2],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        slot = 2 * PREFIX_SPLITS + split
        at = slot * po_st[0] + b.to(tl.int64) * po_st[1] + heads * po_st[2]
        tl.store(PO + at[:, None] + d[None, :] * po_st[3], out.to(PO.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(PLSE + slot * plse_st[0] + b.to(tl.int64) * plse_st[1] + heads * plse_st[2], lse * _LN2,
                 mask=row_ok)


@triton.jit
def _new_token(out, lse, q, K, V, KC, VC, bt_row, b, h, past, split, k_st, v_st, kc_st, vc_st, page_size, d, d_ok,
               scale_log2, softcap, SPLITS: tl.constexpr, SOFTCAP: tl.constexpr):
    """The step's new token of row ``b``, KV head ``h``: split 0 writes it into its page (a padding row or an
    unallocated page writes nothing); the last split folds it, as the cache stores it, into its ``(out, lse)``
    (normalised fp32 ``[BLOCK_M, BLOCK_D]``, log2-domain ``[BLOCK_M]``), which it returns."""
    page = tl.load(bt_row + tl.maximum(past, 0) // page_size)
    live = (d * 0 + past >= 0) & d_ok  # as blocks: the interpreter masks with blocks only
    k = tl.load(K + b.to(tl.int64) * k_st[0] + h * k_st[1] + d * k_st[2], mask=live, other=0.0)
    v = tl.load(V + b.to(tl.int64) * v_st[0] + h * v_st[1] + d * v_st[2], mask=live, other=0.0)
    k, v = k.to(KC.dtype.element_ty), v.to(VC.dtype.element_ty)
    written = live & (d * 0 + page >= 0) & (d * 0 + split == 0)
    within = tl.maximum(past, 0) % page_size
    tl.store(KC + page.to(tl.int64) * kc_st[0] + within * kc_st[1] + h * kc_st[2] + d * kc_st[3], k, mask=written)
    tl.store(VC + page.to(tl.int64) * vc_st[0] + within * vc_st[1] + h * vc_st[2] + d * vc_st[3], v, mask=written)
    s = _scores(tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1), scale_log2, softcap, SOFTCAP)
    s = tl.where((s * 0.0 + past >= 0) & (s * 0.0 + split == SPLITS - 1), s, float("-inf"))  # [BLOCK_M]
    m = tl.maximum(lse, s)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_old, w_new = tl.exp2(lse - m_safe), tl.exp2(s - m_safe)
    den = w_old + w_new
    out = (out * w_old[:, None] + v.to(tl.float32)[None, :] * w_new[:, None]) / tl.where(den > 0.0, den, 1.0)[:, None]
    return out, tl.where(den > 0.0, m_safe + tl.log2(tl.where(den > 0.0, den, 1.0)), float("-inf"))


@triton.jit
def _slot_ok(s, b0, b1, PREFIX_SPLITS: tl.constexpr):
    """Slot ``s`` of a row whose ``Groups.bounds`` start ``(b0, b1)`` holds a result: a suffix slot always, a
    level's prefix slot where the row is in a group of that level."""
    b0, b1 = s * 0 + b0, s * 0 + b1  # as blocks: the interpreter's scalar comparisons give no boolean mask
    return (s >= 2 * PREFIX_SPLITS) | ((s < PREFIX_SPLITS) & (b0 > 0)) | ((s >= PREFIX_SPLITS) & (b1 > b0))


@triton.jit
def _merged(out, lse, PO, PLSE, SINKS, BOUNDS, b, heads, row_ok, d, d_ok, po_st, plse_st,
            PREFIX_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The suffix result ``(out, lse)`` of row ``b`` (``[BLOCK_M, BLOCK_D]`` fp32 normalised, ``[BLOCK_M]``
    log2-domain) merged with the row's prefix slots (and a sink, natural-log logit per query head), normalised."""
    b0, b1 = tl.load(BOUNDS + b * 3), tl.load(BOUNDS + b * 3 + 1)
    m = lse
    den = tl.where(lse == float("-inf"), 0.0, 1.0)
    acc = out * den[:, None]
    for s in tl.static_range(2 * PREFIX_SPLITS):
        ok = row_ok & _slot_ok(row_ok.to(tl.int32) * 0 + s, b0, b1, PREFIX_SPLITS)  # [BLOCK_M]
        part_lse = tl.load(PLSE + s * plse_st[0] + b.to(tl.int64) * plse_st[1] + heads * plse_st[2], mask=ok,
                           other=float("-inf")) * _LOG2E
        part = tl.load(PO + s * po_st[0] + b.to(tl.int64) * po_st[1] + heads[:, None] * po_st[2] + d[None, :] *
                       po_st[3], mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        m_new = tl.maximum(m, part_lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, w = tl.exp2(m - m_safe), tl.exp2(part_lse - m_safe)
        den = den * alpha + w
        acc = acc * alpha[:, None] + part * w[:, None]
        m = m_new
    if HAS_SINKS:
        sink = tl.load(SINKS + heads, mask=row_ok, other=float("-inf")).to(tl.float32) * _LOG2E
        m_new = tl.maximum(m, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        den = den * alpha + tl.exp2(sink - m_safe)
        acc = acc * alpha[:, None]
    return acc / tl.where(den > 0.0, den, 1.0)[:, None]


@triton.jit
def _merge_kernel(PO, PLSE, OUT, SINKS, BOUNDS, po_st, plse_st, o_st, D, slots, PREFIX_SPLITS: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr):
    """``OUT [B, 1, H_q, D]`` (strides of b, h, d) of row ``b``, query head ``h``: the ``slots`` partials weighted by
    their LSE; ``SINKS [H_q]`` adds ``exp(sink)`` to the denominator (natural-log logits, not scaled). A row with
    no key at all (padding) gets zeros. All slots are loaded at once (one head's ``[slots, D]``: a loop over the
    slots waited on one load after another); a slot that holds nothing (``_slot_ok``) is not read."""
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    ok = (s < slots) & _slot_ok(s, tl.load(BOUNDS + b * 3), tl.load(BOUNDS + b * 3 + 1), PREFIX_SPLITS)
    lse = tl.load(PLSE + s * plse_st[0] + b * plse_st[1] + h * plse_st[2], mask=ok, other=float("-inf"))  # [BLOCK_S]
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
                   mask=(w[:, None] > 0.0) & d_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(w[:, None] * part, 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(OUT + b * o_st[0] + h * o_st[1] + d * o_st[2], out.to(OUT.dtype.element_ty), mask=d_ok)
