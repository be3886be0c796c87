"""Triton relay attention: partials for the prefix (read once per batch, split-KV) and for each row's suffix (split
when the batch is small), merged by LSE. Two layouts, picked by the row count (``SEPARATE_ROWS``): one launch for
all partials plus a tiny merge launch, or a prefix launch then a suffix launch that merges (see 3.).

1. ``_partials_kernel`` — grid ``(prefix_units + suffix_units, H_kv)``; a program is one of two kinds of unit:

   * prefix unit ``(row block, split)``: for one KV head, the queries of the WHOLE batch (batch, GQA group and query
     position folded into ``N = B*G*L_q`` rows) stream one contiguous split of the prefix tile by tile with
     ``tl.dot``. Row blocks vary fastest, so programs that share a prefix tile run together and the tile comes from
     HBM once (L2 serves the rest). Splitting the prefix fills the GPU at any ``B`` (flash-decoding).
   * suffix unit ``(row, row block, split)``: one row's ``G*L_q`` queries against a split of its own left-padded
     suffix (causal, GQA without expanding K/V).

   Both kinds run in the same wave, so the prefix and suffix reads overlap. Each writes a normalised partial output
   (fp32, or the input dtype with ``PARTIAL_HALF``) and its natural-log fp32 LSE into its own slot: prefix split
   ``s`` -> slot ``s``, suffix split ``t`` -> slot ``prefix_splits + t``.
2. ``_merge_kernel`` — grid ``(row blocks, H_kv)``: loads every slot of its rows in one tile, weights them by LSE
   (fixed reduction trees: deterministic, no atomics) and writes the output once, in the input dtype.
3. Separate layout: ``_partials_kernel`` with ``KIND=1`` (prefix units only), then with ``KIND=2`` (suffix units
   only, own tiles); with one suffix split and few prefix slots each suffix unit merges its rows' prefix slots the
   way ``_merge_kernel`` does and writes the output, so there is no merge launch. On Hopper+ that fused suffix launch
   is a programmatic dependent launch (``PDL``): it starts while the prefix launch runs and waits only before the
   merge; where more of its programs would be queued than fit beside the prefix programs, each streams two batch rows
   (``SUFFIX_PAIR_ABOVE``). The prefix's full K/V tiles load through TMA descriptors where possible (``PREFIX_TMA``).

Tensor contract (see ``relay_hf.relay_attention``): ``query [B, H_q, L_q, D]``, ``prefix_* [1, H_kv, P, D]``,
``suffix_* [B, H_kv, L_s, D]``, ``suffix_lengths [B]`` int or None, ``suffix_end`` one-element int tensor or None.
Scores are in the log2 domain inside the kernels (``exp2``); every LSE that leaves a kernel is natural-log fp32.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton without TMA descriptors: pointer loads only
    TensorDescriptor = None

from .reference import check_relay_inputs

LOG2E = 1.4426950408889634

# --- tile configs and work split, in one visible place -------------------------------------------------------------
TILES = {64: (64, 4, 3), 128: (64, 4, 3), 256: (32, 8, 2)}  # head dim -> (BLOCK_N keys per tile, warps, stages)
MAX_BLOCK_M = 64  # query rows per prefix program; small batches use the smallest tl.dot tile (16)
SPLIT_WAVES = 4  # prefix units alone aim for this many programs per SM
SUFFIX_WAVES = 1  # suffix units alone aim for this many programs per SM (split the suffix when B*H_kv is small)
PARTIAL_BUDGET = 2  # keep prefix-partial traffic <= 1/PARTIAL_BUDGET of the prefix bytes
MAX_SPLITS = 32
MERGE_TILE = (16, 2)  # merge kernel: (rows x slots per program, warps); a program merges max(1, 16 // slots) rows
PARTIAL_HALF = True  # fp16/bf16 inputs: partial outputs in the input dtype (half the scratch bytes); LSE stays fp32
# Separate layout: for N = B*G*L_q rows in SEPARATE_ROWS the prefix and the suffix run as two launches, each compiled
# for its own tiles (the suffix's lighter programs then fit 3-5 per SM), the prefix split for SEPARATE_SPLIT =
# (SPLIT_WAVES, PARTIAL_BUDGET), and the suffix launch merges the prefix partials itself when there are at most
# FUSED_MERGE_SLOTS of them and its [rows, slots, D] merge tile has at most FUSED_MERGE_TILE rows x slots (no merge
# launch). Measured on the H200 with PDL (below; docs/kernel_notes.md, session 5, us): one launch -> separate at
# 4096 x 16: 15.8 -> 12.7 (then without the fused merge), 4096 x 128: 63.5 -> 59.1; at 32 rows it lost (1024 x 8:
# 8.3 -> 8.8), hence [64, 512]; but 16384 x 128 went 123.4 -> 132.7 (a tail wave of prefix programs).
# 16 fused slots instead of 8: 16384 x 32: 42.5 -> 34.3 (its 16 prefix splits no longer need a merge launch).
SEPARATE_ROWS = (64, 512)
SUFFIX_TILES = {64: (32, 4, 3), 128: (32, 4, 3), 256: (32, 8, 2)}
# The separate prefix launch is split for whole waves of SEPARATE_SPLIT[0] programs per SM: rounding the split count
# up had S=16384, B=128 at 5 splits x 64 units = 320 programs for 264 slots; 4 splits: 132.8 -> 109.5 us, and
# 16384 x 64 (L_s 96): 61.3 -> 45.6, 32768 x 32: 66.7 -> 51.1 (session 6). The one-launch layout still rounds up
# (its grid also holds the suffix units; whole waves there: 16384 x 256: 225.7 -> 230.0).
SEPARATE_SPLIT = (2, 4)
FUSED_MERGE_SLOTS = 16
FUSED_MERGE_TILE = 512
# The separate layout's prefix launch: head dim -> (BLOCK_M query rows, BLOCK_N keys, warps, stages). 128-row blocks
# with 8 warps (one K/V tile in shared memory for twice the rows) and 2 stages were slower on the H200 (session 5).
PREFIX_TILES = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3), 256: (64, 32, 8, 2)}
# Prefix K/V full tiles through TMA tensor descriptors (Hopper+ or the interpreter; fp16/bf16, head dim a power of
# two, 16-byte aligned strides): no address registers, no per-element predicates.
PREFIX_TMA = True
# Programmatic dependent launch (Hopper+) of the separate layout's fused suffix launch: it is queued as soon as every
# prefix program has started (instead of after the prefix launch drains), its programs stream their suffix K/V as SM
# room frees, and wait (griddepcontrol.wait) only before they read the prefix partials. Measured (H200, session 5,
# warm us): 4096 x 32: 24.3 -> 18.1, 4096 x 64 (L_s 96): 23.9 -> 22.7, 8192 x 64 (L_s 96): 32.7 -> 31.3. It lost
# where the suffix launch does not merge (waiting before exit; 16384 x 32 with 8 fused slots: 39.7 -> 42.5) and on
# the merge launch (1024 x 8: 8.2 -> 8.7, 4096 x 128: 63.5 -> 65.9: waiting programs hold SM slots), so it is used
# for the fused suffix launch only.
PDL = True
# Paired suffix units: where the prefix launch runs at most one program per SM (room beside it), the prefix has at
# least SUFFIX_PAIR_MIN_PREFIX tokens and the fused suffix launch would have more than SUFFIX_PAIR_ABOVE programs per
# SM (about what fits beside one prefix program), each suffix program streams two batch rows before its PDL wait.
# Unpaired, the suffix programs that fit finish streaming early and then hold their slots in that wait while the rest
# cannot start until prefix programs leave (S=4096, B=64: 404 of 512 resident, the last 108 start at 16.7 us and end
# at 22.6 us; session 10's in-kernel timeline). Measured (H200, warm us, session 10): 4096 x 64 (L_s 96) 22.8 ->
# 20.4-20.7, (L_s 88) 22.4 -> 20.5-21.0, 4096 x 128 59.7 -> 55.1-55.2, 2048 x 64 unchanged, 1024 x 64 17.1 -> 17.4
# (hence the prefix bound); end to end S=4096, B=64 6.178-6.185 -> 6.097-6.104 ms a step. None: never.
SUFFIX_PAIR_ABOVE = 3
SUFFIX_PAIR_MIN_PREFIX = 2048


def triton_available() -> bool:
    """Triton imports and can run here: a CUDA device, or the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return triton is not None and (torch.cuda.is_available() or _interpreting())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _tile(head_dim: int, tiles=None):
    block_d = max(16, triton.next_power_of_2(head_dim))
    return (block_d, *(tiles or TILES)[min(max(block_d, 64), 256)])


@functools.cache
def _num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _hopper(device_index: int) -> bool:
    """Hopper or newer: TMA descriptors and programmatic dependent launch."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _block_m(rows: int, cap: int | None = None) -> int:
    return min(cap or MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))


def plan_splits(P: int, N: int, H_kv: int, block_m: int, block_n: int, num_sms: int, waves: int | None = None,
                budget: int | None = None, whole_waves: bool = False) -> tuple[int, int]:
    """``(splits, tiles_per_split)`` for the prefix: enough programs for ``waves`` (``SPLIT_WAVES``) per SM (with
    ``whole_waves``: as many as fit, never a partial wave more), few enough that the partials (``splits * N * D``
    elements per head) stay within ``1/budget`` (``PARTIAL_BUDGET``) of the prefix (``P * D`` elements per head, K and
    V)."""
    if P == 0:
        return 0, 1
    waves, budget = waves or SPLIT_WAVES, budget or PARTIAL_BUDGET
    n_tiles = triton.cdiv(P, block_n)
    units = H_kv * triton.cdiv(N, block_m)
    want = max(1, waves * num_sms // units) if whole_waves else triton.cdiv(waves * num_sms, units)
    cap = max(1, P // (budget * N))
    splits = max(1, min(n_tiles, want, cap, MAX_SPLITS))
    per = triton.cdiv(n_tiles, splits)
    return triton.cdiv(n_tiles, per), per


def plan_suffix_splits(L_s: int, units: int, H_kv: int, block_n: int, num_sms: int) -> tuple[int, int]:
    """``(splits, tiles_per_split)`` for the suffix: split each row's suffix only when ``units * H_kv`` programs
    (one per row and row block) would leave SMs idle."""
    n_tiles = max(1, triton.cdiv(L_s, block_n))
    want = triton.cdiv(SUFFIX_WAVES * num_sms, H_kv * units)
    splits = max(1, min(n_tiles, want, MAX_SPLITS))
    per = triton.cdiv(n_tiles, splits)
    return triton.cdiv(n_tiles, per), per


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
        if DOT_F32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _empty(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """The running ``(m, l, acc)`` of rows that have seen no key yet."""
        return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
                tl.zeros([BLOCK_M, BLOCK_D], tl.float32))

    @triton.jit
    def _attend(m, l, acc, q, K, V, sk_n, sk_d, sv_n, sv_d, lo, hi, first, q_pos, d, d_ok, scale_log2,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                IEEE: tl.constexpr, DOT_F32: tl.constexpr):
        """Continue the running ``(m, l, acc)`` (log2 domain, unnormalised) of queries ``q [BLOCK_M, BLOCK_D]`` over
        keys ``[lo, hi)`` of one head (``K``/``V`` point at its first key). ``MASKED``: keys ``>= hi`` or before
        ``first`` (padding) are hidden, and with ``CAUSAL`` query row j sees keys ``<= q_pos[j]``; unmasked calls are
        the prefix's full tiles, where the per-score masking is pure overhead. Fully masked rows stay at
        ``m=-inf, l=0, acc=0``. ``scale_log2 > 0`` is folded into the exponent (one FMA per score)."""
        # a masked prefix call covers at most P's last partial tile: not worth a software pipeline
        for n0 in tl.range(lo, hi, BLOCK_N, num_stages=1 if MASKED and not CAUSAL else None):
            cols = n0 + tl.arange(0, BLOCK_N)
            k_ok, v_ok = d_ok[:, None], d_ok[None, :]
            if MASKED:
                col_ok = (cols < hi) & (cols >= first)
                k_ok, v_ok = k_ok & col_ok[None, :], v_ok & col_ok[:, None]
            k = tl.load(K + cols[None, :] * sk_n + d[:, None] * sk_d, mask=k_ok, other=0.0)  # [BLOCK_D, BLOCK_N]
            v = tl.load(V + cols[:, None] * sv_n + d[None, :] * sv_d, mask=v_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
            s = _dot(q, k, IEEE, DOT_F32)  # raw scores [BLOCK_M, BLOCK_N]
            if MASKED:
                visible = col_ok[None, :]
                if CAUSAL:
                    visible = visible & (cols[None, :] <= q_pos[:, None])
                s = tl.where(visible, s, float("-inf"))
            m, l, acc = _softmax_step(m, l, acc, s, v, scale_log2, MASKED, IEEE, DOT_F32)
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
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, DOT_F32)
        return m_new, l, acc

    @triton.jit
    def _attend_tma(m, l, acc, q, KD, VD, h, lo, hi, scale_log2, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_F32: tl.constexpr):
        """``_attend`` over full tiles ``[lo, hi)`` of head ``h`` (unmasked: ``hi - lo`` is a multiple of
        ``BLOCK_N``) with K/V tiles from TMA descriptors over ``[H_kv, P, D]``."""
        for n0 in tl.range(lo, hi, BLOCK_N):
            k = KD.load([h, n0, 0]).reshape(BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
            v = VD.load([h, n0, 0]).reshape(BLOCK_N, BLOCK_D)
            s = _dot(q, k.T, False, DOT_F32)  # raw scores [BLOCK_M, BLOCK_N]
            m, l, acc = _softmax_step(m, l, acc, s, v, scale_log2, False, False, DOT_F32)
        return m, l, acc

    @triton.jit
    def _store_out(O, so_b, so_h, so_l, so_d, n, n_ok, h, G, L_q, d, d_ok, out):
        """Rows ``n = (b * G + g) * L_q + i`` of KV head ``h`` into ``O [B, H_q, L_q, D]`` in its dtype."""
        b, g, i = n // (G * L_q), (n // L_q) % G, n % L_q
        tl.store(O + b[:, None] * so_b + (h * G + g)[:, None] * so_h + i[:, None] * so_l + d[None, :] * so_d,
                 out.to(O.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _store_partial(PO, PLSE, slot, h, H_kv, N, n, n_ok, m, l, acc, d, d_ok, D):
        """Normalised partial (in ``PO``'s dtype) and natural-log fp32 LSE of rows ``n`` into ``slot``; an empty part
        gets (0, -inf)."""
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        lse = tl.where(l == 0.0, float("-inf"), (m + tl.log2(l)) * 0.6931471805599453)
        base = (slot * H_kv + h) * N + n
        tl.store(PO + base[:, None] * D + d[None, :], out.to(PO.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])
        tl.store(PLSE + base, lse, mask=n_ok)

    @triton.jit
    def _prefix_unit(Q, PK, PV, KD, VD, PO, PLSE, u, h, H_kv, sq_b, sq_h, sq_l, sq_d, spk_h, spk_p, spk_d,
                     spv_h, spv_p, spv_d, N, P, L_q, G, D, scale_log2, prefix_blocks, prefix_per,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     IEEE: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr):
        """Rows n = (b * G + g) * L_q + i of the whole batch against one split of the shared prefix -> slot split."""
        rb, split = u % prefix_blocks, u // prefix_blocks
        n = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = n < N
        b, g, i = n // (G * L_q), (n // L_q) % G, n % L_q
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(Q + b[:, None] * sq_b + (h * G + g)[:, None] * sq_h + i[:, None] * sq_l + d[None, :] * sq_d,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        lo = split * prefix_per * BLOCK_N
        hi = tl.minimum(lo + prefix_per * BLOCK_N, P)
        full = lo + (hi - lo) // BLOCK_N * BLOCK_N  # splits start on tile boundaries: only P's last tile is partial
        m, l, acc = _empty(BLOCK_M, BLOCK_D)
        PKh, PVh = PK + h * spk_h, PV + h * spv_h
        if TMA:
            m, l, acc = _attend_tma(m, l, acc, q, KD, VD, h, lo, full, scale_log2, BLOCK_N, BLOCK_D, DOT_F32)
        else:
            m, l, acc = _attend(m, l, acc, q, PKh, PVh, spk_p, spk_d, spv_p, spv_d, lo, full, 0, i, d, d_ok,
                                scale_log2, BLOCK_N, False, False, IEEE, DOT_F32)
        m, l, acc = _attend(m, l, acc, q, PKh, PVh, spk_p, spk_d, spv_p, spv_d, full, hi, 0, i, d, d_ok, scale_log2,
                            BLOCK_N, True, False, IEEE, DOT_F32)
        _store_partial(PO, PLSE, split, h, H_kv, N, n, n_ok, m, l, acc, d, d_ok, D)

    @triton.jit
    def _merge_slots(PO, PLSE, m, l, acc, h, H_kv, N, n, n_ok, d, d_ok, D, slots, BLOCK_S: tl.constexpr):
        """Fold the partials of rows ``n`` in slots ``0 .. slots-1`` (normalised, natural-log LSE) into the running
        ``(m, l, acc)`` and return the normalised output. All slots load as one ``[rows, BLOCK_S, D]`` tile (one round
        trip, not a chain of loads) and sum by a fixed tree, so the result is deterministic."""
        s = tl.arange(0, BLOCK_S)
        ok = n_ok[:, None] & (s < slots)[None, :]
        base = (s[None, :] * H_kv + h) * N + n[:, None]
        x = tl.load(PLSE + base, mask=ok, other=float("-inf")) * 1.4426950408889634
        o = tl.load(PO + base[:, :, None] * D + d[None, None, :], mask=ok[:, :, None] & d_ok[None, None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_S, BLOCK_D]
        m_new = tl.maximum(m, tl.max(x, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(x - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        return acc / tl.where(l == 0.0, 1.0, l)[:, None]

    @triton.jit
    def _suffix_state(Q, SK, SV, LENS, END, b, h, qh, i, r_ok, d, d_ok, sq_b, sq_h, sq_l, sq_d,
                      ssk_b, ssk_h, ssk_s, ssk_d, ssv_b, ssv_h, ssv_s, ssv_d, L_q, L_s, scale_log2, split, suffix_per,
                      HAS_LENS: tl.constexpr, HAS_END: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
        """The running ``(m, l, acc)`` of row b's queries (query heads ``qh``, positions ``i``) over one split of its
        own left-padded suffix in KV head ``h``."""
        q = tl.load(Q + b * sq_b + qh[:, None] * sq_h + i[:, None] * sq_l + d[None, :] * sq_d,
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        end = L_s
        if HAS_END:  # a static buffer: only the first `end` positions are filled
            end = tl.load(END).to(tl.int32)
        first = 0
        if HAS_LENS:  # left padding ends here
            first = tl.maximum(end - tl.load(LENS + b).to(tl.int32), 0)
        lo = split * suffix_per * BLOCK_N
        hi = tl.minimum(lo + suffix_per * BLOCK_N, end)
        lo = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)  # skip whole tiles of padding
        m, l, acc = _empty(BLOCK_M, BLOCK_D)
        return _attend(m, l, acc, q, SK + b * ssk_b + h * ssk_h, SV + b * ssv_b + h * ssv_h, ssk_s, ssk_d,
                       ssv_s, ssv_d, lo, hi, first, end - L_q + i, d, d_ok, scale_log2,
                       BLOCK_N, True, True, IEEE, DOT_F32)

    @triton.jit
    def _suffix_unit(Q, SK, SV, LENS, END, PO, PLSE, O, w, h, H_kv, sq_b, sq_h, sq_l, sq_d,
                     ssk_b, ssk_h, ssk_s, ssk_d, ssv_b, ssv_h, ssv_s, ssv_d, so_b, so_h, so_l, so_d,
                     N, L_q, L_s, G, D, scale_log2, prefix_splits, suffix_blocks, suffix_splits, suffix_per,
                     HAS_LENS: tl.constexpr, HAS_END: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr, FUSE: tl.constexpr,
                     PDL: tl.constexpr, PAIR: tl.constexpr = False):
        """Row b's queries r = g * L_q + i against one split of its own suffix -> slot prefix_splits + split. ``FUSE``
        > 0 (one suffix split, prefix partials written by an earlier launch, ``FUSE >= prefix_splits`` a power of
        two): merge with them and write ``O`` instead. ``PAIR`` (with ``FUSE``, one suffix block and split): unit
        ``w`` is rows ``2w`` and ``2w + 1``, both streamed before the wait (see ``SUFFIX_PAIR_ABOVE``)."""
        rb, split, b = w % suffix_blocks, (w // suffix_blocks) % suffix_splits, w // (suffix_blocks * suffix_splits)
        if PAIR:
            b = 2 * w
        r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        r_ok = r < G * L_q
        qh, i = h * G + r // L_q, r % L_q
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        m, l, acc = _suffix_state(Q, SK, SV, LENS, END, b, h, qh, i, r_ok, d, d_ok, sq_b, sq_h, sq_l, sq_d, ssk_b,
                                  ssk_h, ssk_s, ssk_d, ssv_b, ssv_h, ssv_s, ssv_d, L_q, L_s, scale_log2, split,
                                  suffix_per, HAS_LENS, HAS_END, BLOCK_M, BLOCK_N, BLOCK_D, IEEE, DOT_F32)
        n = b * G * L_q + r
        if PAIR:  # an odd batch's last pair streams row B-1 twice and stores it once
            rows = N // (G * L_q)  # batch rows B
            b1 = tl.minimum(b + 1, rows - 1)
            ok1 = r_ok & (r * 0 + b + 1 < rows)  # a full tensor: the interpreter ands a 0-d bool as int
            m1, l1, acc1 = _suffix_state(Q, SK, SV, LENS, END, b1, h, qh, i, r_ok, d, d_ok, sq_b, sq_h, sq_l, sq_d,
                                         ssk_b, ssk_h, ssk_s, ssk_d, ssv_b, ssv_h, ssv_s, ssv_d, L_q, L_s, scale_log2,
                                         split, suffix_per, HAS_LENS, HAS_END, BLOCK_M, BLOCK_N, BLOCK_D, IEEE,
                                         DOT_F32)
        if FUSE:
            # PDL: this launch started before the prefix launch finished; every program waits for it here, which
            # also makes whatever follows this launch in the stream follow the prefix launch
            if PDL:
                tl.extra.cuda.gdc_wait()
            out = _merge_slots(PO, PLSE, m, l, acc, h, H_kv, N, n, r_ok, d, d_ok, D, prefix_splits, FUSE)
            _store_out(O, so_b, so_h, so_l, so_d, n, r_ok, h, G, L_q, d, d_ok, out)
            if PAIR:
                out = _merge_slots(PO, PLSE, m1, l1, acc1, h, H_kv, N, n + G * L_q, ok1, d, d_ok, D, prefix_splits,
                                   FUSE)
                _store_out(O, so_b, so_h, so_l, so_d, n + G * L_q, ok1, h, G, L_q, d, d_ok, out)
        else:
            _store_partial(PO, PLSE, prefix_splits + split, h, H_kv, N, n, r_ok, m, l, acc, d, d_ok, D)

    @triton.jit
    def _partials_kernel(Q, PK, PV, KD, VD, SK, SV, LENS, END, PO, PLSE, O,
                         sq_b, sq_h, sq_l, sq_d, spk_h, spk_p, spk_d, spv_h, spv_p, spv_d,
                         ssk_b, ssk_h, ssk_s, ssk_d, ssv_b, ssv_h, ssv_s, ssv_d, so_b, so_h, so_l, so_d,
                         N, P, L_q, L_s, G, D, scale_log2,
                         prefix_blocks, prefix_splits, prefix_per, suffix_blocks, suffix_splits, suffix_per,
                         HAS_LENS: tl.constexpr, HAS_END: tl.constexpr,
                         BLOCK_MP: tl.constexpr, BLOCK_MS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr, KIND: tl.constexpr,
                         FUSE: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr, PAIR: tl.constexpr = False):
        """``KIND`` 0: prefix and suffix units in one grid; 1: prefix units only; 2: suffix units only (a launch of
        one kind compiles only that kind, so its tiles, shared memory and registers are its own). ``FUSE`` (KIND 2
        after a KIND 1 launch, one suffix split): each suffix unit merges its rows and writes ``O``."""
        u, h = tl.program_id(0), tl.program_id(1)
        if PDL and KIND == 1:  # the suffix launch may start now; it waits for this one before reading its partials
            tl.extra.cuda.gdc_launch_dependents()
        H_kv = tl.num_programs(1)
        if KIND == 2:
            u += prefix_blocks * prefix_splits
        # prefix units first (they share tiles through L2), then suffix units; both kinds in one wave
        if KIND != 2 and (KIND == 1 or u < prefix_blocks * prefix_splits):
            _prefix_unit(Q, PK, PV, KD, VD, PO, PLSE, u, h, H_kv, sq_b, sq_h, sq_l, sq_d, spk_h, spk_p, spk_d,
                         spv_h, spv_p, spv_d, N, P, L_q, G, D, scale_log2, prefix_blocks, prefix_per,
                         BLOCK_MP, BLOCK_N, BLOCK_D, IEEE, DOT_F32, TMA)
        else:
            _suffix_unit(Q, SK, SV, LENS, END, PO, PLSE, O, u - prefix_blocks * prefix_splits, h, H_kv,
                         sq_b, sq_h, sq_l, sq_d, ssk_b, ssk_h, ssk_s, ssk_d, ssv_b, ssv_h, ssv_s, ssv_d,
                         so_b, so_h, so_l, so_d, N, L_q, L_s, G, D, scale_log2, prefix_splits, suffix_blocks,
                         suffix_splits, suffix_per, HAS_LENS, HAS_END, BLOCK_MS, BLOCK_N, BLOCK_D, IEEE, DOT_F32,
                         FUSE, PDL, PAIR)

    @triton.jit
    def _merge_kernel(PO, PLSE, O, so_b, so_h, so_l, so_d, N, L_q, G, D, slots,
                      BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        """Rows ``n`` of head ``h``: all ``slots`` partials at once (``_merge_slots`` from an empty state), written once
        in ``O``'s dtype; bitwise reproducible."""
        pid, h = tl.program_id(0), tl.program_id(1)
        n = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        n_ok, d_ok = n < N, d < D
        m, l, acc = _empty(BLOCK_R, BLOCK_D)
        out = _merge_slots(PO, PLSE, m, l, acc, h, tl.num_programs(1), N, n, n_ok, d, d_ok, D, slots, BLOCK_S)
        _store_out(O, so_b, so_h, so_l, so_d, n, n_ok, h, G, L_q, d, d_ok, out)


class _Plan(NamedTuple):
    """One call's launch layout: which units run where, with which tiles (see the module docstring)."""

    sep: bool  # separate prefix and suffix launches (else one launch for both kinds)
    prefix: tuple[int, int, int, int]  # (BLOCK_M rows, BLOCK_N keys, warps, stages) of the prefix units
    suffix: tuple[int, int, int, int]  # the same for the suffix units (one launch: the prefix's keys/warps/stages)
    p_blocks: int  # prefix row blocks (of the N = B*G*L_q rows)
    p_splits: int
    p_per: int  # prefix tiles per split
    s_blocks: int  # suffix row blocks (of one batch row's G*L_q rows)
    s_splits: int
    s_per: int
    fuse_slots: int  # > 0: the suffix launch merges the prefix slots in a tile this wide (power of two); 0: no
    pdl: bool  # the fused suffix launch starts while the prefix launch runs (PDL; a prefix, Hopper+)
    pair: bool  # each fused suffix program streams two batch rows (see SUFFIX_PAIR_ABOVE)
    rows: int  # batch rows B

    @property
    def fuse(self) -> bool:
        """The suffix launch merges the prefix slots and writes the output (no merge launch)."""
        return self.fuse_slots > 0

    @property
    def p_units(self) -> int:
        """Prefix programs per KV head."""
        return self.p_blocks * self.p_splits

    @property
    def s_units(self) -> int:
        """Suffix programs per KV head (a pair of batch rows each when ``pair``)."""
        return (triton.cdiv(self.rows, 2) if self.pair else self.rows) * self.s_blocks * self.s_splits


def _plan(B: int, N: int, G: int, L_q: int, P: int, L_s: int, H_kv: int, D: int, device: torch.device) -> _Plan:
    block_d, block_n, warps, stages = _tile(D)
    sep = SEPARATE_ROWS[0] <= N <= SEPARATE_ROWS[1]  # layout rule: see SEPARATE_ROWS
    if sep:
        bm, bn, w, st = PREFIX_TILES[min(max(block_d, 64), 256)]
        prefix, suffix = (_block_m(N, bm), bn, w, st), (_block_m(G * L_q), *_tile(D, SUFFIX_TILES)[1:])
    else:
        prefix, suffix = (_block_m(N), block_n, warps, stages), (_block_m(G * L_q), block_n, warps, stages)
    sms = _num_sms(device.index or 0)
    p_blocks, s_blocks = triton.cdiv(N, prefix[0]), triton.cdiv(G * L_q, suffix[0])
    # the separate layout's prefix launch holds prefix programs only: whole waves of them (see SEPARATE_SPLIT)
    p_splits, p_per = plan_splits(P, N, H_kv, prefix[0], prefix[1], sms, *(SEPARATE_SPLIT if sep else ()),
                                  whole_waves=sep)
    s_splits, s_per = plan_suffix_splits(L_s, B * s_blocks, H_kv, suffix[1], sms)
    slot_tile = triton.next_power_of_2(max(p_splits, 1))
    fuse = (sep and s_splits == 1 and p_splits <= FUSED_MERGE_SLOTS and suffix[0] * slot_tile <= FUSED_MERGE_TILE)
    pdl = PDL and fuse and P > 0 and device.type == "cuda" and _hopper(device.index or 0)
    plan = _Plan(sep, prefix, suffix, p_blocks, p_splits, p_per, s_blocks, s_splits, s_per,
                 slot_tile if fuse else 0, pdl, False, B)
    pair = (SUFFIX_PAIR_ABOVE is not None and fuse and s_blocks == 1 and plan.p_units * H_kv <= sms
            and P >= SUFFIX_PAIR_MIN_PREFIX and plan.s_units * H_kv > SUFFIX_PAIR_ABOVE * sms)
    return plan._replace(pair=pair)


def _prefix_descriptors(prefix_key: torch.Tensor, prefix_value: torch.Tensor, block_n: int, block_d: int):
    """TMA descriptors over ``[H_kv, P, D]`` for the prefix's full tiles, or ``(None, None)`` where TMA cannot run:
    off Hopper+ (the interpreter emulates it), dtypes other than fp16/bf16, a padded head dim, strides or a base
    that are not 16-byte aligned."""
    t = prefix_key
    ok = (PREFIX_TMA and TensorDescriptor is not None and t.dtype in (torch.float16, torch.bfloat16)
          and t.shape[-1] == block_d and t.shape[2] > 0
          and (_interpreting() or (t.is_cuda and _hopper(t.device.index or 0))))
    for x in (prefix_key, prefix_value):
        ok = ok and x.stride(3) == 1 and all(x.stride(i) * x.element_size() % 16 == 0 for i in (1, 2)) \
            and x.data_ptr() % 16 == 0
    if not ok:
        return None, None
    return tuple(TensorDescriptor(x[0], list(x.shape[1:]), list(x.stride()[1:]), [1, block_n, block_d])
                 for x in (prefix_key, prefix_value))


def relay_attention_triton(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                           suffix_key: torch.Tensor, suffix_value: torch.Tensor, *, scale: float | None = None,
                           suffix_lengths: torch.Tensor | None = None, suffix_end: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton relay attention; contract of ``relay_hf.relay_attention``.

    ``out`` (optional) is a ``[B, H_q, L_q, D]`` tensor to write into; by default it is allocated as the transpose
    of a contiguous ``[B, L_q, H_q, D]`` buffer, so the HF seam's ``transpose(1, 2).contiguous()`` is free.
    Scratch: partials ``[slots, H_kv, B*G*L_q, D]`` (the input dtype for fp16/bf16 with ``PARTIAL_HALF``, else fp32)
    and fp32 natural-log LSEs ``[slots, H_kv, B*G*L_q]``.
    """
    check_relay_inputs(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end)
    B, H_q, L_q, D = query.shape
    H_kv, L_s, P = suffix_key.shape[1], suffix_key.shape[2], prefix_key.shape[2]
    G, N = H_q // H_kv, B * (H_q // H_kv) * L_q
    scale = D ** -0.5 if scale is None else scale
    if not scale > 0:  # the kernels fold the scale into exp2 after the row max, which needs scale > 0
        raise ValueError(f"the Triton relay kernel needs scale > 0, got {scale}; use relay_attention_torch")
    if out is None:
        out = torch.empty(B, L_q, H_q, D, dtype=query.dtype, device=query.device).transpose(1, 2)
    plan = _plan(B, N, G, L_q, P, L_s, H_kv, D, query.device)
    (block_mp, block_n, warps, stages), (block_ms, block_ns, warps_s, stages_s) = plan.prefix, plan.suffix
    block_d = _tile(D)[0]
    slots = plan.p_splits + (0 if plan.fuse else plan.s_splits)
    half = PARTIAL_HALF and query.dtype in (torch.float16, torch.bfloat16)
    po = torch.empty(max(slots, 1), H_kv, N, D, dtype=query.dtype if half else torch.float32, device=query.device)
    plse = torch.empty(max(slots, 1), H_kv, N, dtype=torch.float32, device=query.device)
    lens = suffix_lengths if suffix_lengths is not None else plse  # placeholders, never read when absent
    end = suffix_end if suffix_end is not None else plse
    kd, vd = _prefix_descriptors(prefix_key, prefix_value, block_n, block_d)
    args = (query, prefix_key, prefix_value, kd, vd, suffix_key, suffix_value, lens, end, po, plse, out,
            *query.stride(), *prefix_key.stride()[1:], *prefix_value.stride()[1:],
            *suffix_key.stride(), *suffix_value.stride(), *out.stride(), N, P, L_q, L_s, G, D, scale * LOG2E,
            plan.p_blocks, plan.p_splits, plan.p_per, plan.s_blocks, plan.s_splits, plan.s_per)
    # the CPU interpreter's tl.dot cannot multiply bf16 (numpy has no bf16): upcast there, only there
    flags = dict(HAS_LENS=suffix_lengths is not None, HAS_END=suffix_end is not None, BLOCK_MP=block_mp,
                 BLOCK_MS=block_ms, BLOCK_D=block_d, IEEE=query.dtype == torch.float32, TMA=kd is not None,
                 PDL=plan.pdl, DOT_F32=query.dtype == torch.bfloat16 and _interpreting())
    if not plan.sep:
        _partials_kernel[(plan.p_units + plan.s_units, H_kv)](*args, **flags, BLOCK_N=block_n, KIND=0, FUSE=0,
                                                              num_warps=warps, num_stages=stages)
    else:
        if plan.p_units:
            _partials_kernel[(plan.p_units, H_kv)](*args, **flags, BLOCK_N=block_n, KIND=1, FUSE=0,
                                                   num_warps=warps, num_stages=stages)
        _partials_kernel[(plan.s_units, H_kv)](*args, **flags, BLOCK_N=block_ns, KIND=2, FUSE=plan.fuse_slots,
                                               num_warps=warps_s, num_stages=stages_s, launch_pdl=plan.pdl,
                                               PAIR=plan.pair)
    if plan.fuse:
        return out
    tile, merge_warps = MERGE_TILE
    block_s = triton.next_power_of_2(slots)
    rows = max(1, tile // block_s)
    _merge_kernel[(triton.cdiv(N, rows), H_kv)](po, plse, out, *out.stride(), N, L_q, G, D, slots,
                                                BLOCK_R=rows, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=merge_warps)
    return out


def bytes_moved(B: int, H_q: int, H_kv: int, L_q: int, P: int, L_s: int, D: int, itemsize: int) -> int:
    """Fewest bytes relay attention must move: prefix K/V once, every suffix K/V, the queries and the output."""
    return itemsize * (2 * H_kv * P * D + 2 * B * H_kv * L_s * D + 2 * B * H_q * L_q * D)


__all__ = ["relay_attention_triton", "triton_available", "plan_splits", "plan_suffix_splits", "bytes_moved"]
