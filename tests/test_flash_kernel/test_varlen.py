"""relay-flash3's ``flash_attn_varlen_func``: both implementations (the Triton kernel through the CPU interpreter and
the PyTorch loop) against a float64 oracle written here, one query row at a time with explicit visibility; plus
the options it refuses and the choice of implementation."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from relay_hf.flash import load_kernel

kernel = load_kernel()
varlen = kernel.varlen

# (Lq, Lk) per sequence: chunked prefill spanning several 16-row/16-key interpreter tiles (bottom-right causal), an
# empty sequence in the middle, a full prefill, a sequence with no keys, one with Lq > Lk (causal: its first rows
# see no key), then two padding sequences (cu plateaus)
LAYOUT = ((20, 37), (0, 4), (18, 18), (3, 0), (5, 3), (0, 0), (0, 0))
PAD_Q, PAD_K = 3, 2  # tokens past cu[-1]: NaN, which no output may read
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
needs_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="runs Triton on CPU tensors (interpreter)")


def make_case(h_q, h_kv, d, dtype=torch.float32, layout=LAYOUT, seed=0, sinks=False):
    """Packed random inputs for ``layout``, NaN in the padding tokens; int32 cu_seqlens; sink logits if asked."""
    g = torch.Generator().manual_seed(seed)
    lq, lk = zip(*layout, strict=True)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lq) + PAD_Q, h_q, d, generator=g)
    k, v = (torch.randn(sum(lk) + PAD_K, h_kv, d, generator=g) for _ in range(2))
    q[sum(lq):], k[sum(lk):], v[sum(lk):] = math.nan, math.nan, math.nan
    s_aux = torch.randn(h_q, generator=g) * 2 if sinks else None
    return q.to(dtype), k.to(dtype), v.to(dtype), cu_q, cu_k, s_aux


def oracle(q, k, v, cu_q, cu_k, causal, scale=None, softcap=0.0, s_aux=None):
    """float64, row by row: the keys a query sees are listed explicitly; the sink is one more logit with no value."""
    q, k, v = q.double(), k.double(), v.double()
    t_q, h_q, d = q.shape
    group = h_q // k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(t_q, h_q, d, dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        lq, lk = qb - qa, kb - ka
        for j in range(lq):
            seen = [t for t in range(lk) if not causal or t <= j + lk - lq]
            for h in range(h_q):
                keys, vals = k[ka:kb, h // group][seen], v[ka:kb, h // group][seen]
                logits = (keys @ q[qa + j, h]) * scale
                if softcap > 0:
                    logits = softcap * torch.tanh(logits / softcap)
                extra = [] if s_aux is None else [float(s_aux[h])]
                if not seen and not extra:
                    continue  # nothing to attend to: zero row
                top = max(logits.tolist() + extra)
                w = torch.exp(logits - top)
                den = w.sum() + sum(math.exp(x - top) for x in extra)
                out[qa + j, h] = (w @ vals) / den
    return out


def check(out, ref, q, cu_q, dtype):
    """Same shape and dtype as q, finite everywhere, zero padding rows, within the dtype's tolerance of ``ref``."""
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    end = int(cu_q[-1])
    assert (out[end:] == 0).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype], err


def seed_of(*params) -> int:
    return zlib.crc32(repr(params).encode())


PATHS = [pytest.param(True, marks=needs_interpreter, id="triton"), pytest.param(False, id="torch")]


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("h_q,h_kv", [(4, 2), (2, 2), (6, 2), (32, 1)], ids=["gqa", "mha", "gqa3", "mqa32"])
@pytest.mark.parametrize("d", [16, 64])
def test_matches_oracle_fp32(use_triton, causal, h_q, h_kv, d):
    """A program holds a GQA group's heads for several tokens: a group of 3 leaves a row of the interpreter's
    16-row tile empty; one of 32 is wider than the tile and runs one head per program."""
    q, k, v, cu_q, cu_k, _ = make_case(h_q, h_kv, d, seed=seed_of(causal, h_q, h_kv, d))
    scale = None if d == 16 else 0.3  # the default D**-0.5 and an explicit one
    out = varlen.varlen_attention(q, k, v, cu_q, cu_k, 20, softmax_scale=scale, causal=causal,
                                  use_triton=use_triton)
    check(out, oracle(q, k, v, cu_q, cu_k, causal, scale), q, cu_q, torch.float32)


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("softcap,sinks", [(5.0, False), (0.0, True), (2.0, True)], ids=["cap", "sink", "both"])
def test_softcap_and_sinks(use_triton, softcap, sinks):
    """D=24 is not a power of two (the kernel masks a padded head dim); a strong cap (2.0) saturates tanh."""
    q, k, v, cu_q, cu_k, s_aux = make_case(4, 2, 24, seed=seed_of(softcap, sinks), sinks=sinks)
    q = q * 3  # large scores, so the cap bends them
    out = varlen.varlen_attention(q, k, v, cu_q, cu_k, 20, causal=True, softcap=softcap, s_aux=s_aux,
                                  use_triton=use_triton)
    ref = oracle(q, k, v, cu_q, cu_k, True, softcap=softcap, s_aux=s_aux)
    check(out, ref, q, cu_q, torch.float32)
    plain = oracle(q, k, v, cu_q, cu_k, True)
    assert (ref - plain).abs().max() > 1e-2  # the option changes the answer, so the check above could fail


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision(use_triton, dtype):
    q, k, v, cu_q, cu_k, s_aux = make_case(4, 2, 32, dtype, seed=seed_of(dtype), sinks=True)
    out = varlen.varlen_attention(q, k, v, cu_q, cu_k, 20, causal=True, s_aux=s_aux, use_triton=use_triton)
    check(out, oracle(q, k, v, cu_q, cu_k, True, s_aux=s_aux), q, cu_q, dtype)


@needs_interpreter
def test_max_seqlen_q_is_not_needed():
    """The grid follows from the shapes: no max_seqlen_q, a larger one (continuous batching pads it to the step's
    tokens when it captures the step) and a smaller one give the exact one's result."""
    q, k, v, cu_q, cu_k, _ = make_case(2, 1, 16, seed=7)
    runs = [varlen.varlen_attention(q, k, v, cu_q, cu_k, m, causal=True, use_triton=True) for m in (20, None, 50, 1)]
    check(runs[0], oracle(q, k, v, cu_q, cu_k, True), q, cu_q, torch.float32)
    assert all(torch.equal(runs[0], other) for other in runs[1:])


@needs_interpreter
def test_tiles_found_over_several_passes(monkeypatch):
    """A program finds its sequence in a prefix sum over the sequences, a few at a time: two per pass here, so the
    layout's seven sequences (empty ones among them) take four passes."""
    monkeypatch.setattr(varlen, "SEQUENCES_PER_PASS", 2)
    q, k, v, cu_q, cu_k, _ = make_case(4, 2, 16, seed=8)
    out = varlen.varlen_attention(q, k, v, cu_q, cu_k, 20, causal=True, use_triton=True)
    check(out, oracle(q, k, v, cu_q, cu_k, True), q, cu_q, torch.float32)


@pytest.mark.parametrize("use_triton", PATHS)
def test_strided_sinks(use_triton):
    """Sink logits as a strided view, NaN between them: one sink per head is read, and the right one."""
    q, k, v, cu_q, cu_k, s_aux = make_case(4, 2, 16, seed=12, sinks=True)
    strided = torch.stack([s_aux, torch.full_like(s_aux, math.nan)], 1)[:, 0]
    assert not strided.is_contiguous()
    out = varlen.varlen_attention(q, k, v, cu_q, cu_k, 20, causal=True, s_aux=strided, use_triton=use_triton)
    check(out, oracle(q, k, v, cu_q, cu_k, True, s_aux=s_aux), q, cu_q, torch.float32)


@pytest.mark.parametrize("use_triton", PATHS)
def test_strided_views_and_int64_cu_seqlens(use_triton):
    """q, k, v as views into one packed qkv projection (non-contiguous token stride); int64 cu_seqlens."""
    q, k, v, cu_q, cu_k, _ = make_case(2, 2, 16, layout=((6, 6), (0, 0), (9, 9)), seed=11)
    t = min(q.shape[0], k.shape[0])  # PAD_Q != PAD_K: trim to a shared token count
    qkv = torch.cat([q[:t], k[:t], v[:t]], dim=1)  # [T, 6, D]
    qv, kv, vv = qkv[:, 0:2], qkv[:, 2:4], qkv[:, 4:6]
    assert not qv.is_contiguous()
    out = varlen.varlen_attention(qv, kv, vv, cu_q.long(), cu_k.long(), 9, causal=True, use_triton=use_triton)
    check(out, oracle(qv, kv, vv, cu_q, cu_k, True), qv, cu_q, torch.float32)


@needs_interpreter
def test_flash_attn_varlen_func_ignores_unknown_kwargs():
    q, k, v, cu_q, cu_k, s_aux = make_case(4, 2, 16, layout=((4, 9), (7, 7)), seed=3, sinks=True)
    out = kernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 9, dropout_p=0.0, causal=True, window_size=[-1, -1],
                                        softcap=None, deterministic=True, s_aux=s_aux, some_future_kwarg=1)
    check(out, oracle(q, k, v, cu_q, cu_k, True, s_aux=s_aux), q, cu_q, torch.float32)


@pytest.mark.parametrize("option,value", [("window_size", (8, 0)), ("dropout_p", 0.1),
                                          ("alibi_slopes", torch.ones(2)), ("block_table", torch.zeros(2, 1)),
                                          ("return_attn_probs", True)])
def test_unsupported_options_raise(option, value):
    q, k, v, cu_q, cu_k, _ = make_case(2, 2, 16, layout=((3, 3),))
    with pytest.raises(ValueError, match=option):
        kernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, **{option: value})


def test_malformed_shapes_raise():
    q, k, v, cu_q, cu_k, _ = make_case(3, 2, 16, layout=((3, 3),))
    with pytest.raises(ValueError, match="multiple"):
        kernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3)
    with pytest.raises(ValueError, match="dtype"):
        kernel.flash_attn_varlen_func(q[:, :2], k.half(), v, cu_q, cu_k, 3, 3)


@pytest.mark.parametrize("interpret,expected", [("1", "_triton_forward"), ("0", "_torch_forward")])
def test_automatic_choice_of_path(monkeypatch, interpret, expected):
    """On a CPU tensor the interpreter setting decides; whichever runs gives the oracle's answer."""
    if torch.cuda.is_available() or not hasattr(varlen.triton, "cdiv"):
        pytest.skip("the choice on a CPU tensor, with Triton importable")
    called = []
    for name in ("_triton_forward", "_torch_forward"):
        real = getattr(varlen, name)
        monkeypatch.setattr(varlen, name, lambda *a, _n=name, _f=real: called.append(_n) or _f(*a))
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q, k, v, cu_q, cu_k, _ = make_case(2, 1, 16, layout=((5, 8),), seed=5)
    out = kernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 8, causal=True)
    assert called == [expected]
    check(out, oracle(q, k, v, cu_q, cu_k, True), q, cu_q, torch.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_func_is_varlen_over_equal_lengths(causal):
    gen = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(2, n, h, 16, generator=gen) for n, h in ((3, 4), (5, 2), (5, 2)))
    out = kernel.flash_attn_func(q, k, v, causal=causal, softmax_scale=0.3)
    keys = k.double().repeat_interleave(2, 2)
    values = v.double().repeat_interleave(2, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), keys) * 0.3
    if causal:  # bottom-right: query j sees keys <= j + 2
        s = s.masked_fill(torch.ones(3, 5, dtype=torch.bool).triu(3), float("-inf"))
    expected = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), values)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_triton_on_cuda_matches_oracle(dtype, d, cu_dtype):
    """int64 cu_seqlens as well: compiled for the device, where the loop's integer types are checked (the CPU
    interpreter does not check them)."""
    q, k, v, cu_q, cu_k, s_aux = make_case(8, 2, d, dtype, seed=seed_of("cuda", d), sinks=True)
    cu_q, cu_k = cu_q.to(cu_dtype), cu_k.to(cu_dtype)
    out = varlen.varlen_attention(*(t.cuda() for t in (q, k, v, cu_q, cu_k)), 20, causal=True, s_aux=s_aux.cuda(),
                                  use_triton=True)
    check(out.cpu(), oracle(q, k, v, cu_q, cu_k, True, s_aux=s_aux), q, cu_q, dtype)


@pytest.mark.gpu
def test_a_captured_call_replays_other_lengths():
    first = make_case(4, 2, 64, torch.bfloat16, seed=1)
    q, k, v, cu_q, cu_k = (t.cuda() for t in first[:5])
    varlen.varlen_attention(q, k, v, cu_q, cu_k, 20, causal=True)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = varlen.varlen_attention(q, k, v, cu_q, cu_k, 20, causal=True)
    other = ((10, 29), (6, 10), (18, 18), (2, 2), (5, 3), (0, 0), (0, 0))
    nq, nk, _, ncu_q, ncu_k, _ = make_case(4, 2, 64, torch.bfloat16, layout=other, seed=2)
    for dst, src in ((q, nq), (k, nk), (v, make_case(4, 2, 64, torch.bfloat16, layout=other, seed=3)[1])):
        dst.fill_(math.nan)
        dst[:len(src)].copy_(src)
    cu_q.copy_(ncu_q)
    cu_k.copy_(ncu_k)
    graph.replay()
    expected = oracle(q.cpu(), k.cpu(), v.cpu(), ncu_q, ncu_k, True)
    check(out.cpu(), expected, q.cpu(), ncu_q, torch.bfloat16)


@pytest.mark.gpu
def test_sequence_counts_share_one_compiled_kernel():
    """The step's sequence count is not specialised on: continuous batching's steps come with ever new counts (1, a
    multiple of 16, any other: three specialisations of an integer), and each compile stalled a serving step."""
    kernel_fn = varlen._varlen_kernel

    def compiled() -> int:
        return sum(len(entry[0]) for entry in kernel_fn.device_caches.values())

    counts = []
    for n in (1, 2, 16, 17, 3):
        layout = ((5, 9), (3, 3)) * (n // 2) + ((4, 6),) * (n % 2)
        q, k, v, cu_q, cu_k, _ = make_case(4, 2, 64, torch.bfloat16, layout=layout, seed=seed_of("count", n))
        out = varlen.varlen_attention(*(t.cuda() for t in (q, k, v, cu_q, cu_k)), None, causal=True, use_triton=True)
        check(out.cpu(), oracle(q, k, v, cu_q, cu_k, True), q, cu_q, torch.bfloat16)
        counts.append(compiled())
    assert counts == [counts[0]] * len(counts)
