"""PyTorch reference of relay attention: the CPU path and the oracle the Triton kernel is tested against.

Vocabulary (shared with ``relay_hf.kernels.triton_relay``):

* ``prefix_*``: the shared system-prompt part, stored once for the whole batch.
* ``suffix_*``: each request's own part, left-padded.
* ``lse``: natural-log log-sum-exp of the scaled scores, always fp32 (fp64 for fp64 inputs); ``-inf`` where a
  query sees no key of that part.

Both passes produce ``(out, lse)`` partials; ``merge_partials`` combines them exactly:
``out = sigmoid(lse_p - lse_s) * out_p + sigmoid(lse_s - lse_p) * out_s``.
"""

from __future__ import annotations

import dataclasses

import torch

from .groups import PrefixGroups
from .options import check_relay_options

# torch's fused flash-attention CPU kernel, which returns the natural-log LSE the merge needs (see ReferenceConfig)
HAS_CPU_FLASH = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    """How the PyTorch reference computes (never what): pass one to ``relay_attention_torch(..., config=...)``.

    Attributes:
        fused_prefix: fp32 on CPU: the prefix pass runs torch's fused flash-attention CPU kernel, which never
            materialises the ``[H_kv, N, P]`` scores and is ~3x faster than the two GEMMs + softmax at SmolLM2's decode
            shape (docs/performance.md, CPU section). fp64 (the tests' oracle) and other dtypes always write it out.
        max_score_elements: bound on the fp32 score matrix one written-out prefix chunk materialises (elements), so a
            long prefill does not allocate ``B*G*L_q*P`` floats at once.
        split_tasks, min_split_keys: the fused prefix pass gives each thread at least ``split_tasks`` (head, split)
            tasks, splitting the keys into pieces of at least ``min_split_keys`` (``_fused_prefix``).
    """

    fused_prefix: bool = HAS_CPU_FLASH
    max_score_elements: int = 1 << 26
    split_tasks: int = 2
    min_split_keys: int = 256


DEFAULT_REFERENCE_CONFIG = ReferenceConfig()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation for half types and fp32; fp64 stays fp64 (the tests' oracle)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _is_int_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_relay_inputs(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths,
                       suffix_end=None) -> None:
    """Raise ``ValueError`` naming the first argument whose shape, dtype or device does not fit the contract.

    Reads no tensor data (no host sync): the values of ``suffix_lengths`` and ``suffix_end`` are
    ``check_relay_values``' job."""
    if query.dim() != 4:
        raise ValueError(f"query must be [B, H_q, L_q, D], got shape {tuple(query.shape)}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query dtype {query.dtype} is not supported: relay attention takes fp16, bf16, fp32 or fp64")
    B, H_q, L_q, D = query.shape
    if suffix_key.dim() != 4 or suffix_key.shape[0] != B or suffix_key.shape[-1] != D:
        raise ValueError(f"suffix_key must be [B={B}, H_kv, L_s, D={D}], got {tuple(suffix_key.shape)}")
    H_kv, L_s = suffix_key.shape[1], suffix_key.shape[2]
    if suffix_value.dim() != 4 or suffix_value.shape[:3] != suffix_key.shape[:3]:
        raise ValueError(f"suffix_value must be [B={B}, H_kv={H_kv}, L_s={L_s}, D_v], got "
                         f"{tuple(suffix_value.shape)}")
    D_v = suffix_value.shape[-1]
    if H_kv == 0 or H_q % H_kv:
        raise ValueError(f"H_q={H_q} query heads is not a multiple of H_kv={H_kv} key/value heads")
    if L_q > L_s:
        raise ValueError(f"L_q={L_q} queries but only L_s={L_s} suffix positions: queries are the last suffix tokens")
    pshape = (1, H_kv, prefix_key.shape[2] if prefix_key.dim() == 4 else -1, D)
    if prefix_key.dim() != 4 or tuple(prefix_key.shape) != pshape:
        raise ValueError(f"prefix_key must be [1, H_kv={H_kv}, P, D={D}] (one copy), got {tuple(prefix_key.shape)}")
    if tuple(prefix_value.shape) != (*pshape[:3], D_v):
        raise ValueError(f"prefix_value must be [1, H_kv={H_kv}, P={pshape[2]}, D_v={D_v}] (the value head dim of "
                         f"suffix_value), got {tuple(prefix_value.shape)}")
    for name, t in (("prefix_key", prefix_key), ("prefix_value", prefix_value), ("suffix_key", suffix_key),
                    ("suffix_value", suffix_value)):
        if t.dtype != query.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != query dtype {query.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    if suffix_lengths is not None:
        if suffix_lengths.shape != (B,) or not _is_int_dtype(suffix_lengths.dtype):
            hint = " (a mask? pass its row sums)" if suffix_lengths.dtype == torch.bool else ""
            raise ValueError(f"suffix_lengths must be an integer tensor of shape [{B}], got "
                             f"{suffix_lengths.dtype} {tuple(suffix_lengths.shape)}{hint}")
        if suffix_lengths.device != query.device:
            raise ValueError(f"suffix_lengths is on {suffix_lengths.device} but query is on {query.device}")
    if suffix_end is not None:
        if suffix_end.numel() != 1 or not _is_int_dtype(suffix_end.dtype) or suffix_end.device != query.device:
            raise ValueError(f"suffix_end must be a one-element integer tensor on {query.device}, got "
                             f"{suffix_end.dtype} {tuple(suffix_end.shape)} on {suffix_end.device}")


def check_relay_values(L_q: int, L_s: int, suffix_lengths: torch.Tensor | None,
                       suffix_end: torch.Tensor | None) -> None:
    """Raise ``ValueError`` if ``suffix_end`` is outside ``[L_q, L_s]`` or a ``suffix_lengths`` entry outside
    ``[0, end]`` (``end = suffix_end`` or ``L_s``).

    Only where reading the values is free: CPU tensors in an eager call. On CUDA (and while ``torch.compile`` traces
    or a CUDA graph captures) reading them would sync the host every layer, so there they are the caller's contract;
    out of range, the Triton kernels still read only inside the buffers (``end`` is clamped to ``L_s``, lengths to
    ``[0, end]``)."""
    end = L_s
    if suffix_end is not None and suffix_end.device.type == "cpu" and not torch.compiler.is_compiling():
        end = int(suffix_end.reshape(()))
        if not L_q <= end <= L_s:
            raise ValueError(f"suffix_end={end} must be in [L_q={L_q}, L_s={L_s}]: the queries are the last L_q "
                             "filled positions of the suffix buffer")
    elif suffix_end is not None:
        return  # ``end`` lives on the device: the lengths cannot be checked against it without a sync either
    if (suffix_lengths is not None and suffix_lengths.device.type == "cpu" and suffix_lengths.numel()
            and not torch.compiler.is_compiling()):
        lo, hi = (int(x) for x in suffix_lengths.aminmax())
        if lo < 0 or hi > end:
            raise ValueError(f"suffix_lengths must be in [0, {end}] (the filled suffix positions), got values in "
                             f"[{lo}, {hi}]")


def prefix_attention_torch(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                           scale: float, config: ReferenceConfig = DEFAULT_REFERENCE_CONFIG,
                           softcap: float | None = None, prefix_start: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query of the batch against the ONE shared prefix copy.

    Args:
        query: ``[B, H_q, L_q, D]``, at least one query row.
        prefix_key: ``[1, H_kv, P, D]``; prefix_value: ``[1, H_kv, P, D_v]``, same dtype as ``query``.
        softcap: scores become ``softcap * tanh(score / softcap)`` (Gemma 2) before the softmax, or ``None``.
        prefix_start: ``[B, L_q]`` int64, the first prefix position each query sees (a sliding window: ``t - window
            + 1`` for a query at absolute position ``t``; ``>= P`` sees none), or ``None``: the whole prefix.

    Returns:
        ``out_p [B, H_q, L_q, D_v]`` (accumulation dtype) and ``lse_p [B, H_q, L_q]`` (natural log; ``-inf`` when
        ``P == 0``).

    Batch, GQA group and query position are folded into one row dimension (``[H_kv, B*G*L_q, D]``) so that one
    attention call per KV head reads the prefix once for the whole batch (torch's fused CPU flash kernel for fp32
    on CPU with ``config.fused_prefix``; the written-out softmax otherwise).
    """
    B, H_q, L_q, D = query.shape
    H_kv, P, D_v = prefix_key.shape[1], prefix_key.shape[2], prefix_value.shape[-1]
    acc = _acc_dtype(query.dtype)
    if P == 0:
        return (torch.zeros(B, H_q, L_q, D_v, dtype=acc, device=query.device),
                torch.full((B, H_q, L_q), float("-inf"), dtype=acc, device=query.device))
    if prefix_start is not None and query.device.type == "cpu" and not torch.compiler.is_compiling():
        # eager CPU: keep only the prefix positions some query can see (a window far shorter than the prefix reads
        # a window's worth, not the whole prefix)
        lo = min(int(prefix_start.min()), P) if prefix_start.numel() else 0
        if lo > 0:
            prefix_key, prefix_value, prefix_start, P = (prefix_key[:, :, lo:], prefix_value[:, :, lo:],
                                                         prefix_start - lo, P - lo)
        if P == 0:
            return (torch.zeros(B, H_q, L_q, D_v, dtype=acc, device=query.device),
                    torch.full((B, H_q, L_q), float("-inf"), dtype=acc, device=query.device))
    G = H_q // H_kv
    rows = query.view(B, H_kv, G, L_q, D).transpose(0, 1).reshape(H_kv, B * G * L_q, D).to(acc)  # [H_kv, N, D]
    # the fused op needs one head dim for K and V, and a non-empty one, and computes plain softmax attention
    if (config.fused_prefix and query.device.type == "cpu" and query.dtype == torch.float32 and D == D_v
            and D > 0 and softcap is None and prefix_start is None):
        out, lse = _fused_prefix(rows, prefix_key[0], prefix_value[0], scale, config)
    else:
        start = None if prefix_start is None else (  # [H_kv, N, 1]: rows ordered (b, g, i) as ``rows``
            prefix_start.long()[:, None, :].expand(B, G, L_q).reshape(1, B * G * L_q, 1).expand(H_kv, -1, -1))
        out, lse = _prefix_chunks(rows, prefix_key[0].to(acc), prefix_value[0].to(acc), scale,
                                  config.max_score_elements, softcap, start)
    out = out.view(H_kv, B, G, L_q, D_v).transpose(0, 1).reshape(B, H_q, L_q, D_v)
    lse = lse.view(H_kv, B, G, L_q).transpose(0, 1).reshape(B, H_q, L_q)
    return out, lse


def _fused_prefix(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, config: ReferenceConfig
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused CPU flash-attention kernel: ``rows [H_kv, N, D]`` against ``k`` / ``v [H_kv, P, D]`` (fp32),
    ``(out [H_kv, N, D], lse [H_kv, N])``. The kernel runs a task per (batch, head): with fewer heads than
    ``config.split_tasks`` per thread the keys are split into that many batch entries (flash-decoding on the CPU)
    and the splits merged by LSE, so every thread streams the prefix (docs/performance.md, CPU rows)."""
    H_kv, P, D = k.shape
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    splits = 1
    if not torch.compiler.is_compiling():  # a traced graph keeps one call (the thread count is no graph value)
        splits = min(-(-config.split_tasks * torch.get_num_threads() // H_kv), P // config.min_split_keys)
    if splits < 2:
        out, lse = op(rows[None], k[None], v[None], 0.0, False, scale=scale)[:2]  # [1, H_kv, N, D], [1, H_kv, N]
        return out[0], lse[0]
    chunk = P // splits
    ks = k[:, :splits * chunk].reshape(H_kv, splits, chunk, D).transpose(0, 1)  # [splits, H_kv, chunk, D], a view
    vs = v[:, :splits * chunk].reshape(H_kv, splits, chunk, D).transpose(0, 1)
    out, lse = op(rows.expand(splits, -1, -1, -1), ks, vs, 0.0, False, scale=scale)[:2]  # [splits, H_kv, N, D]
    if splits * chunk < P:  # the tail that does not fill a split
        tail_out, tail_lse = op(rows[None], k[None, :, splits * chunk:], v[None, :, splits * chunk:], 0.0, False,
                                scale=scale)[:2]
        out, lse = torch.cat([out, tail_out]), torch.cat([lse, tail_lse])
    total = torch.logsumexp(lse, 0)  # [H_kv, N]
    return (torch.exp(lse - total)[..., None] * out).sum(0), total


def _prefix_chunks(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, max_score_elements: int,
                   softcap: float | None = None, start: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention written out: ``rows [H_kv, N, D]`` against ``k [H_kv, P, D]``, ``v [H_kv, P, D_v]`` (all
    one dtype); ``softcap`` as in ``prefix_attention_torch``; ``start [H_kv, N, 1]`` int64 the first visible prefix
    position of each row, or ``None``.

    Returns ``out [H_kv, N, D_v]`` and ``lse [H_kv, N]`` in that dtype (``-inf`` and zeros for a row that sees no
    prefix position). Rows go in chunks of at most ``max_score_elements`` scores so a long prefill does not
    materialise all ``N * P`` of them.
    """
    H_kv, N, _ = rows.shape
    out = torch.empty(H_kv, N, v.shape[-1], dtype=rows.dtype, device=rows.device)
    lse = torch.empty(H_kv, N, dtype=rows.dtype, device=rows.device)
    step = max(1, max_score_elements // max(1, H_kv * k.shape[1]))
    positions = torch.arange(k.shape[1], device=rows.device)
    for first in range(0, N, step):
        scores = torch.matmul(rows[:, first:first + step], k.transpose(1, 2)) * scale  # [H_kv, n, P]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if start is not None:
            scores = scores.masked_fill(positions < start[:, first:first + step], float("-inf"))
        lse_c = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isinf(lse_c), 0.0, lse_c)
        out[:, first:first + step] = torch.matmul(torch.exp(scores - safe[..., None]), v)
        lse[:, first:first + step] = lse_c
    return out, lse


def suffix_attention_torch(query: torch.Tensor, suffix_key: torch.Tensor, suffix_value: torch.Tensor, scale: float,
                           suffix_lengths: torch.Tensor | None, suffix_end: torch.Tensor | None = None,
                           softcap: float | None = None, window: int | None = None,
                           config: ReferenceConfig = DEFAULT_REFERENCE_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's queries against its own left-padded suffix, causal, GQA without expanding K/V; ``softcap`` as in
    ``prefix_attention_torch``; ``window``: a query sees only keys fewer than ``window`` positions back (its own
    included), or ``None``.

    Args:
        query: ``[B, H_q, L_q, D]``; query ``i`` sits at suffix position ``end - L_q + i``.
        suffix_key: ``[B, H_kv, L_s, D]``; suffix_value: ``[B, H_kv, L_s, D_v]``; row ``b``'s valid keys are the
            last ``suffix_lengths[b]`` of the first ``end`` positions.
        suffix_lengths: ``[B]`` integer, or ``None`` when every position before ``end`` is valid.
        suffix_end: one-element integer tensor ``end`` (a static buffer filled up to there), or ``None``: ``L_s``.
            Eager calls on CPU cut the buffer at ``end``; traced ones mask the tail (no data-dependent shape).
        config: with ``fused_prefix``, fp32 on CPU runs torch's fused flash-attention kernel with the mask added
            (the prefix pass's kernel), not the softmax written out.

    Returns:
        ``out_s [B, H_q, L_q, D_v]`` (accumulation dtype; zero where a query sees no key) and ``lse_s [B, H_q, L_q]``
        (``-inf`` there).
    """
    B, H_q, L_q, D = query.shape
    if suffix_end is not None and suffix_end.device.type == "cpu" and not torch.compiler.is_compiling():
        # eager CPU: reading ``end`` costs no device sync, and the filled part is all a static buffer can show
        end = int(suffix_end.reshape(()))
        suffix_key, suffix_value, suffix_end = suffix_key[:, :, :end], suffix_value[:, :, :end], None
    H_kv, L_s, D_v = suffix_key.shape[1], suffix_key.shape[2], suffix_value.shape[-1]
    G = H_q // H_kv
    acc = _acc_dtype(query.dtype)
    q = query.reshape(B, H_kv, G * L_q, D).to(acc)  # group folded into the query rows
    end = L_s if suffix_end is None else suffix_end.reshape(())  # a tensor stays a tensor: no host sync, traceable
    q_pos = torch.arange(L_q, device=query.device) + (end - L_q)
    k_pos = torch.arange(L_s, device=query.device)
    visible = (k_pos[None, :] <= q_pos[:, None])[None]  # [1, L_q, L_s]
    if window is not None:  # the suffix is contiguous in positions, so buffer distance is token distance
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)[None]
    if suffix_lengths is not None:
        first_valid = (end - suffix_lengths.long()).view(B, 1, 1)  # int64: no int8/uint8 wrap-around
        visible = visible & (k_pos.view(1, 1, L_s) >= first_valid)  # [B, L_q, L_s]
    visible = visible[:, None, None].expand(-1, 1, G, -1, -1).reshape(visible.shape[0], 1, G * L_q, L_s)
    if (config.fused_prefix and query.device.type == "cpu" and query.dtype == torch.float32 and D == D_v and D > 0
            and L_s > 0 and softcap is None and suffix_end is None and not torch.compiler.is_compiling()):
        # torch's fused CPU kernel with the mask added: one call instead of the softmax written out (the prefix
        # pass's kernel; docs/performance.md, CPU rows)
        bias = torch.zeros(visible.shape, dtype=acc).masked_fill_(~visible, float("-inf")).expand(B, 1, -1, -1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, suffix_key, suffix_value, 0.0, False, attn_mask=bias, scale=scale)[:2]  # [B, H_kv, G*L_q, D]
        lse = lse.masked_fill(~visible.any(-1), float("-inf"))  # it reports 0 for a query that sees no key
        return out.view(B, H_q, L_q, D_v), lse.view(B, H_q, L_q)
    scores = torch.matmul(q, suffix_key.to(acc).transpose(2, 3)) * scale  # [B, H_kv, G*L_q, L_s]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H_kv, G*L_q]
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.matmul(probs, suffix_value.to(acc))
    return out.view(B, H_q, L_q, D_v), lse.view(B, H_q, L_q)


def merge_partials(out_p: torch.Tensor, lse_p: torch.Tensor, out_s: torch.Tensor,
                   lse_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of two attention partials over disjoint key sets.

    Args:
        out_p, out_s: ``[..., D]`` partial outputs, each normalised over its own keys.
        lse_p, lse_s: ``[...]`` natural-log LSE of each part; ``-inf`` for an empty part.

    Returns:
        ``(out, lse)``: the merged output (zero where both parts are empty, never NaN) and its LSE.
    """
    lse = torch.logaddexp(lse_p, lse_s)
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    w_p = torch.exp(lse_p - safe)[..., None]  # = sigmoid(lse_p - lse_s)
    w_s = torch.exp(lse_s - safe)[..., None]
    return w_p * out_p + w_s * out_s, lse


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention sinks (gpt-oss): one learned logit per query head joins the softmax denominator once, with no
    value. ``out [B, H_q, L_q, D_v]`` / ``lse [B, H_q, L_q]`` the merged partials, ``sinks [H_q]``: exactly a third
    partial with value 0 and LSE ``sinks``, merged as ``merge_partials`` merges two."""
    sink = sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse)
    return merge_partials(out, lse, torch.zeros_like(out), sink)


def check_prefix_groups(groups, B: int, P: int) -> None:
    """Raise ``ValueError`` unless ``groups`` is a ``PrefixGroups`` for ``B`` rows over ``P`` packed positions."""
    if not isinstance(groups, PrefixGroups):
        raise ValueError(f"prefix_groups must be a relay_hf.kernels.PrefixGroups (GroupTables serve the Triton "
                         f"kernels on CUDA only), got {type(groups).__name__}")
    groups.check(B, P)


def _prefix_start(prefix_length, L_q: int, L_s: int, suffix_lengths: torch.Tensor | None,
                  suffix_end: torch.Tensor | None, window: int, B: int, device) -> torch.Tensor:
    """``[B, L_q]`` int64: the first absolute position each query sees under a sliding ``window``. Query ``i`` of row
    ``b`` is the row's token ``n_b - L_q + i`` after its prefix (``n_b`` its valid suffix tokens; ``prefix_length`` an
    int, or ``[B]`` per row for grouped prefixes), so it sits at absolute position ``t = P_b + n_b - L_q + i`` and sees
    positions ``>= t - window + 1``."""
    if suffix_lengths is not None:
        n = suffix_lengths.long()  # [B]
    elif suffix_end is not None:
        n = suffix_end.reshape(()).long().expand(B)  # every filled position is valid
    else:
        n = torch.full((B,), L_s, device=device)
    base = torch.as_tensor(prefix_length, device=device).long().reshape(-1, 1)  # [1, 1] or [B, 1]
    t = base + n[:, None] - L_q + torch.arange(L_q, device=device)[None]  # [B, L_q]
    return t - window + 1


def grouped_prefix_attention_torch(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                                   scale: float, groups: PrefixGroups,
                                   config: ReferenceConfig = DEFAULT_REFERENCE_CONFIG, softcap: float | None = None,
                                   first_position: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each row against the packed segments it reads (``groups``), merged over its levels.

    Args:
        query: ``[B, H_q, L_q, D]``; prefix_key ``[1, H_kv, P_packed, D]`` / prefix_value ``[1, H_kv, P_packed, D_v]``:
            segment ``j`` at ``groups.offsets[j]``.
        first_position: ``[B, L_q]`` int64, the first absolute position each query sees (a sliding window), or
            ``None``.

    Returns ``out [B, H_q, L_q, D_v]`` (accumulation dtype) and ``lse [B, H_q, L_q]`` (natural log, ``-inf`` for a
    row that reads no segment). Each segment runs ``prefix_attention_torch`` once for all its rows, so it is read
    once per batch.
    """
    B, H_q, L_q, _ = query.shape
    acc = _acc_dtype(query.dtype)
    out = torch.zeros(B, H_q, L_q, prefix_value.shape[-1], dtype=acc, device=query.device)
    lse = torch.full((B, H_q, L_q), float("-inf"), dtype=acc, device=query.device)
    for level in range(groups.depth):  # a row reads at most one segment per level: level 0 is written, not merged
        for j, rows in groups.level_rows(level):
            off, length = (groups.offsets[j], groups.lengths[j]) if j >= 0 else (0, 0)
            if not length:
                continue
            every = len(rows) == B
            idx = None if every else groups.row_index(j, query.device)
            start = None if first_position is None else (
                first_position if every else first_position.index_select(0, idx)) - groups.bases[j]
            o, l_ = prefix_attention_torch(query if every else query.index_select(0, idx),
                                           prefix_key[:, :, off:off + length], prefix_value[:, :, off:off + length],
                                           scale, config, softcap, start)
            if level:
                o, l_ = merge_partials(out if every else out.index_select(0, idx),
                                       lse if every else lse.index_select(0, idx), o, l_)
            if every:
                out, lse = o, l_
            else:
                out.index_copy_(0, idx, o)
                lse.index_copy_(0, idx, l_)
    return out, lse


def relay_attention_torch(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                          suffix_key: torch.Tensor, suffix_value: torch.Tensor, *, scale: float | None = None,
                          suffix_lengths: torch.Tensor | None = None, suffix_end: torch.Tensor | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None, window: int | None = None,
                          prefix_groups: PrefixGroups | None = None, config: ReferenceConfig | None = None
                          ) -> torch.Tensor:
    """Relay attention in PyTorch; same contract as ``relay_hf.relay_attention``. ``config``: how the prefix pass
    computes (``DEFAULT_REFERENCE_CONFIG`` when ``None``).

    ``softcap``, ``sinks`` and ``window`` (Gemma 2, gpt-oss, sliding-window layers; see ``relay_attention``) apply
    to both parts alike: the cap to every score, the window by absolute position (the prefix part of a query at
    position ``t`` covers prefix positions ``[max(0, t - window + 1), P)``), and the sinks once, in the merge.

    Returns ``[B, H_q, L_q, D_v]`` in ``query.dtype``; an empty result (``B``, ``H_q``, ``L_q`` or ``D_v`` zero) is an
    empty tensor of that shape.
    """
    check_relay_inputs(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths, suffix_end)
    check_relay_options(query, softcap, sinks, window)
    B, H_q, L_q, D = query.shape
    check_relay_values(L_q, suffix_key.shape[2], suffix_lengths, suffix_end)
    if prefix_groups is not None:
        check_prefix_groups(prefix_groups, B, prefix_key.shape[2])
    D_v = suffix_value.shape[-1]
    if B * H_q * L_q * D_v == 0:
        return query.new_zeros(B, H_q, L_q, D_v)
    scale = default_scale(D) if scale is None else scale
    config = DEFAULT_REFERENCE_CONFIG if config is None else config
    start = None
    if window is not None:
        lengths = prefix_key.shape[2] if prefix_groups is None else prefix_groups.prefix_lengths
        start = _prefix_start(lengths, L_q, suffix_key.shape[2], suffix_lengths, suffix_end, window, B,
                              query.device)
    if prefix_groups is None:
        out_p, lse_p = prefix_attention_torch(query, prefix_key, prefix_value, scale, config, softcap, start)
    else:
        out_p, lse_p = grouped_prefix_attention_torch(query, prefix_key, prefix_value, scale, prefix_groups, config,
                                                      softcap, start)
    out_s, lse_s = suffix_attention_torch(query, suffix_key, suffix_value, scale, suffix_lengths, suffix_end,
                                          softcap, window, config)
    out, lse = merge_partials(out_p, lse_p, out_s, lse_s)
    if sinks is not None:
        out, _ = add_sinks(out, lse, sinks)
    return out.to(query.dtype)


def default_scale(head_dim: int) -> float:
    """``D ** -0.5``; 1.0 for ``D == 0``, where every score is 0 whatever the scale."""
    return head_dim ** -0.5 if head_dim else 1.0
