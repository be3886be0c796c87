"""The Triton relay kernels against the float64 reference: CPU interpreter on small shapes (CI), CUDA at full size.

Each call writes into an output poisoned with NaN, so an element the kernel fails to write fails the test.
"""

import itertools

import pytest
import torch

from relay_hf.kernels import triton_relay
from relay_hf.kernels.triton_relay import PARTIAL_BUDGET, plan_splits, plan_suffix_splits, relay_attention_triton
from tests.conftest import dense_reference, rel_err
from tests.kernels.test_reference import make_inputs

pytestmark = pytest.mark.skipif(not triton_relay.triton_available(), reason="triton cannot run here")
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_poisoned(q, pk, pv, sk, sv, lengths, end=None):
    B, H_q, L_q, D = q.shape
    out = torch.full((B, L_q, H_q, D), float("nan"), dtype=q.dtype, device=q.device).transpose(1, 2)
    res = relay_attention_triton(q, pk, pv, sk, sv, suffix_lengths=lengths, suffix_end=end, out=out)
    assert res.data_ptr() == out.data_ptr()
    return res


def check(B, H_kv, G, L_q, L_s, P, D, dtype, padded, seed=0, device=DEVICE):
    inputs = [t.to(device) if t is not None else None
              for t in make_inputs(B, H_kv, G, L_q, L_s, P, D, dtype=dtype, padded=padded, seed=seed)]
    out = run_poisoned(*inputs)
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


LAYOUTS = {"one launch": dict(SEPARATE_ROWS=(0, -1)),
           "separate, fused merge": dict(SEPARATE_ROWS=(1, 1 << 30), FUSED_MERGE_SLOTS=32),
           "separate, merge launch": dict(SEPARATE_ROWS=(1, 1 << 30), FUSED_MERGE_SLOTS=0),
           "fp32 partials": dict(PARTIAL_HALF=False)}


@pytest.fixture(params=list(LAYOUTS))
def layout(request, monkeypatch):
    """Each launch layout of ``relay_attention_triton`` (normally chosen by the row count), forced."""
    for name, value in LAYOUTS[request.param].items():
        monkeypatch.setattr(triton_relay, name, value)
    return request.param


@pytest.mark.parametrize("dtype,G,L_q,P,L_s", [(torch.float32, 4, 1, 37, 9), (torch.bfloat16, 3, 2, 70, 12),
                                               (torch.float16, 8, 1, 150, 5), (torch.float32, 2, 3, 0, 9)])
def test_every_layout_matches_reference(layout, dtype, G, L_q, P, L_s):
    check(3, 2, G, L_q, L_s, P, 64, dtype, padded=True, seed=G + P)


def test_empty_row_without_prefix_is_zero():
    out, _ = check(2, 1, 2, 1, 5, 0, 64, torch.float32, padded=True)
    assert out[0].abs().max() == 0  # row 0 has no valid suffix token and there is no prefix


def test_split_plan_fills_the_gpu_and_bounds_partials():
    assert plan_splits(P=0, N=4, H_kv=8, block_m=16, block_n=64, num_sms=132)[0] == 0
    splits, per = plan_splits(P=4096, N=4, H_kv=8, block_m=16, block_n=64, num_sms=132)
    assert splits * 8 >= 132 and splits * per * 64 >= 4096
    splits, per = plan_splits(P=4096, N=128, H_kv=8, block_m=64, block_n=64, num_sms=132)
    assert splits * 128 * PARTIAL_BUDGET <= 4096 and splits * per * 64 >= 4096
    assert plan_splits(P=10, N=512, H_kv=8, block_m=64, block_n=64, num_sms=132) == (1, 1)


def test_suffix_splits_only_when_the_batch_leaves_sms_idle():
    assert plan_suffix_splits(L_s=256, units=32, H_kv=8, block_n=64, num_sms=132) == (1, 4)
    splits, per = plan_suffix_splits(L_s=256, units=1, H_kv=8, block_n=64, num_sms=132)
    assert splits == 4 and per == 1  # B = 1: one tile per program
    splits, per = plan_suffix_splits(L_s=1, units=1, H_kv=8, block_n=64, num_sms=132)
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
    check(B, 8, 4, 1, L_s, 4096, 128, dtype, padded=True, seed=B)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(TOL))
def test_two_runs_are_bitwise_identical(layout, dtype):
    inputs = [t.cuda() for t in make_inputs(32, 8, 4, 1, 256, 4096, 128, dtype=dtype, padded=True, seed=11)]
    a = run_poisoned(*inputs)
    b = run_poisoned(*inputs)
    assert torch.equal(a, b)


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
