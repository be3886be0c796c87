"""``flash_attn_with_kvcache`` for a paged decode step, relay style: shared leading pages read once per group.

Tensors (``B`` requests of the step, ``P`` pages of ``page_size`` tokens, ``M`` block-table columns):

* ``q [B, 1, H_q, D]`` one query per request (fp16, bf16 or fp32), the output has its shape and dtype;
* ``k_cache``/``v_cache [P, page_size, H_kv, D]`` the pages (any strides; K and V may alias one allocation);
* ``k``/``v [B, 1, H_kv, D]`` the step's new K/V, written by this call into token ``cache_seqlens[b]`` of row
  ``b``'s pages (or ``None``: nothing to write, attend to ``cache_seqlens`` tokens);
* ``block_table [B, M]`` int32 page ids (``-1`` unallocated), ``cache_seqlens [B]`` int32 tokens cached before
  this step (``-1``: a padding row, which writes nothing and gets zeros);
* ``s_aux [H_q]`` optional attention-sink logits (natural log, not scaled).

On CUDA (or under ``TRITON_INTERPRET=1``) the step runs as ``grouping.share_groups`` (one program up to 256
rows, by a step's first layer) plus two launches (prefix partials; suffix units that write the new token and merge),
or three where the suffix is split (a merge launch), with static shapes: it can be captured in a CUDA graph. On
Hopper and newer an unsplit suffix launch can start while the prefix launch runs (``Tiles.overlap``). The
groups are derived once per step: by the first layer, recognised by its ``k_cache`` pointer (``_StepGroups``); the
other layers of the step read them. Elsewhere a PyTorch path computes the same attention row by row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
import weakref
from collections import OrderedDict

import torch

from . import grouping

try:
    from . import paged_jit
except ImportError:  # pragma: no cover
    paged_jit = None


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The paged step's tile configs, in one place (``python -m benchmarks.paged --tune`` times variants of them).

    * ``prefix_rows``: query rows of a prefix tile (members x GQA group): the tile reads its shared pages once for
      all of its members (``None``: 128 on Hopper and newer where a row's query is at most a 16-bit head-size-128
      one's bytes, as timed there; else 64: a 128-row tile takes ~96 KB of shared memory at 16-bit head size 128,
      more than some older cards give a program);
    * ``prefix_keys`` / ``suffix_keys``: keys per inner step of the prefix / suffix units;
    * ``max_splits``: the most splits of one KV range (flash-decoding: splits fill the GPU when a step has few units;
      each costs a partial output per row, written and merged);
    * ``prefix_programs``: programs per KV head and split looping over a step's live prefix tiles;
    * ``prefix_warps`` / ``suffix_warps``: warps per program (``None``: prefix 8 from head size 128 up, else 4;
      suffix, whose tile is one request's GQA group, 8 above head size 128, else 4; head size 256 spills at 4);
      key tiles are sized for 16-bit heads of size 128 and narrowed for wider heads and fp32 (the same bytes);
    * ``prefix_stages`` / ``suffix_stages``: software-pipelining depth of the key loops (``None``: Triton's
      default); a suffix unit walks one request's few own pages, so deep pipelines buy it little and their shared
      memory caps how many of its programs an SM holds;
    * ``half_partials``: fp16/bf16 steps keep the prefix partial outputs in the query's dtype (half the bytes those
      fp32 partials write and the merge reads; the LSE stays fp32), at one more rounding of each partial (bf16's
      largest error against the float64 oracle in ``test_half_precision_softcap_and_sinks``: 0.005, 0.003 in fp32);
    * ``suffix_merges``: an unsplit suffix unit merges its row's prefix partials and writes the output (no merge
      launch, no suffix partial); ``False``: a merge launch always;
    * ``overlap``: such a merging suffix launch starts while the prefix launch runs (programmatic dependent launch,
      Hopper and newer): its units stream their own pages beside the prefix units and wait for them only before the
      merge (elsewhere the launches run one after the other)."""

    # the fastest of ``--tune``'s variants on an H100 (128 / 32 requests x 2048 shared + 128 own tokens, 1 and 4
    # prompts): 62 / 38 / 63 us, against 82 / 39 / 84 us without half partials, the one-stage suffix and the overlap
    # (each alone: 71 / 70 / 79 us at 128 requests) and 177 / 41 / 181 us for 32-key tiles, 8 splits and 64-row prefix
    # tiles (docs/performance.md, "What limits it"); fewer splits write fewer partials, wider tiles read the shared
    # pages for more requests at once (at more register spills: 128 rows timed on Hopper only)
    prefix_rows: int | None = None
    prefix_keys: int = 64
    suffix_keys: int = 64
    max_splits: int = 4
    prefix_programs: int = 16
    prefix_warps: int | None = None
    suffix_warps: int | None = None
    prefix_stages: int | None = None
    suffix_stages: int | None = 1
    half_partials: bool = True
    suffix_merges: bool = True
    overlap: bool = True

    def rows_per_tile(self, q: torch.Tensor, k_cache: torch.Tensor) -> int:
        """Members of one prefix tile for a call's ``q [B, 1, H_q, D]`` and ``k_cache [P, page_size, H_kv, D]``."""
        row_bytes = max(16, _pow2(q.shape[3])) * q.element_size()  # one query row as the kernel pads it
        rows = self.prefix_rows or (128 if row_bytes <= 256 and _hopper(q.device) else 64)
        return max(1, rows // _pow2(q.shape[2] // k_cache.shape[2]))


TILES = Tiles()
CPU_SM_COUNT = 4  # the interpreter: few splits


def triton_serves(q: torch.Tensor) -> bool:
    """The Triton kernels run here: ``q`` on CUDA, or Triton's CPU interpreter is on."""
    return paged_jit is not None and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class _StepGroups:
    """The groups of the step in flight per block table, derived by a step's first layer and read by the others.

    The flash interface gives a layer no handle on its step, so a call derives the groups again when it may be the
    first layer of a new step, and reads them otherwise (every layer of a step sees the same block table and
    lengths). A new step is recognised by any of:

    * ``begin_step()`` called since the groups were derived (relay_hf calls it as each forward of a patched model
      starts, so also at the start of a forward captured as a CUDA graph, where the first layer's call is recorded
      deriving them);
    * the block table written in place since (its version counter: transformers refills it for every step);
    * the call is the one that derived them last time (the first layer's ``k_cache`` pointer).

    Deriving again is always correct; reading is correct within a step, and across steps whose block table is
    unchanged (the same requests in the same rows: their shared pages stay complete and shared). Entries are keyed
    by the block table's address, shape and strides and the cache's page layout, and hold the tensor the table lives
    in weakly (a table at a freed one's address is not it); a few are kept (one per table in flight: async batching
    doubles them)."""

    def __init__(self, size: int = 16):
        self._entries: OrderedDict = OrderedDict()
        self._size = size
        self._lock = threading.Lock()
        self.epoch = 0  # begin_step's count

    def begin_step(self) -> None:
        with self._lock:
            self.epoch += 1

    def forget(self) -> None:
        """Drop every entry (their tensors may live in a CUDA graph's memory pool)."""
        with self._lock:
            self._entries.clear()

    def get(self, block_table, past, k_cache, page_size: int, rows_per_tile: int) -> grouping.Groups:
        # not the page count: transformers (5.25) gives each layer a view of one allocation from its own offset, so
        # the layers' views hold different page counts; a key with it made every layer derive the groups again
        key = (block_table.device, block_table.data_ptr(), tuple(block_table.shape), tuple(block_table.stride()),
               tuple(k_cache.shape[1:]), tuple(k_cache.stride()), page_size, rows_per_tile)
        # the tensor the table lives in (a view's base): a table freed and another allocated at its address (a new
        # manager, a user without begin_step) is another table, whatever its version counter says
        owner = block_table if block_table._base is None else block_table._base
        step = (self.epoch, block_table._version)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[3]() is not owner:
                entry = None
            if entry is not None and entry[1] == step and entry[0] != k_cache.data_ptr():
                self._entries.move_to_end(key)
                return entry[2]
        groups = grouping.share_groups(block_table, past, page_size, rows_per_tile)
        tally = _TALLY.get(block_table.device)
        if tally is not None:  # a step seen: counted on the device (in a CUDA graph, at every replay)
            tally.add_(grouping.prefix_reads(groups, past, page_size))
        with self._lock:
            # the first layer of a new step marks itself; a repeat by the marked layer keeps the mark
            first = entry[0] if entry is not None and entry[1] == step else k_cache.data_ptr()
            self._entries[key] = (first, step, groups, weakref.ref(owner))
            self._entries.move_to_end(key)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return groups


_STEP_GROUPS = _StepGroups()


def begin_step() -> None:
    """A forward (a step) begins: the next call per block table derives its groups (``_StepGroups``). Optional:
    without it a step is recognised by its refilled block table."""
    _STEP_GROUPS.begin_step()


def forget_steps() -> None:
    """Drop the groups kept for steps in flight (when the caches and graphs they belong to are gone)."""
    _STEP_GROUPS.forget()


_TALLY: dict = {}  # device -> [3] int64 prefix_reads summed over the steps since read_totals first asked there


def read_totals(device: torch.device) -> tuple[int, int, int]:
    """``(steps, rows, tokens)``: what ``grouping.prefix_reads`` summed on ``device`` over the steps since the first
    call for that device (which starts the tally; counting costs one small addition per step). Synchronises."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tally = _TALLY.setdefault(device, torch.zeros(3, dtype=torch.int64, device=device))
    return tuple(int(x) for x in tally.tolist())


@functools.cache
def _hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9 or newer: programmatic dependent launch."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(device: torch.device, kv_heads: int, units: int, most: int) -> int:
    """Splits of a KV range so that ``units`` programs per KV head fill the device twice over (flash-decoding), at
    most ``most``."""
    want = -(-2 * _sm_count(device) // max(1, kv_heads * units))
    return max(1, min(most, _pow2(want)))


def paged_relay_triton(q, k_cache, v_cache, k, v, block_table, past, scale, softcap, s_aux, groups=None,
                       prefix_splits=None, suffix_splits=None, tiles: Tiles = TILES):
    """The Triton path (module docstring). ``groups`` (made with ``tiles.rows_per_tile`` at most) and ``*_splits``
    override the derived ones (tests, checks): such a call leaves the step memo and the tally alone."""
    guard = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with guard:  # Triton launches on the current device: make it q's (as flash-attn's own device guard does)
        return _paged_relay_triton(q, k_cache, v_cache, k, v, block_table, past, scale, softcap, s_aux, groups,
                                   prefix_splits, suffix_splits, tiles)


def _paged_relay_triton(q, k_cache, v_cache, k, v, block_table, past, scale, softcap, s_aux, groups, prefix_splits,
                        suffix_splits, tiles):
    batch, _, heads, dim = q.shape
    kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    rows_per_tile = tiles.rows_per_tile(q, k_cache)
    block_d = max(16, _pow2(dim))
    if groups is None:
        groups = _STEP_GROUPS.get(block_table, past, k_cache, page_size, rows_per_tile)
    programs = min(batch, tiles.prefix_programs)
    s_prefix = prefix_splits or _splits(q.device, kv_heads, min(programs, max(1, batch // rows_per_tile)),
                                        tiles.max_splits)
    s_suffix = suffix_splits or _splits(q.device, kv_heads, batch, tiles.max_splits)
    merge = tiles.suffix_merges and s_suffix == 1  # else a merge launch reads the suffix partials too
    # the suffix units' own pages (most of a step's bytes) stream while the prefix units run; they wait before merging
    overlap = merge and tiles.overlap and _hopper(q.device)
    slots = 2 * s_prefix + (0 if merge else s_suffix)
    # no -inf fill: which slots of a row hold a result follows from its groups (paged_jit's docstring)
    po = torch.empty(slots, batch, heads, dim, device=q.device,
                     dtype=q.dtype if tiles.half_partials and q.element_size() == 2 else torch.float32)
    plse = torch.empty(slots, batch, heads, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    # log2-domain factor on q.k; with a softcap it is the tanh's argument scale * log2(e) / softcap instead
    scale_log2 = scale / math.log(2.0) / (softcap if softcap else 1.0)
    # fp32 products in fp32 (exact to the oracle); bf16 too on the CPU interpreter, whose bf16 products are wrong
    ieee = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and not q.is_cuda)
    # wide heads: more warps share a tile's registers (head size 256 spills at 4); key tiles hold at most the bytes of
    # a 16-bit head-size-128 tile (64 fp32 keys at head size 128: ~224 KB of shared memory over three pipeline stages,
    # at an H100's limit; the tuned 16-bit tiles take half)
    warps = 8 if block_d >= 128 else 4
    keys = lambda n: max(16, min(n, n * 256 // (block_d * q.element_size())))  # noqa: E731
    common = dict(BLOCK_D=block_d, SOFTCAP=bool(softcap), IEEE=ieee)
    stages = lambda n: {} if n is None else {"num_stages": n}  # noqa: E731
    paged_jit._prefix_kernel[(programs, kv_heads, s_prefix)](
        q, k_cache, v_cache, block_table, groups.tiles, groups.counts, groups.members, groups.bounds, po, plse,
        _st(q), k_cache.stride(), v_cache.stride(), po.stride(), plse.stride(), batch, block_table.stride(0),
        page_size, group, dim, scale_log2, float(softcap), OVERLAP=overlap, PROGRAMS=programs,
        ROWS_PER_TILE=rows_per_tile, BLOCK_M=max(16, _pow2(rows_per_tile * group)), SPLITS=s_prefix,
        BLOCK_N=keys(tiles.prefix_keys), num_warps=tiles.prefix_warps or warps, **stages(tiles.prefix_stages), **common)
    new_k, new_v = (k, v) if k is not None else (q, q)  # without a new token the pointers are never read
    sinks = s_aux.contiguous() if s_aux is not None else plse  # the kernels read one sink per head, one after another
    paged_jit._suffix_kernel[(batch, kv_heads, s_suffix)](
        q, new_k, new_v, k_cache, v_cache, block_table, past, groups.bounds, po, plse, out, sinks, _st(q),
        _st(new_k), _st(new_v), k_cache.stride(), v_cache.stride(), po.stride(), plse.stride(), _st(out),
        block_table.stride(0), block_table.shape[1] * page_size - (k is not None), page_size, group, dim, scale_log2,
        float(softcap), PREFIX_SPLITS=s_prefix, BLOCK_M=max(16, _pow2(group)), SPLITS=s_suffix,
        BLOCK_N=keys(tiles.suffix_keys), WRITE=k is not None, MERGE=merge, HAS_SINKS=s_aux is not None,
        OVERLAP=overlap, launch_pdl=overlap, num_warps=tiles.suffix_warps or (8 if block_d >= 256 else 4),
        **stages(tiles.suffix_stages), **common)
    if not merge:
        paged_jit._merge_kernel[(batch, heads)](po, plse, out, sinks, groups.bounds, po.stride(), plse.stride(),
                                                _st(out), dim, slots, PREFIX_SPLITS=s_prefix, BLOCK_S=_pow2(slots),
                                                BLOCK_D=block_d, HAS_SINKS=s_aux is not None)
    return out


def _st(x: torch.Tensor) -> tuple[int, int, int]:
    """Strides of a ``[B, 1, H, D]`` tensor over b, h, d."""
    return x.stride(0), x.stride(2), x.stride(3)


def paged_attention_torch(q, k_cache, v_cache, k, v, block_table, past, scale, softcap, s_aux):
    """The PyTorch path: the same write and attention, row by row (host-synchronising; not for CUDA graphs)."""
    page_size = k_cache.shape[1]
    valid = past >= 0
    if k is not None:
        rows = torch.nonzero(valid & (block_table.gather(1, (past.clamp(min=0) // page_size)[:, None].long())[:, 0]
                                      >= 0)).flatten()
        pos = past[rows].long()
        pages = block_table[rows, pos // page_size].long()
        k_cache[pages, pos % page_size] = k[rows, 0].to(k_cache.dtype)
        v_cache[pages, pos % page_size] = v[rows, 0].to(v_cache.dtype)
    seq = torch.where(valid, past + (1 if k is not None else 0), 0).tolist()
    out = torch.zeros_like(q)
    group = q.shape[2] // k_cache.shape[2]
    for b, n in enumerate(seq):
        if n <= 0:
            continue
        t = torch.arange(n, device=q.device)
        pages = block_table[b, t // page_size].long()
        keys = k_cache[pages, t % page_size].float().repeat_interleave(group, 1)  # [n, H_q, D]
        values = v_cache[pages, t % page_size].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[b, 0].float(), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if s_aux is not None:
            scores = torch.cat([scores, s_aux.float()[:, None]], 1)
        weights = torch.softmax(scores, -1)[:, :n]
        out[b, 0] = torch.einsum("hn,nhd->hd", weights, values).to(q.dtype)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            s_aux=None, **kwargs):
    """flash-attn 2's ``flash_attn_with_kvcache`` for one query per request over a paged cache (module docstring).

    ``causal`` changes nothing for one query (it sees every cached token). Returns ``[B, 1, H_q, D]`` in ``q``'s
    dtype. What it does not implement, and malformed arguments, raise ``ValueError`` (rotary embedding, cache index
    remapping, left padding, ALiBi, sliding windows, returning the LSE, more than one query per request). As in
    flash-attn, ``cache_seqlens`` must fit the block table's pages; that is checked where it costs no host
    synchronisation (CPU tensors); on CUDA a row past its table's pages reads and writes nothing outside the table
    (its output is then meaningless, as flash-attn's)."""
    unsupported = {"rotary_cos": rotary_cos is not None, "rotary_sin": rotary_sin is not None,
                   "cache_batch_idx": cache_batch_idx is not None, "cache_leftpad": cache_leftpad is not None,
                   "alibi_slopes": alibi_slopes is not None, "return_softmax_lse": bool(return_softmax_lse),
                   "window_size": tuple(window_size or (-1, -1)) != (-1, -1)}
    named = [name for name, given in unsupported.items() if given]
    if named:
        raise ValueError(f"relay-flash3's flash_attn_with_kvcache does not implement {', '.join(named)}")
    if block_table is None or cache_seqlens is None:
        raise ValueError("relay-flash3's flash_attn_with_kvcache needs a paged cache: block_table and cache_seqlens")
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
    _check_call(q, k_cache, v_cache, k, v, block_table, cache_seqlens, s_aux)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    softcap = float(softcap or 0.0)
    if q.numel() == 0:
        return torch.empty_like(q)
    # the kernels step along a table row and the lengths by one element (transformers' tensors already are so)
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    args = (q, k_cache, v_cache, k, v, block_table, cache_seqlens.contiguous(), scale, softcap, s_aux)
    return paged_relay_triton(*args) if triton_serves(q) else paged_attention_torch(*args)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_call(q, k_cache, v_cache, k, v, block_table, cache_seqlens, s_aux) -> None:
    """``ValueError`` naming what ``flash_attn_with_kvcache``'s tensors get wrong (shapes, dtypes, ranks)."""
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"relay-flash3 serves one query per request (q [B, 1, H_q, D]); got q of shape "
                         f"{tuple(q.shape)}")
    if (k is None) != (v is None):
        raise ValueError("relay-flash3: pass both k and v, or neither")
    if (k_cache.dim() != 4 or tuple(v_cache.shape) != tuple(k_cache.shape) or k_cache.shape[2] < 1
            or q.shape[2] % k_cache.shape[2] or q.shape[3] != k_cache.shape[3] or not 0 < q.shape[3] <= 256):
        raise ValueError(f"relay-flash3: caches [P, page, H_kv, D] with H_kv >= 1 dividing the query heads "
                         f"{q.shape[2]}, and one head size (1 to 256) for queries, keys and values; got q "
                         f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"relay-flash3: q, k_cache and v_cache must share one of fp16, bf16, fp32; got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    rows = q.shape[0]
    new_shape = (rows, 1, k_cache.shape[2], k_cache.shape[3])
    if (block_table.dim() != 2 or block_table.shape[0] != rows or block_table.shape[1] < 1
            or tuple(cache_seqlens.shape) != (rows,)
            or (k is not None and (tuple(k.shape) != new_shape or tuple(v.shape) != new_shape))):
        raise ValueError(f"relay-flash3: q {tuple(q.shape)} needs block_table [{rows}, M >= 1], cache_seqlens "
                         f"[{rows}] and k, v {list(new_shape)}; got {tuple(block_table.shape)}, "
                         f"{tuple(cache_seqlens.shape)}, {None if k is None else tuple(k.shape)}")
    if any(t.dtype.is_floating_point or t.dtype.is_complex for t in (block_table, cache_seqlens)):
        raise ValueError(f"relay-flash3: block_table and cache_seqlens hold integers; got {block_table.dtype}, "
                         f"{cache_seqlens.dtype}")
    if s_aux is not None and tuple(s_aux.shape) != (q.shape[2],):
        raise ValueError(f"relay-flash3: s_aux holds one sink logit per query head ([{q.shape[2]}]); got "
                         f"{tuple(s_aux.shape)}")
    if not cache_seqlens.is_cuda and rows:  # on CUDA this would wait for the device
        capacity = block_table.shape[1] * k_cache.shape[1] - (k is not None)
        if int(cache_seqlens.max()) > capacity:
            raise ValueError(f"relay-flash3: cache_seqlens up to {int(cache_seqlens.max())} do not fit the block "
                             f"table's {block_table.shape[1]} pages of {k_cache.shape[1]} tokens"
                             f"{' with the new token' if k is not None else ''}")
