"""The Triton JIT kernels of relay attention: partials for the prefix (read once per batch, split-KV) and for each
row's suffix (split when the batch is small), merged by LSE. ``layout.py`` decides which units run in which launch;
``plan.py`` launches them. Every constexpr of an inner call is passed by keyword.

1. ``_partials_kernel`` — grid ``(prefix_units + suffix_units, H_kv)``; a program is one of two kinds of unit:

   * prefix unit ``(row block, split)``: for one KV head, the queries of the WHOLE batch (batch, GQA group and query
     position folded into ``N = B*G*L_q`` rows) stream one contiguous split of the prefix tile by tile with
     ``tl.dot``. Row blocks vary fastest, so programs that share a prefix tile run together and the tile comes from
     HBM once (L2 serves the rest). Splitting the prefix fills the GPU at any ``B`` (flash-decoding).
   * suffix unit ``(row, row block, split)``: one row's ``G*L_q`` queries against a split of its own left-padded
     suffix (causal, GQA without expanding K/V).

   Both kinds run in the same wave (``KIND_BOTH``), so the prefix and suffix reads overlap. Each writes a normalised
   partial output (fp32, or the input dtype with ``partial_half``) and its natural-log fp32 LSE into its own slot:
   prefix split ``s`` -> slot ``s``, suffix split ``t`` -> slot ``prefix_splits + t``.
2. ``_merge_kernel`` — grid ``(row blocks, H_kv)``: loads every slot of its rows in one tile, weights them by LSE
   (fixed reduction trees: deterministic, no atomics) and writes the output once, in the input dtype.
3. Separate layout: ``_partials_kernel`` with ``KIND_PREFIX`` (prefix units only), then with ``KIND_SUFFIX`` (suffix
   units only, own tiles); with one suffix split and few prefix slots each suffix unit merges its rows' prefix slots
   the way ``_merge_kernel`` does and writes the output, so there is no merge launch. On Hopper+ that fused suffix
   launch is a programmatic dependent launch (``PDL``): it starts while the prefix launch runs and waits only before
   the merge; where more of its programs would be queued than fit beside the prefix programs, each streams two batch
   rows (``PAIR``). The prefix's full K/V tiles load through TMA descriptors where possible (``TMA``).

Tensors (``[...]`` shapes; strides travel as one tuple per tensor):

* ``Q [B, H_q, L_q, D]`` queries, ``O [B, H_q, L_q, D]`` output (the query's dtype);
* ``PK``/``PV [1, H_kv, P, D]`` the shared prefix (strides ``pk_st``/``pv_st`` of ``[H_kv, P, D]``), ``KD``/``VD``
  TMA descriptors over the same ``[H_kv, P, D]`` (or ``None``);
* ``SK``/``SV [B, H_kv, L_s, D]`` each row's left-padded suffix, ``LENS [B]`` int valid suffix tokens, ``END [1]``
  int filled positions of a static buffer;
* ``PO [slots, H_kv, N, D]`` partial outputs (fp32 or the input dtype), ``PLSE [slots, H_kv, N]`` their fp32
  natural-log LSEs;
* grouped prefixes: ``ITEMS [items, 7]`` / ``ROWS [levels * B]`` / ``ROWP [B]`` int32 (``groups.PrefixGroups
  .tables``); ``SINKS [H_q]`` sink logits (any float dtype). Absent ones are placeholders, never read.

Sizes travel as ``dims = (N, P, L_q, L_s, G, D)``, the work split as ``prefix_work = (blocks, splits, tiles per
split, slots)`` and ``suffix_work = (blocks, splits, tiles per split)``. Triton flattens tuples into the same scalar
parameters, each specialised as a scalar would be (a unit stride stays a constant).

Scores are in the log2 domain inside the kernels (``exp2``); every LSE that leaves a kernel is natural-log fp32.
"""

from __future__ import annotations

import math

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency; without it these are plain, unlaunched functions
    from types import SimpleNamespace

    triton, tl = SimpleNamespace(jit=lambda fn: fn), SimpleNamespace(constexpr=lambda value: value)

from .options import LOG2E  # noqa: E402  (below the optional Triton import; exp(x) = exp2(x * LOG2E))

LN2 = math.log(2.0)  # log2 -> natural log: every LSE that leaves a kernel is natural-log

# unit kinds of one ``_partials_kernel`` launch (its KIND): both in one grid, or one kind per launch (the
# separate layout, 3. above)
KIND_BOTH = tl.constexpr(0)
KIND_PREFIX = tl.constexpr(1)
KIND_SUFFIX = tl.constexpr(2)
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)
_FAR = tl.constexpr(1 << 30)  # beyond every position: the neutral element of a min over rows

# The runtime parameters of the two kernels, in order: a launch passes its arguments positionally in this order (the
# C launcher of a compiled kernel takes nothing else), then the constexprs by keyword. tests/test_kernels pins these
# against the signatures.
PARTIALS_PARAMS = ("Q", "PK", "PV", "KD", "VD", "SK", "SV", "LENS", "END", "PO", "PLSE", "O", "ITEMS", "ROWS", "ROWP",
                   "SINKS", "q_st", "pk_st", "pv_st", "sk_st", "sv_st", "o_st", "dims", "scale_log2", "softcap",
                   "cap_scale", "prefix_work", "suffix_work")
MERGE_PARAMS = ("PO", "PLSE", "O", "SINKS", "o_st", "N", "L_q", "G", "D", "slots")
# where the TMA descriptors sit among PARTIALS_PARAMS (consecutive: the direct launcher expands them in place)
DESCRIPTOR_SLOTS = (PARTIALS_PARAMS.index("KD"), PARTIALS_PARAMS.index("VD"))


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    if DOT_F32:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _cap(s, softcap, cap_scale):
    """``softcap * tanh(s * cap_scale)`` (Gemma 2's logit softcap on the scaled score), tanh through ``exp2`` so
    that +-inf give +-softcap and no libdevice call is needed."""
    e = tl.exp2(s * (cap_scale * 2.0 * _LOG2E))  # exp(2x)
    return softcap * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def _empty(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The running ``(m, l, acc)`` of rows that have seen no key yet."""
    return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, BLOCK_D], tl.float32))


@triton.jit
def _attend(m, l, acc, q, K, V, sk_n, sk_d, sv_n, sv_d, lo, hi, first, row_first, q_pos, d, d_ok, scale_log2,
            softcap, cap_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
            ROW_FIRST: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """Continue the running ``(m, l, acc)`` (log2 domain, unnormalised) of queries ``q [BLOCK_M, BLOCK_D]`` over
    keys ``[lo, hi)`` of one head: ``K``/``V`` point at its first key, ``sk_n``/``sv_n`` step a key, ``sk_d``/
    ``sv_d`` a head-dim element. ``MASKED``: keys ``>= hi`` or before ``first`` (padding) are hidden, with
    ``CAUSAL`` query row j sees keys ``<= q_pos[j]``, and with ``ROW_FIRST`` only keys ``>= row_first[j]`` (a
    sliding window); unmasked calls are the prefix's full tiles, where the per-score masking is pure overhead.
    ``SOFTCAP``: scores are capped (``_cap``) before masking, and ``scale_log2`` is then ``log2(e)``. Fully masked
    rows stay at ``m=-inf, l=0, acc=0``. ``scale_log2 > 0`` is folded into the exponent (one FMA per score)."""
    # a masked prefix call covers a few tiles at most (the last partial one, a window's edge): no pipeline
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=1 if MASKED and not CAUSAL else None):
        cols = n0 + tl.arange(0, BLOCK_N)
        k_ok, v_ok = d_ok[:, None], d_ok[None, :]
        if MASKED:
            col_ok = (cols < hi) & (cols >= first)
            k_ok, v_ok = k_ok & col_ok[None, :], v_ok & col_ok[:, None]
        k = tl.load(K + cols[None, :] * sk_n + d[:, None] * sk_d, mask=k_ok, other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(V + cols[:, None] * sv_n + d[None, :] * sv_d, mask=v_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = _dot(q, k, IEEE=IEEE, DOT_F32=DOT_F32)  # raw scores [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = _cap(s, softcap, cap_scale)
        if MASKED:
            visible = col_ok[None, :]
            if CAUSAL:
                visible = visible & (cols[None, :] <= q_pos[:, None])
            if ROW_FIRST:
                visible = visible & (cols[None, :] >= row_first[:, None])
            s = tl.where(visible, s, float("-inf"))
        m, l, acc = _softmax_step(m, l, acc, s, v, scale_log2, MASKED=MASKED, IEEE=IEEE, DOT_F32=DOT_F32)
    return m, l, acc


@triton.jit
def _softmax_step(m, l, acc, s, v, scale_log2, MASKED: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """Fold raw scores ``s [BLOCK_M, BLOCK_N]`` and their values ``v [BLOCK_N, BLOCK_D]`` into the running
    ``(m, l, acc)``. Only ``MASKED`` tiles can leave a row max at -inf (a fully hidden row), so only they need the
    guard that keeps ``exp2(-inf - -inf)`` out."""
    m_new = tl.maximum(m, tl.max(s, 1) * scale_log2)
    m_safe = m_new
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * scale_log2 - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE=IEEE, DOT_F32=DOT_F32)
    return m_new, l, acc


@triton.jit
def _attend_tma(m, l, acc, q, KD, VD, h, lo, hi, scale_log2, softcap, cap_scale, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr):
    """``_attend`` over full tiles ``[lo, hi)`` of head ``h`` (unmasked: ``hi - lo`` is a multiple of
    ``BLOCK_N``) with K/V tiles from TMA descriptors over ``[H_kv, P, D]``."""
    for n0 in tl.range(lo, hi, BLOCK_N):
        k = KD.load([h, n0, 0]).reshape(BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        v = VD.load([h, n0, 0]).reshape(BLOCK_N, BLOCK_D)
        s = _dot(q, k.T, IEEE=False, DOT_F32=DOT_F32)  # raw scores [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = _cap(s, softcap, cap_scale)
        m, l, acc = _softmax_step(m, l, acc, s, v, scale_log2, MASKED=False, IEEE=False, DOT_F32=DOT_F32)
    return m, l, acc


@triton.jit
def _store_out(O, o_st, n, n_ok, h, G, L_q, d, d_ok, out):
    """Rows ``n = (b * G + g) * L_q + i`` of KV head ``h`` into ``O [B, H_q, L_q, D]`` (strides ``o_st``) in its
    dtype."""
    b, g, i = n // (G * L_q), (n // L_q) % G, n % L_q
    tl.store(O + b[:, None] * o_st[0] + (h * G + g)[:, None] * o_st[1] + i[:, None] * o_st[2]
             + d[None, :] * o_st[3], out.to(O.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])


@triton.jit
def _store_partial(PO, PLSE, slot, h, H_kv, N, n, n_ok, m, l, acc, d, d_ok, D):
    """Normalised partial (in ``PO``'s dtype) and natural-log fp32 LSE of rows ``n`` into ``slot``; an empty part
    gets (0, -inf)."""
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    lse = tl.where(l == 0.0, float("-inf"), (m + tl.log2(l)) * _LN2)
    base = (slot * H_kv + h) * N + n
    tl.store(PO + base[:, None] * D + d[None, :], out.to(PO.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])
    tl.store(PLSE + base, lse, mask=n_ok)


@triton.jit
def _valid_suffix(LENS, END, b, ok, L_s, HAS_LENS: tl.constexpr, HAS_END: tl.constexpr):
    """Valid suffix tokens of rows ``b`` (where ``ok``): their length, else the filled positions, else ``L_s``."""
    if HAS_LENS:
        return tl.load(LENS + b, mask=ok, other=0).to(tl.int32)
    if HAS_END:
        return tl.load(END).to(tl.int32) + b * 0
    return L_s + b * 0


@triton.jit
def _prefix_unit(Q, q_st, PK, pk_st, PV, pv_st, KD, VD, PO, PLSE, ITEMS, ROWS, ROWP, LENS, END, u, h, H_kv,
                 dims, scale_log2, softcap, cap_scale, prefix_work, HAS_LENS: tl.constexpr,
                 HAS_END: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 IEEE: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr, GROUPED: tl.constexpr,
                 SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
    """One block of query rows against one split of a prefix -> one partial slot.

    Ungrouped: rows ``n = (b * G + g) * L_q + i`` of the whole batch, block ``u % blocks``, split ``u // blocks``
    of the one prefix. ``GROUPED``: work item ``u % items`` of the table ``ITEMS`` (``groups.ITEM_FIELDS``: a
    block of one segment's rows, listed in ``ROWS``) and split ``u // items`` of that segment, into slot
    ``level * splits + split``. ``WINDOW > 0``: a query at absolute position ``t`` (its row's prefix length, from
    ``ROWP`` when grouped, plus its place in the row's valid suffix) sees keys at positions ``> t - WINDOW``;
    keys no row of the block sees are skipped, keys every row sees run unmasked."""
    N, P, L_q, L_s, G, D = dims
    blocks, splits, per, _ = prefix_work
    r = tl.arange(0, BLOCK_M)
    if GROUPED:
        item, split = u % blocks, u // blocks
        entry = ITEMS + item * 7
        seg_off, seg_len, seg_base = tl.load(entry), tl.load(entry + 1), tl.load(entry + 2)
        row_start, seg_rows, first_row = tl.load(entry + 3), tl.load(entry + 4), tl.load(entry + 5)
        slot = tl.load(entry + 6) * splits + split
        k = first_row + r
        n_ok = k < seg_rows
        b = tl.load(ROWS + row_start + k // (G * L_q), mask=n_ok, other=0)
        g, i = (k // L_q) % G, k % L_q
        n = (b * G + g) * L_q + i
        seg_per = tl.cdiv(tl.cdiv(seg_len, BLOCK_N), splits)
        lo = seg_off + split * seg_per * BLOCK_N
        hi = tl.maximum(tl.minimum(lo + seg_per * BLOCK_N, seg_off + seg_len), lo)
    else:
        rb, split = u % blocks, u // blocks
        slot = split
        n = rb * BLOCK_M + r
        n_ok = n < N
        b, g, i = n // (G * L_q), (n // L_q) % G, n % L_q
        lo = split * per * BLOCK_N
        hi = tl.minimum(lo + per * BLOCK_N, P)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + b[:, None] * q_st[0] + (h * G + g)[:, None] * q_st[1] + i[:, None] * q_st[2]
                + d[None, :] * q_st[3], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    m, l, acc = _empty(BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D)
    PKh, PVh = PK + h * pk_st[0], PV + h * pv_st[0]
    if WINDOW > 0:
        # first visible key (packed index) of each query: t - WINDOW + 1 at absolute position t
        row_prefix = tl.load(ROWP + b, mask=n_ok, other=0) if GROUPED else P
        t = row_prefix + _valid_suffix(LENS, END, b, n_ok, L_s, HAS_LENS=HAS_LENS, HAS_END=HAS_END) - L_q + i
        row_first = t - WINDOW + 1
        if GROUPED:
            row_first = row_first - seg_base + seg_off
        start = tl.minimum(tl.maximum(tl.min(tl.where(n_ok, row_first, _FAR)), lo), hi)
        every = tl.minimum(tl.maximum(tl.max(tl.where(n_ok, row_first, -_FAR)), start), hi)
        m, l, acc = _attend(m, l, acc, q, PKh, PVh, pk_st[1], pk_st[2], pv_st[1], pv_st[2], start, every, start,
                            row_first, i, d, d_ok, scale_log2, softcap, cap_scale, BLOCK_N=BLOCK_N, MASKED=True,
                            CAUSAL=False, ROW_FIRST=True, SOFTCAP=SOFTCAP, IEEE=IEEE, DOT_F32=DOT_F32)
        lo = every
    full = lo + (hi - lo) // BLOCK_N * BLOCK_N  # full tiles from lo on: only the range's last tile is partial
    if TMA:
        m, l, acc = _attend_tma(m, l, acc, q, KD, VD, h, lo, full, scale_log2, softcap, cap_scale,
                                BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, SOFTCAP=SOFTCAP, DOT_F32=DOT_F32)
    else:
        m, l, acc = _attend(m, l, acc, q, PKh, PVh, pk_st[1], pk_st[2], pv_st[1], pv_st[2], lo, full, 0, i, i, d,
                            d_ok, scale_log2, softcap, cap_scale, BLOCK_N=BLOCK_N, MASKED=False, CAUSAL=False,
                            ROW_FIRST=False, SOFTCAP=SOFTCAP, IEEE=IEEE, DOT_F32=DOT_F32)
    m, l, acc = _attend(m, l, acc, q, PKh, PVh, pk_st[1], pk_st[2], pv_st[1], pv_st[2], full, hi, 0, i, i, d, d_ok,
                        scale_log2, softcap, cap_scale, BLOCK_N=BLOCK_N, MASKED=True, CAUSAL=False,
                        ROW_FIRST=False, SOFTCAP=SOFTCAP, IEEE=IEEE, DOT_F32=DOT_F32)
    _store_partial(PO, PLSE, slot, h, H_kv, N, n, n_ok, m, l, acc, d, d_ok, D)


@triton.jit
def _merge_slots(PO, PLSE, SINKS, m, l, acc, h, H_kv, N, n, n_ok, qh, d, d_ok, D, slots, BLOCK_S: tl.constexpr,
                 SINK: tl.constexpr):
    """Fold the partials of rows ``n`` in slots ``0 .. slots-1`` (normalised, natural-log LSE) into the running
    ``(m, l, acc)`` and return the normalised output. All slots load as one ``[rows, BLOCK_S, D]`` tile (one round
    trip, not a chain of loads) and sum by a fixed tree, so the result is deterministic. ``SINK``: the query
    heads' ``qh`` sink logits join the denominator once, as a partial with no value (gpt-oss)."""
    s = tl.arange(0, BLOCK_S)
    ok = n_ok[:, None] & (s < slots)[None, :]
    base = (s[None, :] * H_kv + h) * N + n[:, None]
    x = tl.load(PLSE + base, mask=ok, other=float("-inf")) * _LOG2E
    o = tl.load(PO + base[:, :, None] * D + d[None, None, :], mask=ok[:, :, None] & d_ok[None, None, :],
                other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_S, BLOCK_D]
    m_new = tl.maximum(m, tl.max(x, 1))
    if SINK:
        sink = tl.load(SINKS + qh, mask=n_ok, other=float("-inf")).to(tl.float32) * _LOG2E
        m_new = tl.maximum(m_new, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    w = tl.exp2(x - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(w, 1)
    if SINK:
        l += tl.exp2(sink - m_safe)
    acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
    return acc / tl.where(l == 0.0, 1.0, l)[:, None]


@triton.jit
def _suffix_state(Q, q_st, SK, sk_st, SV, sv_st, LENS, END, b, h, qh, i, r_ok, d, d_ok, L_q, L_s, scale_log2,
                  softcap, cap_scale, split, suffix_per, HAS_LENS: tl.constexpr, HAS_END: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                  DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
    """The running ``(m, l, acc)`` of row b's queries (query heads ``qh``, positions ``i``) over one split of its
    own left-padded suffix in KV head ``h``; ``WINDOW > 0``: keys fewer than ``WINDOW`` positions back only."""
    q = tl.load(Q + b * q_st[0] + qh[:, None] * q_st[1] + i[:, None] * q_st[2] + d[None, :] * q_st[3],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    end = L_s
    if HAS_END:  # a static buffer: only the first `end` positions are filled (never read past L_s, whatever END)
        end = tl.minimum(tl.load(END).to(tl.int32), L_s)
    first = 0
    if HAS_LENS:  # left padding ends here
        first = tl.maximum(end - tl.load(LENS + b).to(tl.int32), 0)
    q_pos = end - L_q + i
    lo = split * suffix_per * BLOCK_N
    hi = tl.minimum(lo + suffix_per * BLOCK_N, end)
    skip = first
    if WINDOW > 0:  # no query of this row sees a key before its first query's window
        skip = tl.maximum(skip, end - L_q - WINDOW + 1)
    lo = tl.maximum(lo, (skip // BLOCK_N) * BLOCK_N)  # skip whole tiles of padding (and out of the window)
    m, l, acc = _empty(BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D)
    return _attend(m, l, acc, q, SK + b * sk_st[0] + h * sk_st[1], SV + b * sv_st[0] + h * sv_st[1], sk_st[2],
                   sk_st[3], sv_st[2], sv_st[3], lo, hi, first, q_pos - WINDOW + 1, q_pos, d, d_ok, scale_log2,
                   softcap, cap_scale, BLOCK_N=BLOCK_N, MASKED=True, CAUSAL=True, ROW_FIRST=WINDOW > 0,
                   SOFTCAP=SOFTCAP, IEEE=IEEE, DOT_F32=DOT_F32)


@triton.jit
def _suffix_unit(Q, q_st, SK, sk_st, SV, sv_st, LENS, END, PO, PLSE, O, o_st, SINKS, w, h, H_kv, dims,
                 scale_log2, softcap, cap_scale, prefix_slots, suffix_work, HAS_LENS: tl.constexpr,
                 HAS_END: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 IEEE: tl.constexpr, DOT_F32: tl.constexpr, FUSE: tl.constexpr, PDL: tl.constexpr,
                 PAIR: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SINK: tl.constexpr):
    """Row b's queries r = g * L_q + i against one split of its own suffix -> slot prefix_slots + split. ``FUSE``
    > 0 (one suffix split, prefix partials written by an earlier launch, ``FUSE >= prefix_slots`` a power of
    two): merge with them and write ``O`` instead. ``PAIR`` (with ``FUSE``, one suffix block and split): unit
    ``w`` is rows ``2w`` and ``2w + 1``, both streamed before the wait (see ``KernelConfig.suffix_pair_above``)."""
    N, P, L_q, L_s, G, D = dims
    suffix_blocks, suffix_splits, suffix_per = suffix_work
    rb, split, b = w % suffix_blocks, (w // suffix_blocks) % suffix_splits, w // (suffix_blocks * suffix_splits)
    if PAIR:
        b = 2 * w
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < G * L_q
    qh, i = h * G + r // L_q, r % L_q
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m, l, acc = _suffix_state(Q, q_st, SK, sk_st, SV, sv_st, LENS, END, b, h, qh, i, r_ok, d, d_ok, L_q, L_s,
                              scale_log2, softcap, cap_scale, split, suffix_per, HAS_LENS=HAS_LENS,
                              HAS_END=HAS_END, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, IEEE=IEEE,
                              DOT_F32=DOT_F32, SOFTCAP=SOFTCAP, WINDOW=WINDOW)
    n = b * G * L_q + r
    if PAIR:  # an odd batch's last pair streams row B-1 twice and stores it once
        rows = N // (G * L_q)  # batch rows B
        b1 = tl.minimum(b + 1, rows - 1)
        ok1 = r_ok & (r * 0 + b + 1 < rows)  # a full tensor: the interpreter ands a 0-d bool as int
        m1, l1, acc1 = _suffix_state(Q, q_st, SK, sk_st, SV, sv_st, LENS, END, b1, h, qh, i, r_ok, d, d_ok, L_q,
                                     L_s, scale_log2, softcap, cap_scale, split, suffix_per, HAS_LENS=HAS_LENS,
                                     HAS_END=HAS_END, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                                     IEEE=IEEE, DOT_F32=DOT_F32, SOFTCAP=SOFTCAP, WINDOW=WINDOW)
    if FUSE:
        # PDL: this launch started before the prefix launch finished; every program waits for it here, which
        # also makes whatever follows this launch in the stream follow the prefix launch
        if PDL:
            tl.extra.cuda.gdc_wait()
        out = _merge_slots(PO, PLSE, SINKS, m, l, acc, h, H_kv, N, n, r_ok, qh, d, d_ok, D, prefix_slots,
                           BLOCK_S=FUSE, SINK=SINK)
        _store_out(O, o_st, n, r_ok, h, G, L_q, d, d_ok, out)
        if PAIR:
            out = _merge_slots(PO, PLSE, SINKS, m1, l1, acc1, h, H_kv, N, n + G * L_q, ok1, qh, d, d_ok, D,
                               prefix_slots, BLOCK_S=FUSE, SINK=SINK)
            _store_out(O, o_st, n + G * L_q, ok1, h, G, L_q, d, d_ok, out)
    else:
        _store_partial(PO, PLSE, prefix_slots + split, h, H_kv, N, n, r_ok, m, l, acc, d, d_ok, D)


@triton.jit
def _partials_kernel(Q, PK, PV, KD, VD, SK, SV, LENS, END, PO, PLSE, O, ITEMS, ROWS, ROWP, SINKS,
                     q_st, pk_st, pv_st, sk_st, sv_st, o_st, dims, scale_log2, softcap, cap_scale, prefix_work,
                     suffix_work, HAS_LENS: tl.constexpr, HAS_END: tl.constexpr,
                     BLOCK_MP: tl.constexpr, BLOCK_MS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr, KIND: tl.constexpr,
                     FUSE: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr, PAIR: tl.constexpr = False,
                     GROUPED: tl.constexpr = False, SOFTCAP: tl.constexpr = False, WINDOW: tl.constexpr = 0,
                     SINK: tl.constexpr = False):
    """``KIND``: ``KIND_BOTH`` prefix and suffix units in one grid, ``KIND_PREFIX`` prefix units only,
    ``KIND_SUFFIX`` suffix units only (a launch of one kind compiles only that kind, so its tiles, shared memory
    and registers are its own). ``FUSE`` (a ``KIND_SUFFIX`` launch after a ``KIND_PREFIX`` one, one suffix split):
    each suffix unit merges its rows and writes ``O``. Parameters: the module docstring (``PARTIALS_PARAMS``)."""
    u, h = tl.program_id(0), tl.program_id(1)
    if PDL and KIND == KIND_PREFIX:  # the suffix launch may start now; it waits for this one before its merge
        tl.extra.cuda.gdc_launch_dependents()
    H_kv = tl.num_programs(1)
    prefix_blocks, prefix_splits, _, prefix_slots = prefix_work
    if KIND == KIND_SUFFIX:
        u += prefix_blocks * prefix_splits
    # prefix units first (they share tiles through L2), then suffix units; both kinds in one wave
    if KIND != KIND_SUFFIX and (KIND == KIND_PREFIX or u < prefix_blocks * prefix_splits):
        _prefix_unit(Q, q_st, PK, pk_st, PV, pv_st, KD, VD, PO, PLSE, ITEMS, ROWS, ROWP, LENS, END, u, h, H_kv,
                     dims, scale_log2, softcap, cap_scale, prefix_work, HAS_LENS=HAS_LENS, HAS_END=HAS_END,
                     BLOCK_M=BLOCK_MP, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, IEEE=IEEE, DOT_F32=DOT_F32, TMA=TMA,
                     GROUPED=GROUPED, SOFTCAP=SOFTCAP, WINDOW=WINDOW)
    else:
        _suffix_unit(Q, q_st, SK, sk_st, SV, sv_st, LENS, END, PO, PLSE, O, o_st, SINKS,
                     u - prefix_blocks * prefix_splits, h, H_kv, dims, scale_log2, softcap, cap_scale,
                     prefix_slots, suffix_work, HAS_LENS=HAS_LENS, HAS_END=HAS_END, BLOCK_M=BLOCK_MS,
                     BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, IEEE=IEEE, DOT_F32=DOT_F32, FUSE=FUSE, PDL=PDL, PAIR=PAIR,
                     SOFTCAP=SOFTCAP, WINDOW=WINDOW, SINK=SINK)


@triton.jit
def _merge_kernel(PO, PLSE, O, SINKS, o_st, N, L_q, G, D, slots,
                  BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SINK: tl.constexpr = False):
    """Rows ``n`` of head ``h``: all ``slots`` partials at once (``_merge_slots`` from an empty state), written once
    in ``O``'s dtype; bitwise reproducible."""
    pid, h = tl.program_id(0), tl.program_id(1)
    n = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    n_ok, d_ok = n < N, d < D
    m, l, acc = _empty(BLOCK_M=BLOCK_R, BLOCK_D=BLOCK_D)
    qh = h * G + (n // L_q) % G
    out = _merge_slots(PO, PLSE, SINKS, m, l, acc, h, tl.num_programs(1), N, n, n_ok, qh, d, d_ok, D, slots,
                       BLOCK_S=BLOCK_S, SINK=SINK)
    _store_out(O, o_st, n, n_ok, h, G, L_q, d, d_ok, out)
