"""Triton relay attention: partials for the prefix (read once per batch, split-KV) and for each row's suffix (split
when the batch is small), merged by LSE. Two layouts, picked by the row count (``KernelConfig.separate_rows``): one
launch for all partials plus a tiny merge launch, or a prefix launch then a suffix launch that merges (see 3.).

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
   launch is a programmatic dependent launch (``pdl``): it starts while the prefix launch runs and waits only before
   the merge; where more of its programs would be queued than fit beside the prefix programs, each streams two batch
   rows (``suffix_pair_above``). The prefix's full K/V tiles load through TMA descriptors where possible
   (``prefix_tma``).

Every tunable lives in one frozen ``KernelConfig`` (``DEFAULT_CONFIG``), passed explicitly; the launch plan of a call
is a pure function of its shapes, dtypes, devices, prefix layout and config, built once and reused by every layer
that has the same key ("plan once, run per layer").

Tensor contract (see ``relay_hf.relay_attention``): ``query [B, H_q, L_q, D]``, ``prefix_* [1, H_kv, P, D]``,
``suffix_* [B, H_kv, L_s, D]``, ``suffix_lengths [B]`` int or None, ``suffix_end`` one-element int tensor or None.
Scores are in the log2 domain inside the kernels (``exp2``); every LSE that leaves a kernel is natural-log fp32.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Iterator, Mapping
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
try:
    from triton.compiler import CompiledKernel
except ImportError:  # pragma: no cover - no compiled kernels to reuse: every call goes through Triton's launcher
    CompiledKernel = None

from .groups import GroupTables, PrefixGroups
from .reference import check_prefix_groups, check_relay_inputs, check_relay_options, check_relay_values, default_scale

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * LOG2E): the kernels' scores are in the log2 domain
LN2 = math.log(2.0)  # log2 -> natural log: every LSE that leaves a kernel is natural-log
HEAD_DIM_CLASSES = (64, 128, 256)  # tile tables are keyed by the padded head dim, clamped to this range

TileTable = tuple[tuple[int, tuple[int, ...]], ...]


def _tile_table(value, width: int, name: str) -> TileTable:
    """A tile table as a sorted tuple of ``(head-dim class, row)`` pairs; a ``{class: row}`` mapping is accepted."""
    try:
        items = value.items() if isinstance(value, Mapping) else value
        table = tuple(sorted((int(k), tuple(int(x) for x in row)) for k, row in items))
    except (TypeError, ValueError):
        table = ()
    if tuple(k for k, _ in table) != HEAD_DIM_CLASSES or any(len(row) != width for _, row in table):
        raise ValueError(f"KernelConfig.{name} must map the head-dim classes {HEAD_DIM_CLASSES} to {width} ints each, "
                         f"got {value!r}")
    return table


# --- every tunable, in one visible place (measurements: docs/performance.md, kernel section) -----------------------
@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile tables, work split and launch layout of the Triton relay kernels: immutable and hashable, so a launch plan
    is cached per config. Never mutate a module to tune; build a variant and pass it::

        cfg = dataclasses.replace(DEFAULT_CONFIG, split_waves=2, partial_budget=4)
        relay_attention_triton(q, pk, pv, sk, sv, config=cfg)
        with use_config(cfg):  # calls made deeper down (a patched model, the custom op) without a config argument
            model.generate(...)

    Tile tables (``tiles``, ``suffix_tiles``, ``prefix_tiles``) map the padded head dim ``BLOCK_D`` (64, 128, 256;
    clamped into that range) to a row; a ``{64: row, 128: row, 256: row}`` dict is accepted and stored as a tuple of
    ``(head_dim, row)`` pairs.
    """

    # one-launch layout: head dim -> (BLOCK_N keys per tile, warps, stages)
    tiles: TileTable = ((64, (64, 4, 3)), (128, (64, 4, 3)), (256, (32, 8, 2)))
    # query rows per prefix program; small batches use the smallest tl.dot tile (16)
    max_block_m: int = 64
    # prefix units alone aim for this many programs per SM
    split_waves: int = 4
    # suffix units alone aim for this many programs per SM (the suffix is split when B*H_kv is small)
    suffix_waves: int = 1
    # prefix-partial traffic stays <= 1/partial_budget of the prefix bytes
    partial_budget: int = 2
    max_splits: int = 32
    # merge kernel: (rows x slots per program, warps); a program merges max(1, rows x slots // slots) rows
    merge_tile: tuple[int, int] = (16, 2)
    # fp16/bf16: partial outputs in the input dtype (half the scratch bytes; LSE stays fp32), docs/performance.md
    partial_half: bool = True
    # N = B*G*L_q rows in this range run as separate prefix and suffix launches, each with its own tiles (won at 128+
    # rows, lost at 32, and at 16384 x 128 a tail wave of prefix programs: docs/performance.md)
    separate_rows: tuple[int, int] = (64, 512)
    # separate layout's suffix launch: head dim -> (BLOCK_N, warps, stages); its lighter programs fit 3-5 per SM
    suffix_tiles: TileTable = ((64, (32, 4, 3)), (128, (32, 4, 3)), (256, (32, 8, 2)))
    # separate layout's prefix launch: (waves, budget), split for whole waves only (no tail wave, docs/performance.md)
    separate_split: tuple[int, int] = (2, 4)
    # the separate suffix launch merges the prefix partials itself (no merge launch) while there are at most
    # fused_merge_slots of them and its [rows, slots] merge tile has at most fused_merge_tile elements
    fused_merge_slots: int = 16
    fused_merge_tile: int = 512
    # separate layout's prefix launch: head dim -> (BLOCK_M, BLOCK_N, warps, stages); 128-row blocks were slower
    prefix_tiles: TileTable = ((64, (64, 64, 4, 3)), (128, (64, 64, 4, 3)), (256, (64, 32, 8, 2)))
    # prefix K/V full tiles through TMA descriptors (Hopper+ or the interpreter; fp16/bf16, head dim a power of two,
    # 16-byte aligned strides and base): no address registers, no per-element predicates
    prefix_tma: bool = True
    # programmatic dependent launch (Hopper+) of the fused suffix launch only: it streams its suffix while the prefix
    # launch runs and waits before the merge (it lost wherever programs wait without merging: docs/performance.md)
    pdl: bool = True
    # paired suffix units: where the prefix launch runs at most one program per SM, the prefix has at least
    # suffix_pair_min_prefix tokens and more than suffix_pair_above fused suffix programs per SM would queue, each
    # suffix program streams two batch rows before its PDL wait (None: never; docs/performance.md)
    suffix_pair_above: int | None = 3
    suffix_pair_min_prefix: int = 2048
    # SM count the work split plans for; None: the device's (a smaller share of the GPU, or a test planning for a
    # large GPU on a small one)
    num_sms: int | None = None
    # after a plan's first call, launch the kernels Triton compiled for it directly (host time: Triton's per-call
    # argument specialisation is skipped; the call's strides and 16-byte alignment are part of the reuse key)
    reuse_compiled: bool = True

    def __post_init__(self):
        for name, width in (("tiles", 3), ("suffix_tiles", 3), ("prefix_tiles", 4)):
            object.__setattr__(self, name, _tile_table(getattr(self, name), width, name))
        for name in ("merge_tile", "separate_rows", "separate_split"):
            value = tuple(getattr(self, name))
            if len(value) != 2:
                raise ValueError(f"KernelConfig.{name} must be a pair, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        # hashed once: the config is part of every call's plan key
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash


DEFAULT_CONFIG = KernelConfig()
_ACTIVE_CONFIG: contextvars.ContextVar[KernelConfig] = contextvars.ContextVar("relay_kernel_config",
                                                                              default=DEFAULT_CONFIG)


@contextlib.contextmanager
def use_config(config: KernelConfig) -> Iterator[KernelConfig]:
    """Within the block, calls that pass no ``config`` (``relay_attention``, the custom op, a patched model) use this
    one. A CUDA graph or compiled step captured inside keeps the launches it captured."""
    if not isinstance(config, KernelConfig):
        raise ValueError(f"use_config needs a KernelConfig, got {type(config).__name__}")
    token = _ACTIVE_CONFIG.set(config)
    try:
        yield config
    finally:
        _ACTIVE_CONFIG.reset(token)


def active_config() -> KernelConfig:
    """The configuration calls without a ``config`` argument use now (``use_config``'s, else ``DEFAULT_CONFIG``)."""
    return _ACTIVE_CONFIG.get()


def triton_available() -> bool:
    """Triton imports and can run here: a CUDA device, or the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return triton is not None and (torch.cuda.is_available() or _interpreting())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _row(table: TileTable, block_d: int) -> tuple[int, ...]:
    """The row of a tile table for a padded head dim."""
    return dict(table)[min(max(block_d, HEAD_DIM_CLASSES[0]), HEAD_DIM_CLASSES[-1])]


@functools.cache
def _num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _hopper(device_index: int) -> bool:
    """Hopper or newer: TMA descriptors and programmatic dependent launch."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _block_m(rows: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(rows)))


def plan_splits(P: int, N: int, H_kv: int, block_m: int, block_n: int, num_sms: int, waves: int | None = None,
                budget: int | None = None, whole_waves: bool = False,
                config: KernelConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """``(splits, tiles_per_split)`` for the prefix: enough programs for ``waves`` (``config.split_waves``) per SM
    (with ``whole_waves``: as many as fit, never a partial wave more), few enough that the partials
    (``splits * N * D`` elements per head) stay within ``1/budget`` (``config.partial_budget``) of the prefix
    (``P * D`` elements per head, K and V), and at most ``config.max_splits``."""
    if P == 0:
        return 0, 1
    waves, budget = waves or config.split_waves, budget or config.partial_budget
    n_tiles = triton.cdiv(P, block_n)
    units = H_kv * triton.cdiv(N, block_m)
    want = max(1, waves * num_sms // units) if whole_waves else triton.cdiv(waves * num_sms, units)
    cap = max(1, P // (budget * N))
    splits = max(1, min(n_tiles, want, cap, config.max_splits))
    per = triton.cdiv(n_tiles, splits)
    return triton.cdiv(n_tiles, per), per


def plan_suffix_splits(L_s: int, units: int, H_kv: int, block_n: int, num_sms: int,
                       config: KernelConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """``(splits, tiles_per_split)`` for the suffix: split each row's suffix only when ``units * H_kv`` programs
    (one per row and row block) would leave SMs idle (``config.suffix_waves`` programs per SM)."""
    n_tiles = max(1, triton.cdiv(L_s, block_n))
    want = triton.cdiv(config.suffix_waves * num_sms, H_kv * units)
    splits = max(1, min(n_tiles, want, config.max_splits))
    per = triton.cdiv(n_tiles, splits)
    return triton.cdiv(n_tiles, per), per


if triton is not None:
    # unit kinds of one ``_partials_kernel`` launch (its KIND): both in one grid, or one kind per launch (the
    # separate layout, module docstring 3.)
    KIND_BOTH = tl.constexpr(0)
    KIND_PREFIX = tl.constexpr(1)
    KIND_SUFFIX = tl.constexpr(2)
    _LOG2E = tl.constexpr(LOG2E)
    _LN2 = tl.constexpr(LN2)
    _FAR = tl.constexpr(1 << 30)  # beyond every position: the neutral element of a min over rows

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
            s = _dot(q, k, IEEE, DOT_F32)  # raw scores [BLOCK_M, BLOCK_N]
            if SOFTCAP:
                s = _cap(s, softcap, cap_scale)
            if MASKED:
                visible = col_ok[None, :]
                if CAUSAL:
                    visible = visible & (cols[None, :] <= q_pos[:, None])
                if ROW_FIRST:
                    visible = visible & (cols[None, :] >= row_first[:, None])
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
    def _attend_tma(m, l, acc, q, KD, VD, h, lo, hi, scale_log2, softcap, cap_scale, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr):
        """``_attend`` over full tiles ``[lo, hi)`` of head ``h`` (unmasked: ``hi - lo`` is a multiple of
        ``BLOCK_N``) with K/V tiles from TMA descriptors over ``[H_kv, P, D]``."""
        for n0 in tl.range(lo, hi, BLOCK_N):
            k = KD.load([h, n0, 0]).reshape(BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
            v = VD.load([h, n0, 0]).reshape(BLOCK_N, BLOCK_D)
            s = _dot(q, k.T, False, DOT_F32)  # raw scores [BLOCK_M, BLOCK_N]
            if SOFTCAP:
                s = _cap(s, softcap, cap_scale)
            m, l, acc = _softmax_step(m, l, acc, s, v, scale_log2, False, False, DOT_F32)
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
                     dims, scale_log2, softcap, cap_scale, prefix_plan, HAS_LENS: tl.constexpr,
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
        blocks, splits, per, _ = prefix_plan
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
        m, l, acc = _empty(BLOCK_M, BLOCK_D)
        PKh, PVh = PK + h * pk_st[0], PV + h * pv_st[0]
        if WINDOW > 0:
            # first visible key (packed index) of each query: t - WINDOW + 1 at absolute position t
            row_prefix = tl.load(ROWP + b, mask=n_ok, other=0) if GROUPED else P
            t = row_prefix + _valid_suffix(LENS, END, b, n_ok, L_s, HAS_LENS, HAS_END) - L_q + i
            row_first = t - WINDOW + 1
            if GROUPED:
                row_first = row_first - seg_base + seg_off
            start = tl.minimum(tl.maximum(tl.min(tl.where(n_ok, row_first, _FAR)), lo), hi)
            every = tl.minimum(tl.maximum(tl.max(tl.where(n_ok, row_first, -_FAR)), start), hi)
            m, l, acc = _attend(m, l, acc, q, PKh, PVh, pk_st[1], pk_st[2], pv_st[1], pv_st[2], start, every, start,
                                row_first, i, d, d_ok, scale_log2, softcap, cap_scale, BLOCK_N, True, False, True,
                                SOFTCAP, IEEE, DOT_F32)
            lo = every
        full = lo + (hi - lo) // BLOCK_N * BLOCK_N  # full tiles from lo on: only the range's last tile is partial
        if TMA:
            m, l, acc = _attend_tma(m, l, acc, q, KD, VD, h, lo, full, scale_log2, softcap, cap_scale, BLOCK_N,
                                    BLOCK_D, SOFTCAP, DOT_F32)
        else:
            m, l, acc = _attend(m, l, acc, q, PKh, PVh, pk_st[1], pk_st[2], pv_st[1], pv_st[2], lo, full, 0, i, i, d,
                                d_ok, scale_log2, softcap, cap_scale, BLOCK_N, False, False, False, SOFTCAP, IEEE,
                                DOT_F32)
        m, l, acc = _attend(m, l, acc, q, PKh, PVh, pk_st[1], pk_st[2], pv_st[1], pv_st[2], full, hi, 0, i, i, d, d_ok,
                            scale_log2, softcap, cap_scale, BLOCK_N, True, False, False, SOFTCAP, IEEE, DOT_F32)
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
        m, l, acc = _empty(BLOCK_M, BLOCK_D)
        return _attend(m, l, acc, q, SK + b * sk_st[0] + h * sk_st[1], SV + b * sv_st[0] + h * sv_st[1], sk_st[2],
                       sk_st[3], sv_st[2], sv_st[3], lo, hi, first, q_pos - WINDOW + 1, q_pos, d, d_ok, scale_log2,
                       softcap, cap_scale, BLOCK_N, True, True, WINDOW > 0, SOFTCAP, IEEE, DOT_F32)

    @triton.jit
    def _suffix_unit(Q, q_st, SK, sk_st, SV, sv_st, LENS, END, PO, PLSE, O, o_st, SINKS, w, h, H_kv, dims,
                     scale_log2, softcap, cap_scale, prefix_slots, suffix_plan, HAS_LENS: tl.constexpr,
                     HAS_END: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     IEEE: tl.constexpr, DOT_F32: tl.constexpr, FUSE: tl.constexpr, PDL: tl.constexpr,
                     PAIR: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SINK: tl.constexpr):
        """Row b's queries r = g * L_q + i against one split of its own suffix -> slot prefix_slots + split. ``FUSE``
        > 0 (one suffix split, prefix partials written by an earlier launch, ``FUSE >= prefix_slots`` a power of
        two): merge with them and write ``O`` instead. ``PAIR`` (with ``FUSE``, one suffix block and split): unit
        ``w`` is rows ``2w`` and ``2w + 1``, both streamed before the wait (see ``KernelConfig.suffix_pair_above``)."""
        N, P, L_q, L_s, G, D = dims
        suffix_blocks, suffix_splits, suffix_per = suffix_plan
        rb, split, b = w % suffix_blocks, (w // suffix_blocks) % suffix_splits, w // (suffix_blocks * suffix_splits)
        if PAIR:
            b = 2 * w
        r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        r_ok = r < G * L_q
        qh, i = h * G + r // L_q, r % L_q
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        m, l, acc = _suffix_state(Q, q_st, SK, sk_st, SV, sv_st, LENS, END, b, h, qh, i, r_ok, d, d_ok, L_q, L_s,
                                  scale_log2, softcap, cap_scale, split, suffix_per, HAS_LENS, HAS_END, BLOCK_M,
                                  BLOCK_N, BLOCK_D, IEEE, DOT_F32, SOFTCAP, WINDOW)
        n = b * G * L_q + r
        if PAIR:  # an odd batch's last pair streams row B-1 twice and stores it once
            rows = N // (G * L_q)  # batch rows B
            b1 = tl.minimum(b + 1, rows - 1)
            ok1 = r_ok & (r * 0 + b + 1 < rows)  # a full tensor: the interpreter ands a 0-d bool as int
            m1, l1, acc1 = _suffix_state(Q, q_st, SK, sk_st, SV, sv_st, LENS, END, b1, h, qh, i, r_ok, d, d_ok, L_q,
                                         L_s, scale_log2, softcap, cap_scale, split, suffix_per, HAS_LENS, HAS_END,
                                         BLOCK_M, BLOCK_N, BLOCK_D, IEEE, DOT_F32, SOFTCAP, WINDOW)
        if FUSE:
            # PDL: this launch started before the prefix launch finished; every program waits for it here, which
            # also makes whatever follows this launch in the stream follow the prefix launch
            if PDL:
                tl.extra.cuda.gdc_wait()
            out = _merge_slots(PO, PLSE, SINKS, m, l, acc, h, H_kv, N, n, r_ok, qh, d, d_ok, D, prefix_slots, FUSE,
                               SINK)
            _store_out(O, o_st, n, r_ok, h, G, L_q, d, d_ok, out)
            if PAIR:
                out = _merge_slots(PO, PLSE, SINKS, m1, l1, acc1, h, H_kv, N, n + G * L_q, ok1, qh, d, d_ok, D,
                                   prefix_slots, FUSE, SINK)
                _store_out(O, o_st, n + G * L_q, ok1, h, G, L_q, d, d_ok, out)
        else:
            _store_partial(PO, PLSE, prefix_slots + split, h, H_kv, N, n, r_ok, m, l, acc, d, d_ok, D)

    # Strides travel as one tuple per tensor (q_st: query [B, H_q, L_q, D]; pk_st/pv_st: prefix [H_kv, P, D]; sk_st/
    # sv_st: suffix [B, H_kv, L_s, D]; o_st: output [B, H_q, L_q, D]), sizes as dims = (N, P, L_q, L_s, G, D) and the
    # work split as (blocks, splits, tiles per split, slots) for the prefix and (blocks, splits, tiles per split) for
    # the suffix. Triton flattens tuples into the same scalar parameters, each specialised as before (a unit stride
    # stays a constant), so the compiled code is unchanged. Grouped prefixes read ITEMS / ROWS / ROWP (int32 tables,
    # ``groups.PrefixGroups.tables``), sinks read SINKS ([H_q], any float dtype); absent ones are placeholders.
    @triton.jit
    def _partials_kernel(Q, PK, PV, KD, VD, SK, SV, LENS, END, PO, PLSE, O, ITEMS, ROWS, ROWP, SINKS,
                         q_st, pk_st, pv_st, sk_st, sv_st, o_st, dims, scale_log2, softcap, cap_scale, prefix_plan,
                         suffix_plan, HAS_LENS: tl.constexpr, HAS_END: tl.constexpr,
                         BLOCK_MP: tl.constexpr, BLOCK_MS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr, KIND: tl.constexpr,
                         FUSE: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr, PAIR: tl.constexpr = False,
                         GROUPED: tl.constexpr = False, SOFTCAP: tl.constexpr = False, WINDOW: tl.constexpr = 0,
                         SINK: tl.constexpr = False):
        """``KIND``: ``KIND_BOTH`` prefix and suffix units in one grid, ``KIND_PREFIX`` prefix units only,
        ``KIND_SUFFIX`` suffix units only (a launch of one kind compiles only that kind, so its tiles, shared memory
        and registers are its own). ``FUSE`` (a ``KIND_SUFFIX`` launch after a ``KIND_PREFIX`` one, one suffix split):
        each suffix unit merges its rows and writes ``O``."""
        u, h = tl.program_id(0), tl.program_id(1)
        if PDL and KIND == KIND_PREFIX:  # the suffix launch may start now; it waits for this one before its merge
            tl.extra.cuda.gdc_launch_dependents()
        H_kv = tl.num_programs(1)
        prefix_blocks, prefix_splits, _, prefix_slots = prefix_plan
        if KIND == KIND_SUFFIX:
            u += prefix_blocks * prefix_splits
        # prefix units first (they share tiles through L2), then suffix units; both kinds in one wave
        if KIND != KIND_SUFFIX and (KIND == KIND_PREFIX or u < prefix_blocks * prefix_splits):
            _prefix_unit(Q, q_st, PK, pk_st, PV, pv_st, KD, VD, PO, PLSE, ITEMS, ROWS, ROWP, LENS, END, u, h, H_kv,
                         dims, scale_log2, softcap, cap_scale, prefix_plan, HAS_LENS, HAS_END, BLOCK_MP, BLOCK_N,
                         BLOCK_D, IEEE, DOT_F32, TMA, GROUPED, SOFTCAP, WINDOW)
        else:
            _suffix_unit(Q, q_st, SK, sk_st, SV, sv_st, LENS, END, PO, PLSE, O, o_st, SINKS,
                         u - prefix_blocks * prefix_splits, h, H_kv, dims, scale_log2, softcap, cap_scale,
                         prefix_slots, suffix_plan, HAS_LENS, HAS_END, BLOCK_MS, BLOCK_N, BLOCK_D, IEEE, DOT_F32,
                         FUSE, PDL, PAIR, SOFTCAP, WINDOW, SINK)

    @triton.jit
    def _merge_kernel(PO, PLSE, O, SINKS, o_st, N, L_q, G, D, slots,
                      BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SINK: tl.constexpr = False):
        """Rows ``n`` of head ``h``: all ``slots`` partials at once (``_merge_slots`` from an empty state), written once
        in ``O``'s dtype; bitwise reproducible."""
        pid, h = tl.program_id(0), tl.program_id(1)
        n = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        n_ok, d_ok = n < N, d < D
        m, l, acc = _empty(BLOCK_R, BLOCK_D)
        qh = h * G + (n // L_q) % G
        out = _merge_slots(PO, PLSE, SINKS, m, l, acc, h, tl.num_programs(1), N, n, n_ok, qh, d, d_ok, D, slots,
                           BLOCK_S, SINK)
        _store_out(O, o_st, n, n_ok, h, G, L_q, d, d_ok, out)


class _Plan(NamedTuple):
    """One call's launch layout: which units run where, with which tiles (see the module docstring)."""

    sep: bool  # separate prefix and suffix launches (else one launch for both kinds)
    prefix: tuple[int, int, int, int]  # (BLOCK_M rows, BLOCK_N keys, warps, stages) of the prefix units
    suffix: tuple[int, int, int, int]  # the same for the suffix units (one launch: the prefix's keys/warps/stages)
    p_blocks: int  # prefix row blocks (of the N = B*G*L_q rows), or grouped: work items (table rows)
    p_splits: int
    p_per: int  # prefix tiles per split (grouped: per segment, in the kernel)
    s_blocks: int  # suffix row blocks (of one batch row's G*L_q rows)
    s_splits: int
    s_per: int
    fuse_slots: int  # > 0: the suffix launch merges the prefix slots in a tile this wide (power of two); 0: no
    pdl: bool  # the fused suffix launch starts while the prefix launch runs (PDL; a prefix, Hopper+)
    pair: bool  # each fused suffix program streams two batch rows (see KernelConfig.suffix_pair_above)
    rows: int  # batch rows B
    p_slots: int  # prefix partial slots per row: the splits, or grouped: levels x splits

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


def group_block_m(N: int, D: int, segments: int, config: KernelConfig = DEFAULT_CONFIG) -> int:
    """Query rows per grouped prefix program: the ungrouped rule's cap for ``N`` folded rows, sized for the rows of a
    typical segment (``N / segments``), so small groups do not run mostly empty row blocks."""
    cap = (_row(config.prefix_tiles, _block_d(D))[0] if config.separate_rows[0] <= N <= config.separate_rows[1]
           else config.max_block_m)
    return _block_m(triton.cdiv(N, max(1, segments)), cap)


def group_items(N: int, block_m: int, depth: int, segments: int) -> int:
    """Work items a grouped launch plans for: per level, every segment's rows in blocks (``N / block_m`` blocks, plus
    at most one partial block per segment)."""
    return depth * (triton.cdiv(N, block_m) + segments)


def plan_group_splits(P: int, N: int, segments: int, items: int, H_kv: int, block_n: int, num_sms: int,
                      waves: int | None = None, budget: int | None = None, whole_waves: bool = False,
                      config: KernelConfig = DEFAULT_CONFIG) -> int:
    """Splits of every segment of a grouped prefix (``P`` packed positions, ``segments`` of them per level): the rule
    of ``plan_splits`` for a typical segment (``P / segments`` positions read by ``N / segments`` folded rows), over
    ``items`` work items. At least 1: an empty segment still writes its rows' empty partial."""
    waves, budget = waves or config.split_waves, budget or config.partial_budget
    seg, rows = max(1, P // max(1, segments)), max(1, N // max(1, segments))
    units = H_kv * max(1, items)
    want = max(1, waves * num_sms // units) if whole_waves else triton.cdiv(waves * num_sms, units)
    cap = max(1, seg // (budget * rows))
    return max(1, min(triton.cdiv(seg, block_n), want, cap, config.max_splits))


@functools.lru_cache(maxsize=1024)
def _plan(B: int, N: int, G: int, L_q: int, P: int, L_s: int, H_kv: int, D: int, num_sms: int, hopper: bool,
          config: KernelConfig = DEFAULT_CONFIG, groups: tuple[int, int] | None = None) -> _Plan:
    """The launch layout for these sizes on ``num_sms`` SMs (``hopper``: a CUDA device that can PDL); ``groups``:
    ``(levels, segments per level)`` of a grouped prefix (``P`` its packed positions), ``None`` for one prefix."""
    block_d = _block_d(D)
    block_n, warps, stages = _row(config.tiles, block_d)
    sep = config.separate_rows[0] <= N <= config.separate_rows[1]  # layout rule: see KernelConfig.separate_rows
    if sep:
        bm, bn, w, st = _row(config.prefix_tiles, block_d)
        prefix = (_block_m(N, bm), bn, w, st)
        suffix = (_block_m(G * L_q, config.max_block_m), *_row(config.suffix_tiles, block_d))
    else:
        prefix = (_block_m(N, config.max_block_m), block_n, warps, stages)
        suffix = (_block_m(G * L_q, config.max_block_m), block_n, warps, stages)
    s_blocks = triton.cdiv(G * L_q, suffix[0])
    whole = config.separate_split if sep else ()
    if groups is None:
        p_blocks = triton.cdiv(N, prefix[0])
        # the separate layout's prefix launch holds prefix programs only: whole waves of them (separate_split)
        p_splits, p_per = plan_splits(P, N, H_kv, prefix[0], prefix[1], num_sms, *whole, whole_waves=sep,
                                      config=config)
        p_slots = p_splits
    else:
        depth, segments = groups
        prefix = (group_block_m(N, D, segments, config), *prefix[1:])
        p_blocks = group_items(N, prefix[0], depth, segments)
        p_splits = plan_group_splits(P, N, segments, p_blocks, H_kv, prefix[1], num_sms, *whole, whole_waves=sep,
                                     config=config)
        p_per, p_slots = 0, depth * p_splits
    s_splits, s_per = plan_suffix_splits(L_s, B * s_blocks, H_kv, suffix[1], num_sms, config)
    slot_tile = triton.next_power_of_2(max(p_slots, 1))
    fuse = (sep and s_splits == 1 and p_slots <= config.fused_merge_slots
            and suffix[0] * slot_tile <= config.fused_merge_tile)
    pdl = config.pdl and fuse and P > 0 and hopper
    plan = _Plan(sep, prefix, suffix, p_blocks, p_splits, p_per, s_blocks, s_splits, s_per,
                 slot_tile if fuse else 0, pdl, False, B, p_slots)
    pair = (config.suffix_pair_above is not None and fuse and s_blocks == 1 and plan.p_units * H_kv <= num_sms
            and P >= config.suffix_pair_min_prefix and plan.s_units * H_kv > config.suffix_pair_above * num_sms)
    return plan._replace(pair=pair)


class _Address:
    """The ``base`` of a cached TMA descriptor: the address and dtype it was built for, never the tensor, so a cached
    descriptor keeps no freed prefix alive (a descriptor is a function of address, shape, strides and dtype only)."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self._ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self._ptr


def _tma_layout_ok(t: torch.Tensor, block_d: int, config: KernelConfig) -> bool:
    """TMA can load ``t [1, H_kv, P, D]``'s tiles: Hopper+ (or the interpreter, which emulates it), fp16/bf16, an
    unpadded head dim, unit last stride and 16-byte aligned other strides (the base is checked per call)."""
    return (config.prefix_tma and TensorDescriptor is not None and t.dtype in (torch.float16, torch.bfloat16)
            and t.shape[-1] == block_d and t.shape[2] > 0
            and (_interpreting() or (t.is_cuda and _hopper(t.device.index or 0)))
            and t.stride(3) == 1 and all(t.stride(i) * t.element_size() % 16 == 0 for i in (1, 2)))


def _prefix_descriptors(prefix_key: torch.Tensor, prefix_value: torch.Tensor, block_n: int, block_d: int,
                        config: KernelConfig = DEFAULT_CONFIG):
    """TMA descriptors over ``[H_kv, P, D]`` for the prefix's full tiles, or ``(None, None)`` where TMA cannot run
    (``_tma_layout_ok``, or a base that is not 16-byte aligned). Built on the tensors themselves (what the
    interpreter reads); cached calls on CUDA use ``_Launch.descriptors``."""
    if not all(_tma_layout_ok(x, block_d, config) and x.data_ptr() % 16 == 0 for x in (prefix_key, prefix_value)):
        return None, None
    return tuple(TensorDescriptor(x[0], list(x.shape[1:]), list(x.stride()[1:]), [1, block_n, block_d])
                 for x in (prefix_key, prefix_value))


_MAX_CACHED_DESCRIPTORS = 256  # per launch plan: a few per layer and prefix; old addresses are dropped first


class _Options(NamedTuple):
    """What a call computes beyond plain relay attention, as far as the launch plan depends on it."""

    groups: tuple[int, int] | None = None  # (levels, segments per level) of a grouped prefix
    softcap: bool = False
    window: int = 0  # 0: no sliding window
    sinks: torch.dtype | None = None  # the sinks' dtype (the kernel reads them as they are)


class _Launch:
    """Everything a call needs besides its tensors, built once per key (``_launch_key``): validated shapes, the plan,
    scratch sizes, grids and compile-time flags of each launch, and the TMA descriptors of prefix addresses seen."""

    def __init__(self, query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end,
                 config: KernelConfig, options: _Options):
        check_relay_inputs(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end)
        B, H_q, L_q, D = query.shape
        H_kv, L_s, P, D_v = suffix_key.shape[1], suffix_key.shape[2], prefix_key.shape[2], suffix_value.shape[-1]
        if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"the Triton relay kernels take fp16, bf16 or fp32, got {query.dtype}; use "
                             "relay_attention (which runs the reference for others)")
        if D_v != D:
            raise ValueError(f"the Triton relay kernels need the value head dim D_v={D_v} to equal the key head dim "
                             f"D={D}; relay_attention routes such calls to the reference")
        device = query.device
        G, N = H_q // H_kv, B * (H_q // H_kv) * L_q
        self.dtype, self.device, self.out_shape = query.dtype, device, (B, L_q, H_q, D)
        self.empty = N * D == 0
        self.check_values = device.type == "cpu"  # value checks cost no sync only there (check_relay_values)
        self.L_q, self.L_s = L_q, L_s
        self.scale_log2 = default_scale(D) * LOG2E
        if self.empty:
            return
        cuda = device.type == "cuda"
        num_sms = config.num_sms or _num_sms(device.index or 0)
        plan = _plan(B, N, G, L_q, P, L_s, H_kv, D, num_sms, cuda and _hopper(device.index or 0), config,
                     options.groups)
        self.plan, self.options = plan, options
        (block_mp, block_n, warps, stages), (block_ms, block_ns, warps_s, stages_s) = plan.prefix, plan.suffix
        block_d = _block_d(D)
        slots = plan.p_slots + (0 if plan.fuse else plan.s_splits)
        half = config.partial_half and query.dtype in (torch.float16, torch.bfloat16)
        self.po_shape, self.po_dtype = (max(slots, 1), H_kv, N, D), (query.dtype if half else torch.float32)
        self.plse_shape = (max(slots, 1), H_kv, N)
        self.pk_st, self.pv_st = prefix_key.stride()[1:], prefix_value.stride()[1:]
        self.dims = (N, P, L_q, L_s, G, D)
        self.prefix_plan = (plan.p_blocks, plan.p_splits, plan.p_per, plan.p_slots)
        self.table_shape = (block_mp, G * L_q, plan.p_blocks)  # a grouped call's tables (PrefixGroups.tables)
        self.suffix_plan = (plan.s_blocks, plan.s_splits, plan.s_per)
        # TMA where the layout allows; a call whose prefix base is not 16-byte aligned takes the pointer loads
        self.tma = all(_tma_layout_ok(x, block_d, config) for x in (prefix_key, prefix_value))
        self.tma_block = [1, block_n, block_d]
        self.tma_shapes = [list(x.shape[1:]) for x in (prefix_key, prefix_value)]
        self.descs: dict[tuple[int, int], tuple] = {}
        self.interpreted = _interpreting()
        # the CPU interpreter's tl.dot cannot multiply bf16 (numpy has no bf16): upcast there, only there
        flags = dict(HAS_LENS=suffix_lengths is not None, HAS_END=suffix_end is not None, BLOCK_MP=block_mp,
                     BLOCK_MS=block_ms, BLOCK_D=block_d, IEEE=query.dtype == torch.float32, PDL=plan.pdl,
                     DOT_F32=query.dtype == torch.bfloat16 and self.interpreted, GROUPED=options.groups is not None,
                     SOFTCAP=options.softcap, WINDOW=options.window, SINK=options.sinks is not None)
        if not plan.sep:
            launches = [((plan.p_units + plan.s_units, H_kv, 1),
                         dict(flags, BLOCK_N=block_n, KIND=KIND_BOTH, FUSE=0, num_warps=warps, num_stages=stages))]
        else:
            launches = [((plan.p_units, H_kv, 1), dict(flags, BLOCK_N=block_n, KIND=KIND_PREFIX, FUSE=0,
                                                    num_warps=warps, num_stages=stages))] if plan.p_units else []
            launches.append(((plan.s_units, H_kv, 1), dict(flags, BLOCK_N=block_ns, KIND=KIND_SUFFIX,
                                                        FUSE=plan.fuse_slots, num_warps=warps_s, num_stages=stages_s,
                                                        launch_pdl=plan.pdl, PAIR=plan.pair)))
        # grids are (x, y, 1), as a compiled kernel's launcher takes them; both variants of the TMA flag, picked per
        # call by the prefix base's alignment
        self.launches = {tma: [(grid, dict(kw, TMA=tma)) for grid, kw in launches] for tma in (False, True)}
        self.merge = None
        if not plan.fuse:
            tile, merge_warps = config.merge_tile
            block_s = triton.next_power_of_2(slots)
            rows = max(1, tile // block_s)
            self.merge = ((triton.cdiv(N, rows), H_kv, 1), (N, L_q, G, D, slots),
                          dict(BLOCK_R=rows, BLOCK_S=block_s, BLOCK_D=block_d, SINK=options.sinks is not None,
                               num_warps=merge_warps))
        # compiled kernels of this plan by reuse key (see relay_attention_triton), with their constexpr arguments in
        # parameter order: a compiled kernel is launched with every parameter's value, constexprs included
        self.reuse = config.reuse_compiled and CompiledKernel is not None and not self.interpreted
        self.compiled: dict[tuple, tuple] = {}
        if self.reuse:
            self.tails = {tma: [_constexpr_tail(_partials_kernel, kw) for _, kw in variant]
                          for tma, variant in self.launches.items()}
            self.merge_tail = None if self.merge is None else _constexpr_tail(_merge_kernel, self.merge[2])

    def descriptors(self, prefix_key: torch.Tensor, prefix_value: torch.Tensor):
        """``(kd, vd)`` TMA descriptors for this call's prefix, or ``(None, None)``: pointer loads. Reused while the
        prefix sits at the same addresses (every decode step of a layer); rebuilt per call under the interpreter,
        which reads the tensors through them."""
        if not self.tma:
            return None, None
        ptrs = (prefix_key.data_ptr(), prefix_value.data_ptr())
        if self.interpreted:
            if ptrs[0] % 16 or ptrs[1] % 16:
                return None, None
            return tuple(TensorDescriptor(x[0], shape, list(st), self.tma_block)
                         for x, shape, st in zip((prefix_key, prefix_value), self.tma_shapes, (self.pk_st, self.pv_st)))
        descs = self.descs.get(ptrs)
        if descs is None:
            if ptrs[0] % 16 or ptrs[1] % 16:
                descs = (None, None)
            else:
                descs = tuple(TensorDescriptor(_Address(ptr, self.dtype), shape, list(st), self.tma_block)
                              for ptr, shape, st in zip(ptrs, self.tma_shapes, (self.pk_st, self.pv_st)))
            if len(self.descs) >= _MAX_CACHED_DESCRIPTORS:
                self.descs.pop(next(iter(self.descs)))
            self.descs[ptrs] = descs
        return descs


def _constexpr_tail(kernel, flags: dict) -> tuple:
    """The values of ``kernel``'s constexpr parameters (all after its runtime ones), as Triton's launcher passes them
    to a compiled kernel: from ``flags``, else the parameter's default."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    tail = [i for i, p in enumerate(params) if "constexpr" in str(p.annotation)]
    assert tail == list(range(tail[0], len(params))), "constexpr parameters must come last"
    return tuple(flags[p.name] if p.name in flags else p.default for p in params[tail[0]:])


def _idle(hook) -> bool:
    """Whether a Triton launch hook would do nothing (``None``, or a ``HookChain`` with no hook in it): then a launch
    may skip it (profilers register hooks, and then every launch goes through Triton)."""
    return hook is None or getattr(hook, "calls", None) == []


class _Direct:
    """One compiled kernel launched through its C launcher with the arguments it takes, skipping Triton's per-launch
    Python (the runner closure, scratch checks, the tensor-descriptor wrapper that rebuilds each TMA descriptor
    every launch): about half of an eager call's host time (docs/performance.md, eager host column). ``launch``
    returns ``False`` where that is not possible here (a kernel that needs scratch memory, a launch hook, a
    launcher of another shape); the caller then launches through Triton."""

    _MAX_DESCRIPTORS = 64  # expanded descriptor arguments per kernel, by prefix address

    def __init__(self, kernel, grid: tuple, tail: tuple, device_index: int):
        self.grid, self.tail, self.device_index, self.ok = grid, tail, device_index, False
        try:
            from triton import knobs
            from triton.backends.nvidia.driver import make_tensordesc_arg

            kernel._init_handles()
            run = kernel._run
            launch, meta = run.launch, None
            code = getattr(launch, "__code__", None)  # None: the C launcher itself (no descriptor arguments)
            cells = {} if code is None else dict(zip(code.co_freevars, launch.__closure__ or ()))
            if cells:  # Triton's wrapper for tensor-descriptor arguments: its C launcher and descriptor layouts
                launch, meta = cells["launcher"].cell_contents, cells["tensordesc_meta"].cell_contents
                meta = list(meta) if meta else [None, None]  # no layouts: descriptors go as base, shape, strides
            if run.global_scratch_size or run.profile_scratch_size or not callable(launch):
                return
            self.head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                         kernel.packed_metadata, None, None, None)
            self.c_launch, self.meta, self.expand, self.knobs = launch, meta, make_tensordesc_arg, knobs.runtime
            self.descs: dict[tuple[int, int], tuple] = {}
            self.ok = True
        except (AttributeError, ImportError, KeyError, TypeError, ValueError):
            self.ok = False

    def launch(self, args: tuple, tma_key: tuple[int, int] | None) -> bool:
        """Launch with ``args`` (this module's kernel-argument tuple, TMA descriptors at positions 3 and 4 when
        ``tma_key``, the prefix addresses, is given). ``False``: nothing was launched."""
        if not self.ok or not (_idle(self.knobs.launch_enter_hook) and _idle(self.knobs.launch_exit_hook)):
            return False
        if tma_key is not None:
            expanded = self.descs.get(tma_key)
            if expanded is None:
                if self.meta is None or len(self.meta) != 2:
                    self.ok = False
                    return False
                expanded = (*self.expand(args[3], self.meta[0]), *self.expand(args[4], self.meta[1]))
                if len(self.descs) >= self._MAX_DESCRIPTORS:
                    self.descs.pop(next(iter(self.descs)))
                self.descs[tma_key] = expanded
            args = (*args[:3], *expanded, *args[5:])
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        try:
            self.c_launch(*self.grid, stream, *self.head, *args, *self.tail)
        except TypeError:  # the launcher parses its arguments before launching: nothing ran, Triton's path will
            self.ok = False
            return False
        return True


_MAX_COMPILED = 64  # reuse keys per plan (argument layouts); beyond, the oldest is dropped
_LAUNCHES: dict[tuple, _Launch] = {}
_MAX_LAUNCHES = 512  # distinct keys kept (a dynamic cache grows L_s by one a step: one key per step, not per layer)


def _launch_key(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end, config,
                options: _Options):
    """Every fact the plan and the input checks depend on: shapes, dtypes and devices of all tensors, the prefix
    strides (TMA), the options and the config (last). Strides of the other tensors are launch arguments, not plan
    inputs."""
    return (query.shape, query.dtype, query.device, prefix_key.shape, prefix_key.dtype, prefix_key.device,
            prefix_key.stride(), prefix_value.shape, prefix_value.dtype, prefix_value.device, prefix_value.stride(),
            suffix_key.shape, suffix_key.dtype, suffix_key.device, suffix_value.shape, suffix_value.dtype,
            suffix_value.device,
            None if suffix_lengths is None else (suffix_lengths.shape, suffix_lengths.dtype, suffix_lengths.device),
            None if suffix_end is None else (suffix_end.shape, suffix_end.dtype, suffix_end.device), options, config)


def grouped_launch_shape(N: int, D: int, groups: PrefixGroups | GroupTables,
                         config: KernelConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """``(block_m, items)``: the row block and work-item capacity a grouped launch of ``N`` folded rows uses, for
    ``PrefixGroups.tables`` (which the caller may build ahead, e.g. into buffers a CUDA graph replays)."""
    depth, segments = _group_shape(groups)
    block_m = group_block_m(N, D, segments, config)
    return block_m, group_items(N, block_m, depth, segments)


def _group_shape(groups) -> tuple[int, int]:
    if isinstance(groups, GroupTables):
        return groups.depth, groups.segments
    return groups.depth, groups.segments_per_level


def relay_attention_triton(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                           suffix_key: torch.Tensor, suffix_value: torch.Tensor, *, scale: float | None = None,
                           suffix_lengths: torch.Tensor | None = None, suffix_end: torch.Tensor | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None, window: int | None = None,
                           prefix_groups: PrefixGroups | GroupTables | None = None, out: torch.Tensor | None = None,
                           config: KernelConfig | None = None) -> torch.Tensor:
    """Triton relay attention; contract of ``relay_hf.relay_attention`` (fp16, bf16 or fp32; value head dim equal to
    the key head dim; ``scale > 0``).

    ``prefix_groups``: a ``PrefixGroups`` (its device tables are built for this launch shape once and cached on it),
    or the ``GroupTables`` built ahead (the custom op passes those). ``out`` (optional) is a ``[B, H_q, L_q, D]``
    tensor of the query's dtype and device to write into; by default it is allocated as the transpose of a contiguous
    ``[B, L_q, H_q, D]`` buffer, so the HF seam's ``transpose(1, 2).contiguous()`` is free. ``config``: the kernel
    configuration (``None``: the one ``use_config`` set, else ``DEFAULT_CONFIG``). Scratch: partials ``[slots, H_kv,
    B*G*L_q, D]`` (the input dtype for fp16/bf16 with ``partial_half``, else fp32) and fp32 natural-log LSEs
    ``[slots, H_kv, B*G*L_q]``.

    The values of ``suffix_lengths`` and ``suffix_end`` are checked on CPU only (``check_relay_values``): on CUDA that
    would sync the host every layer.
    """
    if config is None:
        config = _ACTIVE_CONFIG.get()
    elif not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a KernelConfig, got {type(config).__name__}")
    check_relay_options(query, softcap, sinks, window)
    if isinstance(prefix_groups, PrefixGroups):
        check_prefix_groups(prefix_groups, query.shape[0], prefix_key.shape[2])
    elif prefix_groups is not None and not isinstance(prefix_groups, GroupTables):
        check_prefix_groups(prefix_groups, query.shape[0], prefix_key.shape[2])  # raises: names the type
    options = _Options(None if prefix_groups is None else _group_shape(prefix_groups), softcap is not None,
                       window or 0, None if sinks is None else sinks.dtype)
    key = _launch_key(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end, config,
                      options)
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _Launch(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end,
                         config, options)
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.pop(next(iter(_LAUNCHES)))
        _LAUNCHES[key] = launch
    if launch.check_values:
        check_relay_values(launch.L_q, launch.L_s, suffix_lengths, suffix_end)
    if scale is None:
        scale = default_scale(query.shape[-1])
    elif not scale > 0:  # the kernels fold the scale into exp2 after the row max, which needs scale > 0
        raise ValueError(f"the Triton relay kernel needs scale > 0, got {scale}; use relay_attention_torch")
    # with a softcap the scale goes inside the cap and the capped scores are natural-log logits
    scale_log2, cap, cap_scale = ((LOG2E, float(softcap), scale / softcap) if softcap is not None
                                  else (scale * LOG2E, 0.0, 0.0))
    B, L_q, H_q, D = launch.out_shape
    if out is None:
        out = torch.empty(launch.out_shape, dtype=launch.dtype, device=launch.device).transpose(1, 2)
    elif out.shape != (B, H_q, L_q, D) or out.dtype != launch.dtype or out.device != launch.device:
        raise ValueError(f"out must be a {launch.dtype} [{B}, {H_q}, {L_q}, {D}] tensor on {launch.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if launch.empty:
        return out
    po = torch.empty(launch.po_shape, dtype=launch.po_dtype, device=launch.device)
    plse = torch.empty(launch.plse_shape, dtype=torch.float32, device=launch.device)
    kd, vd = launch.descriptors(prefix_key, prefix_value)
    tma = kd is not None
    q_st, sk_st, sv_st, o_st = query.stride(), suffix_key.stride(), suffix_value.stride(), out.stride()
    lens = plse if suffix_lengths is None else suffix_lengths  # placeholders, never read when absent
    end = plse if suffix_end is None else suffix_end
    if prefix_groups is None:
        items = rows = row_prefix = plse
    elif isinstance(prefix_groups, GroupTables):
        items, rows, row_prefix = prefix_groups.items, prefix_groups.rows, prefix_groups.row_prefix
    else:
        items, rows, row_prefix = prefix_groups.tables(launch.device, *launch.table_shape)
    sink = plse if sinks is None else sinks
    args = (query, prefix_key, prefix_value, kd, vd, suffix_key, suffix_value, lens, end, po, plse, out, items, rows,
            row_prefix, sink, q_st, launch.pk_st, launch.pv_st, sk_st, sv_st, o_st, launch.dims, scale_log2, cap,
            cap_scale, launch.prefix_plan, launch.suffix_plan)
    reuse_key = None
    if launch.reuse:
        # Triton specialises a kernel on its arguments' values (a unit stride, multiples of 16, 16-byte aligned
        # pointers): the plan key fixes all but the strides and alignment of these tensors, so those are this key;
        # scratch (po, plse) comes from the caching allocator, always aligned
        aligned = (query.data_ptr() | prefix_key.data_ptr() | prefix_value.data_ptr() | suffix_key.data_ptr()
                   | suffix_value.data_ptr() | lens.data_ptr() | end.data_ptr() | out.data_ptr() | items.data_ptr()
                   | rows.data_ptr() | row_prefix.data_ptr() | sink.data_ptr()) % 16 == 0
        if aligned:
            reuse_key = (torch.cuda.current_device(), tma, q_st, sk_st, sv_st, o_st)
            compiled = launch.compiled.get(reuse_key)
            if compiled is not None:
                kernels, direct = compiled
                tma_key = (prefix_key.data_ptr(), prefix_value.data_ptr()) if tma else None
                for (grid, _), tail, kernel, fast in zip(launch.launches[tma], launch.tails[tma], kernels, direct):
                    if not fast.launch(args, tma_key):
                        kernel[grid](*args, *tail)
                if launch.merge is not None:
                    merge_args = (po, plse, out, sink, o_st, *launch.merge[1])
                    if not direct[-1].launch(merge_args, None):
                        kernels[-1][launch.merge[0]](*merge_args, *launch.merge_tail)
                return out
    compiled = [_partials_kernel[grid](*args, **flags) for grid, flags in launch.launches[tma]]
    if launch.merge is not None:
        grid, sizes, flags = launch.merge
        compiled.append(_merge_kernel[grid](po, plse, out, sink, o_st, *sizes, **flags))
    if reuse_key is not None and all(isinstance(k, CompiledKernel) for k in compiled):
        if len(launch.compiled) >= _MAX_COMPILED:
            launch.compiled.pop(next(iter(launch.compiled)))
        grids = [grid for grid, _ in launch.launches[tma]] + ([launch.merge[0]] if launch.merge is not None else [])
        tails = list(launch.tails[tma]) + ([launch.merge_tail] if launch.merge is not None else [])
        index = torch.cuda.current_device()
        direct = tuple(_Direct(k, g, t, index) for k, g, t in zip(compiled, grids, tails, strict=True))
        launch.compiled[reuse_key] = (tuple(compiled), direct)
    return out


def bytes_moved(B: int, H_q: int, H_kv: int, L_q: int, P: int, L_s: int, D: int, itemsize: int) -> int:
    """Fewest bytes relay attention must move: prefix K/V once, every suffix K/V, the queries and the output."""
    return itemsize * (2 * H_kv * P * D + 2 * B * H_kv * L_s * D + 2 * B * H_q * L_q * D)


__all__ = ["DEFAULT_CONFIG", "KernelConfig", "active_config", "bytes_moved", "grouped_launch_shape",
           "plan_group_splits", "plan_splits", "plan_suffix_splits", "relay_attention_triton", "triton_available",
           "use_config"]
