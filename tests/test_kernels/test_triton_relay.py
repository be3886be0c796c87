"""The Triton relay kernels against the float64 reference: CPU interpreter on small shapes (CI), CUDA at full size.

Each call writes into an output poisoned with NaN, so an element the kernel fails to write fails the test.
"""

import dataclasses
import itertools

import pytest
import torch

from relay_hf.kernels import triton_relay
from relay_hf.kernels.layout import block_d, launch_layout
from relay_hf.kernels.tma import prefix_descriptors
from relay_hf.kernels.triton_relay import DEFAULT_CONFIG, prefix_split_count, relay_attention_triton, suffix_split_count
from tests.helpers import dense_reference, make_inputs, rel_err

pytestmark = pytest.mark.skipif(not triton_relay.triton_available(), reason="triton cannot run here")
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_poisoned(q, pk, pv, sk, sv, lengths, end=None, config=None):
    B, H_q, L_q, D = q.shape
    out = torch.full((B, L_q, H_q, D), float("nan"), dtype=q.dtype, device=q.device).transpose(1, 2)
    res = relay_attention_triton(q, pk, pv, sk, sv, suffix_lengths=lengths, suffix_end=end, out=out, config=config)
    assert res.data_ptr() == out.data_ptr()
    return res


def check(B, H_kv, G, L_q, L_s, P, D, dtype, padded, seed=0, device=DEVICE, config=None):
    inputs = [t.to(device) if t is not None else None
              for t in make_inputs(B, H_kv, G, L_q, L_s, P, D, dtype=dtype, padded=padded, seed=seed)]
    out = run_poisoned(*inputs, config=config)
    ref = dense_reference(*inputs[:5], suffix_lengths=inputs[5])
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite output"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"rel err {err:.2e}"
    return out, inputs


# Interpreter grid (CI): every dtype, head dim, GQA ratio, P in {0, 1, many}, decode and append, empty rows.
CPU_GRID = [
    *[(dt, 64, 4, 1, 37, True) for dt in TOL],
    *[(dt, 128, 3, 5, 70, True) for dt in TOL],
    *[(torch.float32, D, 2, 1, 20, False) for D in (64, 96, 128, 256)],
    *[(torch.float16, 64, G, 2, 9, True) for G in (1, 2, 3, 4, 5, 6, 7, 8)],
    *[(torch.float32, 64, 4, L_q, P, True) for L_q, P in itertools.product((1, 4), (0, 1))],
]


@pytest.mark.parametrize("dtype,D,G,L_q,P,padded", CPU_GRID)
def test_kernel_matches_reference(dtype, D, G, L_q, P, padded):
    check(3, 2, G, L_q, 9, P, D, dtype, padded, seed=D + G + P)


@pytest.mark.parametrize("dtype,L_q,P", [(torch.float32, 1, 37), (torch.bfloat16, 3, 70), (torch.float16, 1, 0)])
def test_static_buffer_reads_only_up_to_suffix_end(dtype, L_q, P):
    """A preallocated suffix filled to ``end``: positions past it hold garbage (NaN here) and must not be read."""
    q, pk, pv, sk, sv, lens = [t.to(DEVICE) if t is not None else None
                               for t in make_inputs(3, 2, 4, L_q, 40, P, 64, dtype=dtype, padded=True, seed=P)]
    end = torch.tensor([23], device=DEVICE)
    lens = lens.clamp(max=23)
    sk[:, :, 23:], sv[:, :, 23:] = float("nan"), float("nan")
    out = run_poisoned(q, pk, pv, sk, sv, lens, end)
    ref = dense_reference(q, pk, pv, sk, sv, suffix_lengths=lens, suffix_end=end)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


# Each launch layout of ``relay_attention_triton`` (normally chosen by the row count), forced by a config.
LAYOUTS = {"one_launch": dict(separate_rows=(0, -1)),
           "separate_fused_merge": dict(separate_rows=(1, 1 << 30), fused_merge_slots=32, fused_merge_tile=1 << 30),
           "separate_merge_launch": dict(separate_rows=(1, 1 << 30), fused_merge_slots=0),
           "fp32_partials": dict(partial_half=False),
           "pointer_loads_no_pdl": dict(separate_rows=(1, 1 << 30), prefix_tma=False, pdl=False),
           "paired_suffix": dict(separate_rows=(1, 1 << 30), fused_merge_slots=32, fused_merge_tile=1 << 30,
                                 suffix_pair_above=0, suffix_pair_min_prefix=0)}


@pytest.fixture(params=list(LAYOUTS))
def layout(request):
    """The ``KernelConfig`` of one forced launch layout."""
    return dataclasses.replace(DEFAULT_CONFIG, **LAYOUTS[request.param])


@pytest.mark.parametrize("dtype,G,L_q,P,L_s", [(torch.float32, 4, 1, 37, 9), (torch.bfloat16, 3, 2, 70, 12),
                                               (torch.float16, 8, 1, 150, 5), (torch.float32, 2, 3, 0, 9)])
def test_every_layout_matches_reference(layout, dtype, G, L_q, P, L_s):
    check(3, 2, G, L_q, L_s, P, 64, dtype, padded=True, seed=G + P, config=layout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strided_prefix_matches_reference(dtype):
    """A prefix laid out ``[1, P, H_kv, D]`` in memory (what a transposed projection gives): the TMA descriptors
    follow its strides."""
    q, pk, pv, sk, sv, lens = [t.to(DEVICE) if t is not None else None
                               for t in make_inputs(3, 2, 4, 1, 9, 150, 64, dtype=dtype, padded=True, seed=5)]
    pk, pv = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (pk, pv))
    assert not pk.is_contiguous() and prefix_descriptors(pk, pv, 64, 64)[0] is not None
    out = run_poisoned(q, pk, pv, sk, sv, lens)
    assert rel_err(out, dense_reference(q, pk, pv, sk, sv, suffix_lengths=lens)) < TOL[dtype]


def test_tma_only_where_it_can_run():
    """Descriptors for fp16/bf16 with an unpadded head dim and 16-byte aligned strides; pointer loads otherwise."""
    def desc(dtype=torch.bfloat16, D=64, P=128):
        t = torch.randn(1, 2, P, D, device=DEVICE).to(dtype)
        return prefix_descriptors(t, t, 64, block_d(D))[0]

    if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        assert desc() is None
        return
    assert desc() is not None
    assert desc(torch.float32) is None and desc(D=96) is None and desc(P=0) is None
    odd = torch.randn(1, 2, 128, 68, device=DEVICE).to(torch.bfloat16)[..., :64]  # 136-byte rows: not 16-aligned
    assert prefix_descriptors(odd, odd, 64, 64)[0] is None


def test_empty_row_without_prefix_is_zero():
    out, _ = check(2, 1, 2, 1, 5, 0, 64, torch.float32, padded=True)
    assert out[0].abs().max() == 0  # row 0 has no valid suffix token and there is no prefix


def test_split_plan_fills_the_gpu_and_bounds_partials():
    assert prefix_split_count(P=0, N=4, H_kv=8, block_m=16, block_n=64, num_sms=132)[0] == 0
    splits, per = prefix_split_count(P=4096, N=4, H_kv=8, block_m=16, block_n=64, num_sms=132)
    assert splits * 8 >= 132 and splits * per * 64 >= 4096
    splits, per = prefix_split_count(P=4096, N=128, H_kv=8, block_m=64, block_n=64, num_sms=132)
    assert splits * 128 * DEFAULT_CONFIG.partial_budget <= 4096 and splits * per * 64 >= 4096
    assert prefix_split_count(P=10, N=512, H_kv=8, block_m=64, block_n=64, num_sms=132) == (1, 1)
    # whole waves: 64 units a split, 2 programs per SM on 132 SMs -> 4 splits (256 programs), not 5 (320)
    kw = dict(P=16384, N=512, H_kv=8, block_m=64, block_n=64, num_sms=132, waves=2, budget=4)
    assert prefix_split_count(**kw, whole_waves=True) == (4, 64) and prefix_split_count(**kw) == (5, 52)


def test_fused_merge_only_for_small_merge_tiles():
    """The suffix launch merges the prefix slots itself only while its ``[rows, slots, D]`` tile stays small: decode
    (4 query rows per KV head, 16-row block) fuses 16 slots; a 64-row append block with as many slots does not. PDL
    only on a device that has it."""
    h200 = dict(num_sms=132, hopper=False)  # an H200's SM count
    decode = launch_layout(B=32, N=128, G=4, L_q=1, P=16384, L_s=256, H_kv=8, D=128, **h200)
    assert decode.sep and decode.p_splits == 16 and decode.s_splits == 1 and decode.fuse and not decode.pdl
    assert launch_layout(B=32, N=128, G=4, L_q=1, P=16384, L_s=256, H_kv=8, D=128, num_sms=132, hopper=True).pdl
    append = launch_layout(B=2, N=128, G=4, L_q=16, P=16384, L_s=32, H_kv=8, D=128, **h200)
    assert append.sep and append.p_splits == 16 and append.s_splits == 1 and not append.fuse


def test_suffix_splits_only_when_the_batch_leaves_sms_idle():
    assert suffix_split_count(L_s=256, units=32, H_kv=8, block_n=64, num_sms=132) == (1, 4)
    splits, per = suffix_split_count(L_s=256, units=1, H_kv=8, block_n=64, num_sms=132)
    assert splits == 4 and per == 1  # B = 1: one tile per program
    splits, per = suffix_split_count(L_s=1, units=1, H_kv=8, block_n=64, num_sms=132)
    assert (splits, per) == (1, 1)


# -- GPU: full sizes, determinism ------------------------------------------------------------------------------------
GPU_GRID = [(dt, D, G, shape) for dt in TOL for D, G, shape in [
    *[(D, 4, (1, 4096)) for D in (64, 96, 128, 256)],
    *[(128, G, (1, 4096)) for G in (1, 3, 7, 8)],
    (128, 4, (64, 512)), (96, 3, (64, 512)), (128, 4, (1, 1)), (64, 7, (3, 0)),
]]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D,G,shape", GPU_GRID)
def test_kernel_matches_reference_on_gpu(dtype, D, G, shape):
    L_q, P = shape
    check(8, 2, G, L_q, 256, P, D, dtype, padded=True, seed=D * G + P)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("B,L_s", [(32, 256), (64, 96), (8, 256)])
def test_every_layout_matches_reference_on_gpu(layout, dtype, B, L_s):
    check(B, 8, 4, 1, L_s, 4096, 128, dtype, padded=True, seed=B, config=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOL))
def test_cuda_graph_replay_matches_eager(layout, dtype):
    """Captured in a CUDA graph (how the compiled decode runs it, PDL edges included) and replayed on new inputs
    copied into the captured buffers: the same output as an eager call."""
    static = [t.cuda() for t in make_inputs(32, 8, 4, 1, 256, 4096, 128, dtype=dtype, padded=True, seed=3)]
    relay_attention_triton(*static[:5], suffix_lengths=static[5], config=layout)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = relay_attention_triton(*static[:5], suffix_lengths=static[5], config=layout)
    fresh = [t.cuda() for t in make_inputs(32, 8, 4, 1, 256, 4096, 128, dtype=dtype, padded=True, seed=4)]
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    assert torch.equal(captured, relay_attention_triton(*fresh[:5], suffix_lengths=fresh[5], config=layout))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOL))
def test_two_runs_are_bitwise_identical(layout, dtype):
    inputs = [t.cuda() for t in make_inputs(32, 8, 4, 1, 256, 4096, 128, dtype=dtype, padded=True, seed=11)]
    a = run_poisoned(*inputs, config=layout)  # the first call compiles; the later ones reuse its compiled kernels
    b = run_poisoned(*inputs, config=layout)
    fresh = run_poisoned(*inputs, config=dataclasses.replace(layout, reuse_compiled=False))  # Triton's launcher
    assert torch.equal(a, b) and torch.equal(a, fresh)


@pytest.mark.gpu
def test_op_compiles_and_captures_in_a_cuda_graph():
    from relay_hf.kernels import relay_attention

    q, pk, pv, sk, sv, lens = [t.cuda() for t in make_inputs(4, 2, 4, 1, 64, 300, 64, dtype=torch.bfloat16,
                                                             padded=True, seed=5)]
    eager = relay_attention(q, pk, pv, sk, sv, suffix_lengths=lens)
    compiled = torch.compile(relay_attention, fullgraph=True)(q, pk, pv, sk, sv, suffix_lengths=lens)
    assert torch.equal(eager, compiled)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = relay_attention(q, pk, pv, sk, sv, suffix_lengths=lens)
    q.normal_()
    graph.replay()
    assert torch.equal(captured, relay_attention(q, pk, pv, sk, sv, suffix_lengths=lens))


@pytest.mark.gpu
def test_captured_graph_follows_a_growing_suffix_end():
    """The static-cache contract: a CUDA graph captured once replays correctly as ``end`` and the lengths grow."""
    from relay_hf.kernels import relay_attention

    q, pk, pv, sk, sv, lens = [t.cuda() for t in make_inputs(4, 2, 4, 1, 64, 300, 64, dtype=torch.bfloat16,
                                                             padded=True, seed=6)]
    end = torch.tensor(40, device="cuda")
    lens = lens.clamp(max=40)
    relay_attention(q, pk, pv, sk, sv, suffix_lengths=lens, suffix_end=end)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = relay_attention(q, pk, pv, sk, sv, suffix_lengths=lens, suffix_end=end)
    for _ in range(3):
        end.add_(1)
        lens.add_(1)
        graph.replay()
        ref = dense_reference(q, pk, pv, sk, sv, suffix_lengths=lens, suffix_end=end)
        assert rel_err(captured, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("B,dtype,G,L_q,P,end", [(3, torch.float32, 4, 1, 150, None),
                                                (4, torch.float16, 4, 1, 37, None),
                                                (5, torch.float32, 2, 3, 70, 10),
                                                (2, torch.bfloat16, 8, 2, 0, None)])
def test_paired_suffix_units_match_reference(B, dtype, G, L_q, P, end):
    """Each fused suffix program streams two batch rows (odd B: the last pair's second row is computed, not stored).
    The rule asks for at most one prefix program per SM, which the interpreter's 4 SMs rarely give: plan for more."""
    config = dataclasses.replace(DEFAULT_CONFIG, **LAYOUTS["paired_suffix"], num_sms=1 << 10)
    assert launch_layout(B, B * G * L_q, G, L_q, P, 16, 2, 64, config.num_sms, False, config).pair
    q, pk, pv, sk, sv, lens = [t.to(DEVICE) if t is not None else None
                               for t in make_inputs(B, 2, G, L_q, 16, P, 64, dtype=dtype, padded=True, seed=B + P)]
    end_t = None if end is None else torch.tensor([end], device=DEVICE)
    if end is not None:
        lens = lens.clamp(min=L_q, max=end)
    out = run_poisoned(q, pk, pv, sk, sv, lens, end_t, config=config)
    ref = dense_reference(q, pk, pv, sk, sv, suffix_lengths=lens, suffix_end=end_t)
    assert rel_err(out, ref) < TOL[dtype]


def test_suffix_pairing_rule():
    """On a 132-SM GPU: B=64 decode rows beside a 4096-token prefix pair up (one prefix program per SM, 512 suffix
    programs); not where two prefix programs fill each SM (8192 tokens), where the suffix fits beside the prefix
    (B=32), or where the prefix is short (1024 tokens)."""
    assert launch_layout(64, 256, 4, 1, 4096, 88, 8, 128, 132, True).pair
    assert not launch_layout(64, 256, 4, 1, 8192, 88, 8, 128, 132, True).pair
    assert not launch_layout(32, 128, 4, 1, 4096, 256, 8, 128, 132, True).pair
    assert not launch_layout(64, 256, 4, 1, 1024, 88, 8, 128, 132, True).pair
    never = dataclasses.replace(DEFAULT_CONFIG, suffix_pair_above=None)
    assert not launch_layout(64, 256, 4, 1, 4096, 88, 8, 128, 132, True, never).pair
