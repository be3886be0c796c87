"""``softcap``, ``sinks`` and ``window`` (Gemma 2, gpt-oss, sliding-window layers) in relay attention, against a
float64 oracle written from the definitions: each row's prefix and valid suffix tokens at their absolute positions,
one softmax over the capped scores, the sink logit in its denominator. The PyTorch reference on a fine grid; the
Triton kernels (CPU interpreter, or CUDA) on every launch layout, with and without grouped prefixes."""

import dataclasses
import itertools

import pytest
import torch

from relay_hf.kernels import GroupTables, PrefixGroups, relay_attention, relay_attention_torch, triton_relay
from tests.helpers import make_inputs, oracle_attention, rel_err


def _oracle(q, pk, pv, sk, sv, lengths, end, softcap, sinks, window):
    """Row by row, query by query: the keys a query at absolute position ``t`` sees, one float64 softmax."""
    q, pk, pv, sk, sv = (t.double() for t in (q, pk, pv, sk, sv))
    B, H_q, L_q, D = q.shape
    H_kv, L_s, P = sk.shape[1], sk.shape[2], pk.shape[2]
    end = L_s if end is None else int(end)
    out = torch.zeros(B, H_q, L_q, sv.shape[-1], dtype=torch.float64)
    for b in range(B):
        n = end if lengths is None else int(lengths[b])
        keys = torch.cat([pk[0], sk[b, :, end - n:end]], 1)  # [H_kv, P + n, D] at positions 0 .. P + n - 1
        values = torch.cat([pv[0], sv[b, :, end - n:end]], 1)
        for h in range(H_q):
            kv = h // (H_q // H_kv)
            for i in range(L_q):
                t = P + n - L_q + i
                pos = torch.arange(P + n)
                # the prefix lies before every real query (a padding query, t < P, still sees it: the contract)
                seen = ((pos < P) | (pos <= t)) & ((pos > t - window) if window is not None else True)
                s = (keys[kv] @ q[b, h, i]) * D ** -0.5
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                s = s.masked_fill(~seen, float("-inf"))
                if sinks is not None:
                    s = torch.cat([s, sinks[h].double().view(1)])
                    values_h = torch.cat([values[kv], torch.zeros(1, values.shape[-1], dtype=torch.float64)])
                else:
                    values_h = values[kv]
                if torch.isinf(s).all():
                    continue  # sees nothing: zeros (the relay contract)
                out[b, h, i] = torch.softmax(s, 0) @ values_h
    return out


GRID = list(itertools.product([0, 5, 12], [None, 1, 4, 12, 40], [None, 2.5], [False, True], [1, 3]))


@pytest.mark.parametrize("P,window,softcap,padded,L_q", GRID)
def test_options_match_the_float64_oracle(P, window, softcap, padded, L_q):
    q, pk, pv, sk, sv, lengths = make_inputs(3, 2, 2, L_q, 7, P, 8, padded=padded, seed=P + 3 * L_q)
    sinks = torch.randn(q.shape[1]) if softcap is None else None  # sinks with and without the cap across the grid
    if P == 5:
        sinks = torch.randn(q.shape[1])
    out = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lengths, softcap=softcap, sinks=sinks,
                                window=window)
    ref = _oracle(q, pk, pv, sk, sv, lengths, None, softcap, sinks, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 9])
def test_a_static_buffer_and_a_window_agree_with_the_oracle(window):
    """A static suffix buffer filled up to ``end``: the queries are the last ``L_q`` filled positions, and each
    row's absolute positions come from its valid length."""
    q, pk, pv, sk, sv, lengths = make_inputs(3, 2, 2, 2, 10, 6, 8, padded=True, seed=window)
    end = torch.tensor(8)
    lengths = lengths.clamp(max=8).clamp(min=2)
    out = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lengths, suffix_end=end, window=window)
    torch.testing.assert_close(out.double(), _oracle(q, pk, pv, sk, sv, lengths, end, None, None, window),
                               atol=2e-6, rtol=1e-5)


def test_a_window_larger_than_every_position_is_no_window_and_sinks_only_lower_the_weights():
    q, pk, pv, sk, sv, lengths = make_inputs(2, 2, 2, 1, 5, 9, 8, padded=True, seed=1)
    plain = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lengths)
    torch.testing.assert_close(relay_attention(q, pk, pv, sk, sv, suffix_lengths=lengths, window=1000), plain)
    sunk = relay_attention(q, pk, pv, sk, sv, suffix_lengths=lengths, sinks=torch.full((4,), -1e4))
    torch.testing.assert_close(sunk, plain)  # a sink at -inf in practice changes nothing
    heavy = relay_attention(q, pk, pv, sk, sv, suffix_lengths=lengths, sinks=torch.full((4,), 50.0))
    assert heavy.abs().max() < 1e-6  # a dominant sink takes all the weight (and has no value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(softcap=0.0), "softcap"), (dict(softcap=-1.0), "softcap"),
    (dict(sinks=torch.zeros(3)), "sinks"), (dict(sinks=torch.zeros(4, dtype=torch.long)), "sinks"),
    (dict(window=0), "window"), (dict(window=2.5), "window"), (dict(window=True), "window"),
])
def test_bad_options_name_themselves(kwargs, match):
    q, pk, pv, sk, sv, lengths = make_inputs(2, 2, 2, 1, 5, 4, 8, seed=0)
    with pytest.raises(ValueError, match=match):
        relay_attention(q, pk, pv, sk, sv, **kwargs)


# -- the Triton kernels take the options (CPU interpreter on small shapes, CUDA at a decode shape) -----------------
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# (launch layout, dtype, L_q, P, window, softcap, sinks, static end, grouped)
KERNEL_GRID = [
    ("separate", torch.float32, 1, 40, 9, None, False, False, False),
    ("one_launch", torch.float32, 3, 40, 4, 2.5, True, False, False),
    ("separate", torch.bfloat16, 1, 150, 70, 2.0, False, True, False),  # TMA tiles, capped
    ("merge_launch", torch.float16, 2, 12, 40, None, True, True, False),
    ("separate", torch.float32, 1, 0, 3, 1.5, True, False, False),
    ("separate", torch.bfloat16, 1, 150, None, 3.0, True, False, False),
    ("one_launch", torch.float32, 1, 40, 1, None, False, True, True),
    ("separate", torch.float32, 2, 40, 13, 2.5, True, True, True),
    ("merge_launch", torch.bfloat16, 1, 150, 30, None, True, False, True),
]
KERNEL_LAYOUTS = {"one_launch": dict(separate_rows=(0, -1)),
                  "separate": dict(separate_rows=(1, 1 << 30), fused_merge_slots=32, fused_merge_tile=1 << 30),
                  "merge_launch": dict(separate_rows=(1, 1 << 30), fused_merge_slots=0)}


@pytest.mark.skipif(not triton_relay.triton_available(), reason="triton cannot run here")
@pytest.mark.parametrize("launch,dtype,L_q,P,window,softcap,use_sinks,static,grouped", KERNEL_GRID)
def test_kernel_options_match_the_float64_oracle(launch, dtype, L_q, P, window, softcap, use_sinks, static, grouped):
    q, pk, pv, sk, sv, lengths = (t.to(DEVICE) for t in make_inputs(5, 2, 2, L_q, 12, P, 64, dtype=dtype,
                                                                      padded=True, seed=P + L_q))
    lengths = lengths.clamp(min=L_q)
    end = None
    if static:  # a static buffer filled to 9; what lies beyond is never read
        end = torch.tensor([9], device=DEVICE)
        lengths = lengths.clamp(max=9)
        sk[:, :, 9:], sv[:, :, 9:] = float("nan"), float("nan")
    groups = None
    if grouped:  # two system prompts, a second level under the first, a row with none
        groups = PrefixGroups([P // 2, P // 4, P - P // 2 - P // 4], [(0, 1), (2,), (0,), (), (0, 1)])
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(P)).to(DEVICE) if use_sinks else None
    config = dataclasses.replace(triton_relay.DEFAULT_CONFIG, **KERNEL_LAYOUTS[launch])
    B, H_q, _, D = q.shape
    out = torch.full((B, L_q, H_q, D), float("nan"), dtype=dtype, device=DEVICE).transpose(1, 2)
    triton_relay.relay_attention_triton(q, pk, pv, sk, sv, suffix_lengths=lengths, suffix_end=end, softcap=softcap,
                                        sinks=sinks, window=window, prefix_groups=groups, out=out, config=config)
    ref = oracle_attention(q, pk, pv, sk, sv, lengths, end, softcap, sinks, window, groups)
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite output"
    assert rel_err(out, ref) < KERNEL_TOL[dtype]


def test_the_dispatcher_sends_options_to_the_kernels_on_cuda():
    """Options no longer force the reference: on CUDA the op's output is the kernels' (their launch cache grows)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, pk, pv, sk, sv, lengths = (t.cuda() for t in make_inputs(3, 2, 2, 1, 9, 40, 64, padded=True, seed=7))
    before = len(triton_relay.cached_plans())
    relay_attention(q, pk, pv, sk, sv, suffix_lengths=lengths, softcap=2.0, window=5, sinks=torch.zeros(4).cuda())
    assert len(triton_relay.cached_plans()) == before + 1


@pytest.mark.gpu
def test_the_custom_op_takes_the_options_and_groups_on_cuda():
    """Calls the op records (inputs that require grad; a torch.compile trace) go through
    ``torch.ops.relay_hf.relay_attention`` with the options and the groups' device tables."""
    q, pk, pv, sk, sv, lengths = (t.cuda() for t in make_inputs(5, 2, 2, 1, 12, 40, 64, padded=True, seed=11))
    lengths = lengths.clamp(min=1)
    groups = PrefixGroups([20, 10, 10], [(0, 1), (2,), (0,), (), (0, 1)])
    sinks = torch.randn(4, device="cuda")
    kw = dict(suffix_lengths=lengths, softcap=2.0, sinks=sinks, window=9, prefix_groups=groups)
    ref = oracle_attention(q, pk, pv, sk, sv, lengths, None, 2.0, sinks, 9, groups)
    recorded = relay_attention(q.requires_grad_(), pk, pv, sk, sv, **kw)
    assert rel_err(recorded.detach(), ref) < 1e-4
    block_m, items = triton_relay.grouped_launch_shape(5 * 2, 64, groups)
    tables = GroupTables(*groups.tables(q.device, block_m, 2, items), groups.depth, groups.segments_per_level)
    compiled = torch.compile(lambda *t: relay_attention(*t, **dict(kw, prefix_groups=tables)), fullgraph=True)
    with torch.no_grad():
        assert rel_err(compiled(q.detach(), pk, pv, sk, sv), ref) < 1e-4
        with pytest.raises(Exception, match="GroupTables"):  # a PrefixGroups cannot be read inside the graph
            torch.compile(lambda *t: relay_attention(*t, **kw), fullgraph=True)(q.detach(), pk, pv, sk, sv)


# -- the options object (relay_hf/kernels/options.py) and the step metadata it is planned with ---------------------

def test_options_travel_as_one_object_and_round_trip_through_the_custom_op():
    from relay_hf.kernels.options import AttentionOptions, options_of

    sinks = torch.zeros(4, dtype=torch.bfloat16)
    options = options_of(dict(scale=0.25, softcap=30.0, window=16, sinks=sinks))
    assert options.key == (0.25, 30.0, 16, torch.bfloat16)
    assert AttentionOptions(0.25, 30.0, 16, sinks.float()).key != options.key  # the sinks' dtype is planned for
    back = AttentionOptions.from_op(options.op_values(1.0), sinks)
    assert back.key == options.key and back.sinks is sinks
    assert AttentionOptions.from_op(AttentionOptions().op_values(0.5), None).key == (0.5, None, None, None)
    assert options.without_window().key == (0.25, 30.0, None, torch.bfloat16)
    assert AttentionOptions(0.5).without_window().window is None
    assert options.constexprs() == dict(SOFTCAP=True, WINDOW=16, SINK=True)
    assert not options.plain_softmax and AttentionOptions(0.1).plain_softmax
    with pytest.raises(ValueError, match="scale > 0"):
        AttentionOptions(scale=-1.0).kernel_scalars(1.0)
    with pytest.raises(TypeError, match="alibi"):
        options_of(dict(alibi=torch.zeros(4)))
    sinks.data = sinks.data.float()  # model.to(dtype) changes a parameter's dtype in place: the key follows
    assert options.key == (0.25, 30.0, 16, torch.float32)


@pytest.mark.parametrize("bad,match", [(dict(softcap=0.0), "softcap"), (dict(window=0), "window"),
                                       (dict(sinks=torch.zeros(3)), "sinks")])
def test_options_that_do_not_fit_a_call_are_refused_by_name(bad, match):
    from relay_hf.kernels.options import AttentionOptions

    q = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match=match):
        AttentionOptions(**bad).check(q)
    with pytest.raises(ValueError, match=match):
        relay_attention(q, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), torch.zeros(2, 2, 2, 8),
                        torch.zeros(2, 2, 2, 8), **bad)


def test_step_metadata_with_lengths_keeps_the_shared_plans():
    from relay_hf.kernels import StepMetadata

    plans = {}
    step = StepMetadata(None, None, None, plans)
    lengths = torch.tensor([3, 1])
    given = step.with_lengths(lengths)
    assert given.suffix_lengths is lengths and given.plans is plans and step.suffix_lengths is None
    assert StepMetadata().plans is not StepMetadata().plans  # a fresh holder per step unless one is handed over
