"""Triton relay attention: the prefix read once per batch (split-KV), the suffix with a fused LSE merge.

Two launches per call:

1. ``_prefix_kernel`` — grid ``(row_blocks, H_kv, splits)``. For one KV head, the queries of the WHOLE batch
   (batch, GQA group and query position folded into ``N = B*G*L_q`` rows) stream one contiguous split of the prefix
   tile by tile with ``tl.dot``. Row blocks vary fastest, so programs that share a prefix tile run together and the
   tile comes from HBM once (L2 serves the rest). Splitting the prefix fills the GPU even at small ``B``
   (flash-decoding). Writes normalised partial outputs and natural-log LSE, both fp32.
2. ``_suffix_merge_kernel`` — grid ``(row_blocks, H_kv, B)``. Each row's ``G*L_q`` queries against its own
   left-padded suffix (causal, GQA without expanding K/V), then the prefix partials of those rows are folded in by
   LSE and the final output is written once, in the input dtype.

Tensor contract (see ``relay_hf.relay_attention``): ``query [B, H_q, L_q, D]``, ``prefix_* [1, H_kv, P, D]``,
``suffix_* [B, H_kv, L_s, D]``, ``suffix_lengths [B]`` int or None. Scores are in the log2 domain inside the kernels
(``exp2``); every LSE that leaves a kernel is natural-log fp32.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

from .reference import check_relay_inputs

LOG2E = 1.4426950408889634

# --- tile configs: (BLOCK_N keys per tile, num_warps, num_stages) by head dim, in one visible place ---------------
PREFIX_TILES = {64: (64, 4, 3), 128: (64, 4, 3), 256: (32, 8, 2)}
SUFFIX_TILES = {64: (64, 4, 2), 128: (64, 4, 2), 256: (32, 8, 2)}
MAX_BLOCK_M = 64  # query rows per program; small batches use the smallest tl.dot tile (16)
WIDE_M_WARPS = 8  # warps for programs of 128 query rows (a 128 x D fp32 accumulator)
SPLIT_WAVES = 2  # aim for this many programs per SM in the prefix pass
PARTIAL_BUDGET = 4  # keep fp32 partial traffic <= 1/PARTIAL_BUDGET of the prefix bytes
MAX_SPLITS = 32  # bounds the unrolled merge in the suffix kernel
UNROLL_MERGE = False  # True: fold prefix partials in an unrolled loop (measured slower at B <= 8, docs/performance.md)


def triton_available() -> bool:
    """Triton imports and can run here: a CUDA device, or the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def _tile(table: dict, head_dim: int):
    block_d = max(16, triton.next_power_of_2(head_dim))
    return (block_d, *table[min(max(block_d, 64), 256)])


@functools.cache
def _num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_m(rows: int) -> int:
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))


def plan_splits(P: int, N: int, H_kv: int, block_m: int, block_n: int, num_sms: int) -> tuple[int, int]:
    """``(splits, tiles_per_split)`` for the prefix pass: enough programs to fill the GPU, few enough that the fp32
    partials (``splits * N * D * 4`` bytes per head) stay small next to the prefix (``P * D * 4`` bytes per head)."""
    n_tiles = triton.cdiv(P, block_n)
    want = triton.cdiv(SPLIT_WAVES * num_sms, H_kv * triton.cdiv(N, block_m))
    cap = max(1, P // (PARTIAL_BUDGET * N))
    splits = max(1, min(n_tiles, want, cap, MAX_SPLITS))
    per = triton.cdiv(n_tiles, splits)
    return triton.cdiv(n_tiles, per), per


if triton is not None:

    @triton.jit
    def _online_update(m, l, acc, s, v, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
        """One flash-attention step in the log2 domain; fully masked rows (all -inf) stay at m=-inf, l=0, acc=0."""
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        if DOT_F32:
            v = v.to(tl.float32)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        return m_new, l, acc

    @triton.jit
    def _scores(q, k, scale_log2, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
        if DOT_F32:
            q, k = q.to(tl.float32), k.to(tl.float32)
        if IEEE:
            return tl.dot(q, k, input_precision="ieee") * scale_log2
        return tl.dot(q, k) * scale_log2

    @triton.jit
    def _fold_partial(m, l, acc, PLSE, PO, base, live, d, d_ok, D):
        """Fold one prefix partial (normalised out, natural-log LSE) into the running (m, l, acc) by LSE."""
        x = tl.load(PLSE + base, mask=live, other=float("-inf")) * 1.4426950408889634
        o_p = tl.load(PO + base[:, None] * D + d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp2(m - m_safe), tl.exp2(x - m_safe)
        return m_new, l * alpha + beta, acc * alpha[:, None] + o_p * beta[:, None]

    @triton.jit
    def _prefix_kernel(Q, K, V, PO, PLSE,
                       sq_b, sq_h, sq_l, sq_d, sk_h, sk_p, sk_d, sv_h, sv_p, sv_d,
                       N, P, L_q, scale_log2, tiles_per_split, G, D,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
        pid_m, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        # -- phase 1: this program's query rows, folded n = (b * G + g) * L_q + i over the whole batch
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        b, g, i = rows // (G * L_q), (rows // L_q) % G, rows % L_q
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(Q + b[:, None] * sq_b + (h * G + g)[:, None] * sq_h + i[:, None] * sq_l + d[None, :] * sq_d,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # -- phase 2: stream this split's prefix tiles (each tile loaded once for all rows of the block)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        start = split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, P)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < end
            k = tl.load(K + h * sk_h + cols[None, :] * sk_p + d[:, None] * sk_d,
                        mask=col_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            s = tl.where(col_ok[None, :], _scores(q, k, scale_log2, IEEE, DOT_F32), float("-inf"))
            v = tl.load(V + h * sv_h + cols[:, None] * sv_p + d[None, :] * sv_d,
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            m, l, acc = _online_update(m, l, acc, s, v, IEEE, DOT_F32)
        # -- phase 3: normalised partial + natural-log LSE, fp32
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        lse = tl.where(l == 0.0, float("-inf"), (m + tl.log2(l)) * 0.6931471805599453)
        base = (split * tl.num_programs(1) + h) * N + rows
        tl.store(PO + base[:, None] * D + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(PLSE + base, lse, mask=row_ok)

    @triton.jit
    def _suffix_merge_kernel(Q, K, V, LENS, PO, PLSE, O,
                             sq_b, sq_h, sq_l, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
                             so_b, so_h, so_l, so_d,
                             N, L_q, L_s, num_splits, scale_log2, G, D,
                             HAS_LENS: tl.constexpr, HAS_PREFIX: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             IEEE: tl.constexpr, DOT_F32: tl.constexpr, MERGE_UNROLL: tl.constexpr):
        pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        # -- phase 1: this row's queries, group folded in: r = g * L_q + i
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        r_ok = r < G * L_q
        g, i = r // L_q, r % L_q
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(Q + b * sq_b + (h * G + g)[:, None] * sq_h + i[:, None] * sq_l + d[None, :] * sq_d,
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = L_s - L_q + i  # each query's position inside the suffix
        first = 0
        if HAS_LENS:
            first = tl.maximum(L_s - tl.load(LENS + b).to(tl.int32), 0)  # left padding ends here
        # -- phase 2: the row's own suffix, causal, pads masked
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range((first // BLOCK_N) * BLOCK_N, L_s, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = (cols < L_s) & (cols >= first)
            k = tl.load(K + b * sk_b + h * sk_h + cols[None, :] * sk_s + d[:, None] * sk_d,
                        mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            visible = col_ok[None, :] & (cols[None, :] <= q_pos[:, None])
            s = tl.where(visible, _scores(q, k, scale_log2, IEEE, DOT_F32), float("-inf"))
            v = tl.load(V + b * sv_b + h * sv_h + cols[:, None] * sv_s + d[None, :] * sv_d,
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            m, l, acc = _online_update(m, l, acc, s, v, IEEE, DOT_F32)
        # -- phase 3: fold in the prefix partials by LSE (a partial with log2-LSE x counts as l=2^x, acc=o*2^x)
        if HAS_PREFIX:
            n = b * G * L_q + r
            if MERGE_UNROLL > 0:  # unrolled: every split's loads can be in flight at once
                for sp in tl.static_range(MERGE_UNROLL):
                    live = r_ok & ((r * 0 + sp) < num_splits)
                    base = (sp * tl.num_programs(1) + h) * N + n
                    m, l, acc = _fold_partial(m, l, acc, PLSE, PO, base, live, d, d_ok, D)
            else:
                for sp in range(num_splits):
                    base = (sp * tl.num_programs(1) + h) * N + n
                    m, l, acc = _fold_partial(m, l, acc, PLSE, PO, base, r_ok, d, d_ok, D)
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(O + b * so_b + (h * G + g)[:, None] * so_h + i[:, None] * so_l + d[None, :] * so_d,
                 out.to(O.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def relay_attention_triton(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                           suffix_key: torch.Tensor, suffix_value: torch.Tensor, *, scale: float | None = None,
                           suffix_lengths: torch.Tensor | None = None, out: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """Triton relay attention; contract of ``relay_hf.relay_attention``.

    ``out`` (optional) is a ``[B, H_q, L_q, D]`` tensor to write into; by default it is allocated as the transpose
    of a contiguous ``[B, L_q, H_q, D]`` buffer, so the HF seam's ``transpose(1, 2).contiguous()`` is free.
    """
    check_relay_inputs(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths)
    B, H_q, L_q, D = query.shape
    H_kv, L_s, P = suffix_key.shape[1], suffix_key.shape[2], prefix_key.shape[2]
    G = H_q // H_kv
    scale_log2 = (D ** -0.5 if scale is None else scale) * LOG2E
    ieee = query.dtype == torch.float32
    # the CPU interpreter's tl.dot cannot multiply bf16 (numpy has no bf16): upcast there, only there
    dot_f32 = query.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    if out is None:
        out = torch.empty(B, L_q, H_q, D, dtype=query.dtype, device=query.device).transpose(1, 2)
    N = B * G * L_q
    splits = 0
    po = plse = out  # placeholders, never read when there is no prefix
    if P > 0:
        block_d, block_n, warps, stages = _tile(PREFIX_TILES, D)
        block_m = _block_m(N)
        warps = max(warps, WIDE_M_WARPS) if block_m >= 128 else warps
        splits, per = plan_splits(P, N, H_kv, block_m, block_n, _num_sms(query.device.index or 0))
        po = torch.empty(splits, H_kv, N, D, dtype=torch.float32, device=query.device)
        plse = torch.empty(splits, H_kv, N, dtype=torch.float32, device=query.device)
        _prefix_kernel[(triton.cdiv(N, block_m), H_kv, splits)](
            query, prefix_key, prefix_value, po, plse,
            *query.stride(), *prefix_key.stride()[1:], *prefix_value.stride()[1:],
            N, P, L_q, scale_log2, per, G, D,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, IEEE=ieee, DOT_F32=dot_f32,
            num_warps=warps, num_stages=stages)
    block_d, block_n, warps, stages = _tile(SUFFIX_TILES, D)
    block_m = _block_m(G * L_q)
    lens = suffix_lengths if suffix_lengths is not None else out
    _suffix_merge_kernel[(triton.cdiv(G * L_q, block_m), H_kv, B)](
        query, suffix_key, suffix_value, lens, po, plse, out,
        *query.stride(), *suffix_key.stride(), *suffix_value.stride(), *out.stride(),
        N, L_q, L_s, splits, scale_log2, G, D,
        HAS_LENS=suffix_lengths is not None, HAS_PREFIX=P > 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, IEEE=ieee, DOT_F32=dot_f32,
        MERGE_UNROLL=triton.next_power_of_2(splits) if UNROLL_MERGE and splits else 0,
        num_warps=warps, num_stages=stages)
    return out


def bytes_moved(B: int, H_q: int, H_kv: int, L_q: int, P: int, L_s: int, D: int, itemsize: int) -> int:
    """Fewest bytes relay attention must move: prefix K/V once, every suffix K/V, the queries and the output."""
    return itemsize * (2 * H_kv * P * D + 2 * B * H_kv * L_s * D + 2 * B * H_q * L_q * D)


__all__ = ["relay_attention_triton", "triton_available", "plan_splits", "bytes_moved"]
