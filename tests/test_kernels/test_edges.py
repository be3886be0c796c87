"""The op's edges: empty inputs, a zero head dim, MLA's value head dim (``D_v != D``), dtypes and argument values
outside the contract. Every entry point either equals the float64 reference or raises a ``ValueError`` naming the
argument; value checks never read a tensor that is not on the CPU (no host sync)."""

import pytest
import torch

from relay_hf.kernels import relay_attention, relay_attention_torch, triton_serves
from relay_hf.kernels.reference import ReferenceConfig, check_relay_values
from relay_hf.kernels.triton_relay import relay_attention_triton, triton_available
from tests.helpers import dense_reference, rel_err

ENTRIES = {"torch": relay_attention_torch, "dispatch": relay_attention}
if triton_available():
    ENTRIES["triton"] = relay_attention_triton


def inputs(B=3, H_kv=2, G=2, L_q=1, L_s=6, P=5, D=16, D_v=None, dtype=torch.float32, lengths=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    D_v = D if D_v is None else D_v
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return dict(query=rnd(B, H_kv * G, L_q, D), prefix_key=rnd(1, H_kv, P, D), prefix_value=rnd(1, H_kv, P, D_v),
                suffix_key=rnd(B, H_kv, L_s, D), suffix_value=rnd(B, H_kv, L_s, D_v), suffix_lengths=lengths)


def oracle(args, scale=None, suffix_end=None):
    return dense_reference(args["query"], args["prefix_key"], args["prefix_value"], args["suffix_key"],
                           args["suffix_value"], scale=scale, suffix_lengths=args["suffix_lengths"],
                           suffix_end=suffix_end)


# -- empty inputs: an empty output of the right shape and dtype (the CPU flash kernel used to die of SIGFPE) --------
@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("dims", [dict(L_q=0), dict(B=0), dict(B=0, P=0), dict(G=0), dict(L_q=0, L_s=0, P=0)],
                         ids=["L_q=0", "B=0", "B=0,P=0", "H_q=0", "nothing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_inputs_give_empty_outputs(entry, dims, dtype):
    args = inputs(dtype=dtype, **dims)
    B, H_q, L_q, D = args["query"].shape
    if B:
        args["suffix_lengths"] = torch.arange(B) % (args["suffix_key"].shape[2] + 1)
    out = ENTRIES[entry](**args)
    assert out.shape == (B, H_q, L_q, D) and out.dtype == dtype and out.numel() == 0


def test_empty_value_head_dim_gives_an_empty_output():
    args = inputs(D_v=0)
    out = relay_attention(**args)
    assert out.shape == (3, 4, 1, 0) and out.dtype == torch.float32


# -- D = 0: every score is 0, so each query averages the values it sees, whatever the scale ----------------------------
@pytest.mark.parametrize("scale", [None, 0.7])
@pytest.mark.parametrize("P", [0, 5])
def test_zero_head_dim_averages_the_visible_values(scale, P):
    args = inputs(D=0, D_v=8, P=P, L_q=2, lengths=torch.tensor([0, 3, 6]), dtype=torch.float64)
    ref = oracle(args, scale=1.0 if scale is None else scale)
    for entry in (relay_attention_torch, relay_attention):
        out = entry(**args, scale=scale)
        assert out.shape == (3, 4, 2, 8) and rel_err(out, ref) < 1e-12


# -- MLA: value head dim != key head dim -------------------------------------------------------------------------------
MLA = [(24, 16, 5, 1, None), (16, 40, 0, 1, None), (24, 16, 37, 3, None), (24, 8, 5, 2, 7), (12, 20, 37, 1, 9)]


@pytest.mark.parametrize("D,D_v,P,L_q,end", MLA)
@pytest.mark.parametrize("G", [1, 3])
def test_value_head_dim_other_than_key_head_dim_is_exact(D, D_v, P, L_q, end, G):
    """DeepSeek-V3 / MiniCPM3 attention hands over values whose head dim differs from the keys': the output is
    ``[B, H_q, L_q, D_v]`` and equals the float64 reference (fp64 inputs: to rounding; fp32: both prefix paths)."""
    lengths = torch.tensor([0, max(L_q - 1, 0), 4, 9])
    args = inputs(B=4, G=G, L_q=L_q, L_s=9, P=P, D=D, D_v=D_v, lengths=lengths, dtype=torch.float64, seed=D + P)
    suffix_end = None if end is None else torch.tensor([end])
    if end is not None:
        args["suffix_lengths"] = lengths.clamp(max=end)
        args["suffix_key"][:, :, end:], args["suffix_value"][:, :, end:] = 1e4, 1e4  # unfilled: must not count
    ref = oracle(args, suffix_end=suffix_end)
    out = relay_attention(**args, suffix_end=suffix_end)
    assert out.shape == (4, 2 * G, L_q, D_v) and rel_err(out, ref) < 1e-12
    fp32 = {k: v.float() if v is not None and v.is_floating_point() else v for k, v in args.items()}
    for fused in (True, False):
        out = relay_attention_torch(**fp32, suffix_end=suffix_end, config=ReferenceConfig(fused_prefix=fused))
        assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-5


def test_mla_calls_are_routed_to_the_reference():
    """``D_v != D`` (and fp64, a zero head dim, a non-positive scale) never reaches the Triton kernels; the kernels
    refuse it by name when called directly."""
    assert triton_serves(torch.bfloat16, 128, 128, None) and triton_serves(torch.float32, 64, 64, 0.1)
    assert not triton_serves(torch.bfloat16, 192, 128, None)  # DeepSeek-V3: qk 192, v 128
    assert not triton_serves(torch.float64, 64, 64, None) and not triton_serves(torch.float16, 0, 0, None)
    assert not triton_serves(torch.float16, 64, 64, -1.0)
    if triton_available():
        with pytest.raises(ValueError, match="D_v"):
            relay_attention_triton(**inputs(D=24, D_v=16))


@pytest.mark.parametrize("bad", ["prefix", "suffix"])
def test_value_head_dims_must_agree(bad):
    args = inputs(D=24, D_v=16)
    name = f"{bad}_value"
    args[name] = args[name][..., :8]
    with pytest.raises(ValueError, match="prefix_value"):
        relay_attention_torch(**args)


# -- dtypes ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_float_tensors_are_refused(entry, dtype):
    args = {k: v.to(dtype) if v is not None else None for k, v in inputs().items()}
    with pytest.raises(ValueError, match="query dtype"):
        ENTRIES[entry](**args)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_bool_suffix_lengths_are_refused(entry):
    """A padding mask handed over as lengths: refused by name, not a torch error deep inside."""
    with pytest.raises(ValueError, match="suffix_lengths.*bool"):
        ENTRIES[entry](**inputs(lengths=torch.tensor([True, False, True])))


# -- values outside the contract: a ValueError on CPU, where reading them is free ------------------------------------
BAD_VALUES = [
    (dict(lengths=[1, 7, 2]), None, "suffix_lengths"),  # more than L_s = 6
    (dict(lengths=[1, -1, 2]), None, "suffix_lengths"),
    (dict(lengths=[1, 5, 2]), 4, "suffix_lengths"),  # more than the filled positions
    (dict(lengths=None), 0, "suffix_end"),  # fewer filled positions than the L_q = 1 queries
    (dict(lengths=None, L_q=3), 2, "suffix_end"),
    (dict(lengths=None), 7, "suffix_end"),  # past the buffer
]


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("dims,end,name", BAD_VALUES)
def test_values_outside_the_contract_are_refused_on_cpu(entry, dims, end, name):
    dims = dict(dims)
    lengths = dims.pop("lengths")
    args = inputs(**dims, lengths=None if lengths is None else torch.tensor(lengths))
    with pytest.raises(ValueError, match=name):
        ENTRIES[entry](**args, suffix_end=None if end is None else torch.tensor([end]))


@pytest.mark.parametrize("dims,end,name", BAD_VALUES)
def test_value_checks_read_no_device_tensor(dims, end, name):
    """Off the CPU the values are the caller's contract: checking them would sync the host every layer. Meta tensors
    stand in for CUDA ones here: they have no data, so any read would raise."""
    dims = dict(dims)
    lengths = dims.pop("lengths")
    args = inputs(**dims, lengths=None if lengths is None else torch.tensor(lengths))
    meta = {k: None if v is None else v.to("meta") for k, v in args.items()}
    end_t = None if end is None else torch.tensor([end], device="meta")
    check_relay_values(meta["query"].shape[2], meta["suffix_key"].shape[2], meta["suffix_lengths"], end_t)
    out = relay_attention_torch(**meta, suffix_end=end_t)
    assert out.device.type == "meta" and out.shape == meta["query"].shape


def test_value_checks_stay_out_of_a_compiled_trace():
    """Under ``torch.compile`` (fullgraph: a data-dependent read would break the graph) the CPU path checks nothing
    and matches the eager result."""
    args = inputs(L_q=2, lengths=torch.tensor([0, 3, 6]))
    end = torch.tensor([5])
    args["suffix_lengths"] = args["suffix_lengths"].clamp(max=5)
    compiled = torch.compile(relay_attention_torch, backend="eager", fullgraph=True)
    out = compiled(**args, suffix_end=end)
    assert rel_err(out, oracle(args, suffix_end=end)) < 1e-5


@pytest.mark.parametrize("dtype,L_s,lengths", [(torch.uint8, 300, [10, 250]), (torch.int8, 200, [10, 100])])
def test_suffix_lengths_of_a_small_integer_dtype_do_not_wrap(dtype, L_s, lengths):
    """``end - lengths`` in int8/uint8 would wrap around (or overflow) for long suffixes; lengths count in int64."""
    args = inputs(B=2, L_s=L_s, P=3, lengths=torch.tensor(lengths, dtype=dtype))
    out = relay_attention_torch(**args)
    assert rel_err(out, oracle(dict(args, suffix_lengths=args["suffix_lengths"].long()))) < 1e-5


def test_lengths_on_another_device_are_refused():
    args = inputs(lengths=torch.tensor([1, 2, 3], device="meta"))
    with pytest.raises(ValueError, match="suffix_lengths is on meta"):
        relay_attention_torch(**args)


# -- GPU ---------------------------------------------------------------------------------------------------------------
def cuda(args):
    return {k: None if v is None else v.cuda() for k, v in args.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_on_gpu_runs_the_reference_exactly(dtype):
    """DeepSeek-V3's head dims (192 for queries and keys, 128 for values): eager and compiled calls on CUDA equal the
    float64 reference."""
    args = cuda(inputs(B=4, G=4, L_q=1, L_s=40, P=300, D=192, D_v=128, dtype=dtype,
                       lengths=torch.tensor([0, 7, 40, 33]), seed=5))
    ref = oracle(args)
    eager = relay_attention(**args)
    compiled = torch.compile(relay_attention, fullgraph=True)(**args)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert eager.shape == (4, 8, 1, 128) and rel_err(eager, ref) < tol and rel_err(compiled, ref) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [dict(L_q=0), dict(B=0), dict(G=0)], ids=["L_q=0", "B=0", "H_q=0"])
def test_empty_inputs_on_gpu(dims):
    args = cuda(inputs(dtype=torch.bfloat16, **dims))
    for entry in (relay_attention, relay_attention_triton):
        out = entry(**args)
        assert out.shape == args["query"].shape and out.numel() == 0 and out.is_cuda


@pytest.mark.gpu
def test_out_of_range_suffix_end_on_gpu_reads_inside_the_buffer():
    """On CUDA the values are not checked (a check would sync the host): a ``suffix_end`` past the buffer is clamped
    to it in the kernel, never read past (the tail here is NaN: any read would show)."""
    args = cuda(inputs(B=4, G=4, L_s=64, P=300, D=64, dtype=torch.bfloat16, lengths=torch.tensor([0, 9, 40, 64])))
    buf_k = torch.full((4, 2, 80, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    buf_v = buf_k.clone()
    buf_k[:, :, :64], buf_v[:, :, :64] = args["suffix_key"], args["suffix_value"]
    args["suffix_key"], args["suffix_value"] = buf_k[:, :, :64], buf_v[:, :, :64]  # views: NaN right after L_s
    past = relay_attention_triton(**args, suffix_end=torch.tensor([70], device="cuda"))
    at_end = relay_attention_triton(**args, suffix_end=torch.tensor([64], device="cuda"))
    assert torch.isfinite(past).all() and torch.equal(past, at_end)
