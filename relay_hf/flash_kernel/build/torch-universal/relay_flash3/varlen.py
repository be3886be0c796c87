"""Packed variable-length attention with flash-attention 2 semantics: ``flash_attn_varlen_func``, which
transformers' continuous batching calls for prefill and mixed steps.

Tensors (``[...]`` shapes):

* ``q [T_q, H_q, D]`` queries of all sequences, packed; ``k``/``v [T_k, H_kv, D]`` their keys and values, packed;
  fp16, bf16 or fp32, one dtype for all three. ``H_q`` is a multiple of ``H_kv`` (GQA): query head ``h`` reads KV
  head ``h // (H_q // H_kv)``. Any ``D`` (it is padded to a power of two inside the kernel and masked).
* ``cu_seqlens_q``/``cu_seqlens_k [n + 1]`` int32 (or int64) cumulative lengths: sequence ``i``'s queries are
  ``q[cu_q[i]:cu_q[i + 1]]`` and its keys ``k[cu_k[i]:cu_k[i + 1]]``. A sequence may be empty (padding sequences at
  the end make ``cu`` plateau); query tokens past ``cu_q[-1]`` are padding and get zero output rows.
* ``s_aux [H_q]`` (optional, any float dtype): one attention-sink logit per query head, natural-log units, not
  scaled; it joins the softmax denominator but carries no value.
* output ``[T_q, H_q, D]`` in ``q``'s dtype. A query row that sees no key is zero.

``causal`` is bottom-right aligned as in flash-attention 2: query ``j`` of a sequence with ``Lq`` queries and ``Lk``
keys sees keys ``<= j + Lk - Lq`` (chunked prefill: the queries are the last ``Lq`` of ``Lk`` tokens). ``softcap
> 0`` caps the scaled score as flash-attention does: ``softcap * tanh(softmax_scale * q.k / softcap)``.

Two implementations with the same semantics: a Triton flash-attention forward (CUDA, or the CPU interpreter with
``TRITON_INTERPRET=1``) and a PyTorch loop over sequences (CPU otherwise). The Triton path never synchronises
with the host (its grid follows from the tensors' shapes), so a call can be captured in a CUDA graph. Inside the
kernel scores are in the log2 domain (``exp2``); no LSE leaves this module (``return_attn_probs`` is refused), and
every logit that enters it (``s_aux``) is natural-log.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency; without it the kernel is a plain function
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn if fn is not None else (lambda f: f))
    tl = SimpleNamespace(constexpr=lambda value: value)

# Tiles (BLOCK_M query rows, BLOCK_N keys, num_warps, num_stages) by padded head size BLOCK_D (16, 32 -> the 64 row,
# above 256 -> the 256 row). A tile's rows are tokens x the GQA group's heads. 16-bit head size 128: 64-row tiles
# at 4 warps were the fastest of seven configs on an H100 in all five of continuous batching's prefill shapes and
# plain prefills timed (3-10% ahead of 128 rows at 8 warps); fp32 inputs carry twice the bytes per K/V tile, so
# smaller tiles and fewer stages keep the pipelined tiles within shared memory.
TILES_16BIT = {64: (128, 64, 4, 3), 128: (64, 64, 4, 3), 256: (64, 32, 4, 2)}
TILES_FP32 = {64: (64, 32, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 1)}
TILES_INTERPRET = (16, 16, 1, 1)  # the CPU interpreter: small tiles, so short test sequences still span several
# a program finds its tile in a prefix sum over this many sequences at a time (a power of two: a tl.arange): one
# value for every call (a constexpr that followed the step's sequence count compiled the kernel again whenever a new
# count came)
SEQUENCES_PER_PASS = 256

LOG2E = 1.0 / math.log(2.0)  # exp(x) = exp2(x * LOG2E)
_LOG2E = tl.constexpr(LOG2E)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _cap(s, softcap, cap_scale):
    """``softcap * tanh(cap_scale * s)``, tanh through ``exp2`` so that +-inf give +-softcap (no libdevice call)."""
    e = tl.exp2(s * (cap_scale * 2.0 * _LOG2E))  # exp(2x)
    return softcap * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``IEEE`` (fp32 inputs): full-precision products, not the default tf32
    (~1e-3 relative). ``DOT_F32``: bf16 operands widened first (the CPU interpreter's bf16 dot is wrong)."""
    if DOT_F32:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend(m_i, l_i, acc, q, Kh, Vh, k_sn, k_sd, v_sn, v_sd, lo, hi, q_pos, d, d_ok, scale_log2, softcap, cap_scale,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
            IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """Continue the running max ``m_i`` (log2 domain), denominator ``l_i`` and unnormalised ``acc`` of the queries
    ``q [BLOCK_M, BLOCK_D]`` over keys ``[lo, hi)`` of one KV head (``Kh``/``Vh`` at its first key of the sequence).
    Unmasked calls cover whole tiles every query row sees, where per-score masking would be pure overhead;
    ``MASKED`` ones hide keys ``>= hi`` and, with ``CAUSAL``, keys after ``q_pos`` of each row."""
    for n0 in tl.range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k_ok, v_ok = d_ok[:, None], d_ok[None, :]
        if MASKED:
            k_ok, v_ok = k_ok & (cols < hi)[None, :], v_ok & (cols < hi)[:, None]
        k = tl.load(Kh + cols[None, :] * k_sn + d[:, None] * k_sd, mask=k_ok, other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(Vh + cols[:, None] * v_sn + d[None, :] * v_sd, mask=v_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = _dot(q, k, IEEE=IEEE, DOT_F32=DOT_F32)  # raw scores [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = _cap(s, softcap, cap_scale)
        if MASKED:
            visible = (cols < hi)[None, :]
            if CAUSAL:
                visible = visible & (cols[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet: no exp2(-inf - -inf)
        p = tl.exp2(s * scale_log2 - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE=IEEE, DOT_F32=DOT_F32)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _tile_of(CU_Q, t, n, TOKENS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Which sequence holds tile ``t`` of the step, and the tile's index within it: sequence ``i`` has
    ``cdiv(Lq_i, TOKENS)`` tiles, numbered after those of the sequences before it. ``(-1, 0)`` past the last tile.
    A prefix sum over ``cu_seqlens_q``, ``BLOCK_S`` sequences at a time (one pass for up to ``BLOCK_S``)."""
    seq = t * 0 - 1
    first = t * 0  # the tile number of the sequence's first tile
    before = t * 0  # tiles of the sequences before this chunk
    for c0 in range(0, n, BLOCK_S):
        s = c0 + tl.arange(0, BLOCK_S)
        live = s < n
        lo = tl.load(CU_Q + s, mask=live, other=0).to(tl.int32)  # int64 cu_seqlens too: the loop's sums stay int32
        hi = tl.load(CU_Q + s + 1, mask=live, other=0).to(tl.int32)
        tiles = tl.where(live, (hi - lo + TOKENS - 1) // TOKENS, 0)
        ends = before + tl.cumsum(tiles, 0)  # [BLOCK_S] the tile number after each sequence's last
        hit = (ends - tiles <= t) & (t < ends)
        seq = tl.maximum(seq, tl.max(tl.where(hit, s, -1), 0))
        first += tl.sum(tl.where(hit, ends - tiles, 0), 0)
        before += tl.sum(tiles, 0)
    return seq, t - first


# the sequence count changes from step to step: unspecialised, so a new count never compiles the kernel again
@triton.jit(do_not_specialize=["n"])
def _varlen_kernel(Q, K, V, O,  # noqa: E741  (O: the output pointer, beside Q, K, V)
                   CU_Q, CU_K, SINKS, q_s0, q_s1, q_s2, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, o_s0, o_s1, o_s2, n,
                   n_hg, G, D, scale_log2, softcap, cap_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PACK: tl.constexpr, CAUSAL: tl.constexpr,
                   SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """One program: ``BLOCK_M // PACK`` query tokens of one sequence times ``PACK`` query heads of one KV head
    (``PACK`` is the GQA group, or 1), folded into ``BLOCK_M`` rows, so a K/V tile is loaded once for the group's
    heads. Program id ``hg + n_hg * t``: tile ``t`` of the step's tiles (``_tile_of``), its head groups side by side,
    then the next tile of the sequence, so programs that read the same keys run together. The grid is sized by the
    step's query tokens, never by ``max_seqlen_q`` (which continuous batching pads to the whole step when it
    captures it: a grid of sequences x ``max_seqlen_q`` tiles was ~97% programs that exit at once); programs past
    the last tile exit at once. No host sync."""
    TOKENS: tl.constexpr = BLOCK_M // PACK
    pid = tl.program_id(0)
    hg = pid % n_hg
    seq, mb = _tile_of(CU_Q, pid // n_hg, n, TOKENS=TOKENS, BLOCK_S=BLOCK_S)
    if seq < 0:
        return
    q0 = tl.load(CU_Q + seq).to(tl.int64)
    lq = (tl.load(CU_Q + seq + 1) - q0).to(tl.int32)
    k0 = tl.load(CU_K + seq).to(tl.int64)
    lk = (tl.load(CU_K + seq + 1) - k0).to(tl.int32)
    r = tl.arange(0, BLOCK_M)
    tok = mb * TOKENS + r // PACK  # [BLOCK_M] the row's token within the sequence
    heads = hg * PACK + r % PACK  # [BLOCK_M] its query head
    row_ok = (r < TOKENS * PACK) & (tok < lq)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + (q0 + tok)[:, None] * q_s0 + heads[:, None] * q_s1 + d[None, :] * q_s2,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kvh = hg * PACK // G
    Kh, Vh = K + k0 * k_s0 + kvh * k_s1, V + k0 * v_s0 + kvh * v_s1
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_SINK:  # the sink starts the running softmax: a logit seen first, with value 0
        m_i = tl.load(SINKS + heads, mask=row_ok, other=0.0).to(tl.float32) * _LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    q_pos = tok + (lk - lq)  # bottom-right causal: the last key each query sees
    if CAUSAL:
        last_tok = tl.minimum(mb * TOKENS + TOKENS, lq) - 1
        hi = tl.maximum(tl.minimum(lk, last_tok + (lk - lq) + 1), 0)  # no row of the tile sees a key past hi
        every = tl.maximum(tl.minimum(lk, mb * TOKENS + (lk - lq) + 1), 0)  # every row sees the keys before this
    else:
        hi = lk
        every = lk
    full = every // BLOCK_N * BLOCK_N  # whole tiles every row sees run unmasked; the rest (the diagonal) masked
    m_i, l_i, acc = _attend(m_i, l_i, acc, q, Kh, Vh, k_s0, k_s2, v_s0, v_s2, 0, full, q_pos, d, d_ok, scale_log2,
                            softcap, cap_scale, BLOCK_N=BLOCK_N, MASKED=False, CAUSAL=CAUSAL, SOFTCAP=SOFTCAP,
                            IEEE=IEEE, DOT_F32=DOT_F32)
    m_i, l_i, acc = _attend(m_i, l_i, acc, q, Kh, Vh, k_s0, k_s2, v_s0, v_s2, full, hi, q_pos, d, d_ok, scale_log2,
                            softcap, cap_scale, BLOCK_N=BLOCK_N, MASKED=True, CAUSAL=CAUSAL, SOFTCAP=SOFTCAP,
                            IEEE=IEEE, DOT_F32=DOT_F32)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that saw no key (and no sink) has acc = 0
    tl.store(O + (q0 + tok)[:, None] * o_s0 + heads[:, None] * o_s1 + d[None, :] * o_s2, out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _tiles(block_d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return TILES_INTERPRET
    table = TILES_FP32 if dtype == torch.float32 else TILES_16BIT
    return table[min(max(block_d, 64), 256)]


def _triton_forward(q, k, v, cu_q, cu_k, max_seqlen_q, scale, causal, softcap, s_aux, tiles):
    """Launch ``_varlen_kernel`` (no host sync: the grid follows from the shapes alone; ``max_seqlen_q`` is not
    needed, every program finds its tile from ``cu_q`` on the device)."""
    if q.dtype not in _TRITON_DTYPES:
        raise ValueError(f"the Triton path takes fp16, bf16 or fp32 inputs, not {q.dtype}")
    n, (_, h_q, dim), h_kv = cu_q.numel() - 1, q.shape, k.shape[1]
    out = torch.zeros_like(q)  # padding rows (past cu_q[-1]) belong to no program and must read as finite zeros
    if n <= 0 or q.shape[0] == 0:
        return out
    block_d = max(16, triton.next_power_of_2(dim))  # tl.dot needs >= 16 along the reduced axis
    block_m, block_n, num_warps, num_stages = tiles or _tiles(block_d, q.dtype)
    group = h_q // h_kv
    pack = group if group <= block_m else 1  # a GQA group wider than the tile: one head per program
    tokens = block_m // pack
    tiles_bound = q.shape[0] // tokens + n  # >= the sum of cdiv(Lq_i, tokens) over the sequences
    n_hg = h_q // pack  # head groups: programs per tile
    scale_log2 = LOG2E if softcap > 0 else scale * LOG2E  # with a cap the scale goes in before tanh, log2e after
    _varlen_kernel[(n_hg * tiles_bound,)](
        q, k, v, out, cu_q, cu_k, q if s_aux is None else s_aux.contiguous(), *q.stride(), *k.stride(), *v.stride(),
        *out.stride(), n, n_hg, group, dim, scale_log2, float(softcap),
        scale / softcap if softcap > 0 else scale, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_S=SEQUENCES_PER_PASS, PACK=pack, CAUSAL=bool(causal), SOFTCAP=softcap > 0, HAS_SINK=s_aux is not None,
        IEEE=q.dtype == torch.float32, DOT_F32=q.dtype == torch.bfloat16 and not q.is_cuda, num_warps=num_warps,
        num_stages=num_stages)
    return out


def _torch_forward(q, k, v, cu_q, cu_k, scale, causal, softcap, s_aux):
    """The same attention, one sequence at a time (host sync), in fp32 (fp64 for fp64 inputs)."""
    ctype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=ctype, device=q.device)
    group = q.shape[1] // k.shape[1]
    bounds = zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True)
    for qa, qb, ka, kb in bounds:
        lq, lk = qb - qa, kb - ka
        if lq <= 0:
            continue
        qs = q[qa:qb].to(ctype).transpose(0, 1)  # [H_q, Lq, D]
        ks, vs = (x[ka:kb].to(ctype).repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
        s = qs @ ks.transpose(1, 2) * scale  # [H_q, Lq, Lk]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if causal:
            visible = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + lk - lq
            s = s.masked_fill(~visible, float("-inf"))
        # one more column: the sink logit (or -inf); it keeps the max defined when a row sees no key
        extra = torch.full((q.shape[1], lq, 1), float("-inf"), dtype=ctype, device=q.device)
        if s_aux is not None:
            extra = extra.copy_(s_aux.to(ctype)[:, None, None].expand_as(extra))
        s = torch.cat([s, extra], dim=-1)
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(m == float("-inf"), 0.0, m))
        den = p.sum(dim=-1, keepdim=True)
        out[qa:qb] = ((p[..., :-1] @ vs) / torch.where(den == 0.0, 1.0, den)).transpose(0, 1)
    return out.to(q.dtype)


def triton_serves(q: torch.Tensor) -> bool:
    """The Triton kernel runs for ``q``: fp16, bf16 or fp32 on CUDA, or anywhere under ``TRITON_INTERPRET=1``."""
    return (hasattr(triton, "cdiv") and q.dtype in _TRITON_DTYPES
            and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, *, softmax_scale=None, causal=False,
                     softcap=0.0, s_aux=None, use_triton: bool | None = None, tiles=None):
    """Packed variable-length attention (shapes and semantics in the module docstring). ``use_triton``: ``None``
    picks the Triton kernel for fp16/bf16/fp32 inputs on CUDA or under ``TRITON_INTERPRET=1``, else the PyTorch
    loop; ``True``/``False`` force one. ``tiles``: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` overriding the
    tables at the top of this file (Triton path only)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"expected q [T_q, H_q, D] and k, v [T_k, H_kv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"H_q={q.shape[1]} is not a multiple of H_kv={k.shape[1]}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (n + 1)")
    scale = float(q.shape[2] ** -0.5 if softmax_scale is None else softmax_scale)
    softcap = float(softcap or 0.0)
    if use_triton if use_triton is not None else triton_serves(q):
        # Triton launches on the current device: make it q's (as flash-attn's own device guard does)
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            return _triton_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, causal, softcap, s_aux,
                                   tiles)
    return _torch_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, softcap, s_aux)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, s_aux=None, **kwargs):
    """flash-attention 2's ``flash_attn_varlen_func`` (without dropout, sliding windows, ALiBi, a paged KV cache or
    attention probabilities: each raises ``ValueError``). ``max_seqlen_k`` is not needed (the kernel reads each
    sequence's key count on the device); ``deterministic`` holds anyway (no atomics); other kwargs are ignored."""
    unsupported = {
        "window_size (sliding-window attention)": window_size is not None and tuple(window_size) != (-1, -1),
        "dropout_p (attention dropout)": bool(dropout_p),
        "alibi_slopes (ALiBi)": alibi_slopes is not None,
        "block_table (a paged KV cache; use flash_attn_with_kvcache)": block_table is not None,
        "return_attn_probs (attention probabilities)": bool(return_attn_probs),
    }
    for option, used in unsupported.items():
        if used:
            raise ValueError(f"relay-flash3 flash_attn_varlen_func does not support {option}")
    return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale=softmax_scale,
                            causal=causal, softcap=softcap, s_aux=s_aux)
