"""relay_attention_torch (the CPU path and the kernels' oracle) against a float64 dense reference."""

import itertools

import pytest
import torch

from relay_hf.kernels import reference
from relay_hf.kernels.reference import DEFAULT_REFERENCE_CONFIG, ReferenceConfig, merge_partials, relay_attention_torch
from tests.helpers import dense_reference, make_inputs, rel_err

GRID = list(itertools.product([0, 1, 37, 300], [1, 5], [False, True], [1, 3, 4, 8]))


@pytest.fixture(params=[True, False], ids=["fused prefix", "written-out prefix"])
def prefix_config(request):
    """Both fp32 CPU prefix paths: torch's fused flash kernel and the written-out softmax
    (``ReferenceConfig.fused_prefix``)."""
    if request.param and not reference.HAS_CPU_FLASH:
        pytest.skip("this torch has no fused CPU flash-attention op")
    return ReferenceConfig(fused_prefix=request.param)


@pytest.mark.parametrize("P,L_q,padded,G", GRID)
def test_relay_matches_float64_dense(P, L_q, padded, G, prefix_config):
    q, pk, pv, sk, sv, lengths = make_inputs(4, 2, G, L_q, 9, P, 32, padded=padded, seed=P * 7 + G)
    out = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lengths, config=prefix_config)
    ref = dense_reference(q, pk, pv, sk, sv, suffix_lengths=lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5


def test_empty_rows_without_prefix_are_zero_not_nan():
    q, pk, pv, sk, sv, _ = make_inputs(2, 1, 2, 1, 4, 0, 16)
    out = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=torch.tensor([0, 4]))
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0 and out[1].abs().max() > 0


def test_prefix_chunking_gives_the_same_answer():
    written_out = ReferenceConfig(fused_prefix=False)  # chunking is the written-out path's
    q, pk, pv, sk, sv, lengths = make_inputs(3, 2, 4, 5, 8, 300, 32, padded=True, seed=3)
    whole = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lengths, config=written_out)
    chunks = ReferenceConfig(fused_prefix=False, max_score_elements=2 * 300 * 7)  # 7 query rows per chunk
    chunked = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lengths, config=chunks)
    assert rel_err(chunked, whole) < 1e-6


def test_fused_prefix_lse_is_natural_log_and_matches_the_written_out_pass():
    """The fused CPU op's LSE feeds the merge: it must be the natural-log LSE of the scaled scores, like ours."""
    if not reference.HAS_CPU_FLASH:
        pytest.skip("this torch has no fused CPU flash-attention op")
    assert DEFAULT_REFERENCE_CONFIG.fused_prefix
    q, pk, pv, *_ = make_inputs(3, 2, 4, 5, 8, 300, 32, seed=4)
    out_f, lse_f = reference.prefix_attention_torch(q, pk, pv, 0.3)
    out_w, lse_w = reference.prefix_attention_torch(q, pk, pv, 0.3, ReferenceConfig(fused_prefix=False))
    scores = torch.einsum("bhld,hpd->bhlp", q.double(), pk[0].double().repeat_interleave(4, 0)) * 0.3
    assert torch.allclose(lse_f.double(), torch.logsumexp(scores, -1), atol=1e-5)
    assert torch.allclose(lse_f, lse_w, atol=1e-5) and rel_err(out_f, out_w.double()) < 1e-5


def test_merge_is_the_sigmoid_formula():
    g = torch.Generator().manual_seed(1)
    out_p, out_s = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    lse_p, lse_s = torch.randn(5, generator=g) * 3, torch.randn(5, generator=g) * 3
    merged, lse = merge_partials(out_p, lse_p, out_s, lse_s)
    expect = torch.sigmoid(lse_p - lse_s)[:, None] * out_p + torch.sigmoid(lse_s - lse_p)[:, None] * out_s
    assert torch.allclose(merged, expect, atol=1e-6)
    assert torch.allclose(lse, torch.logaddexp(lse_p, lse_s))


@pytest.mark.parametrize("bad,match", [
    (lambda a: a.update(prefix_key=a["prefix_key"].expand(2, -1, -1, -1)), "one copy"),
    (lambda a: a.update(suffix_key=a["suffix_key"][:, :, :1]), "suffix_value|L_q"),
    (lambda a: a.update(prefix_value=a["prefix_value"].double()), "dtype"),
    (lambda a: a.update(suffix_lengths=torch.ones(2)), "suffix_lengths"),
    (lambda a: a.update(query=a["query"][:, :3]), "multiple"),
    (lambda a: a.update(suffix_end=torch.tensor([2, 3])), "suffix_end"),
    (lambda a: a.update(suffix_end=torch.tensor([2.0])), "suffix_end"),
])
def test_bad_inputs_name_the_problem(bad, match):
    q, pk, pv, sk, sv, _ = make_inputs(2, 2, 2, 2, 4, 3, 8)
    args = dict(query=q, prefix_key=pk, prefix_value=pv, suffix_key=sk, suffix_value=sv)
    bad(args)
    with pytest.raises(ValueError, match=match):
        relay_attention_torch(**args)


@pytest.mark.parametrize("L_q,P", [(1, 0), (1, 37), (3, 5)])
def test_static_buffer_ignores_positions_past_suffix_end(L_q, P):
    q, pk, pv, sk, sv, lengths = make_inputs(4, 2, 3, L_q, 12, P, 16, padded=True, seed=P + L_q)
    end = torch.tensor([7])
    lengths = lengths.clamp(max=7)
    sk[:, :, 7:], sv[:, :, 7:] = 1e4, 1e4  # stale tail of a static buffer (zeros when fresh): must not count
    out = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lengths, suffix_end=end)
    ref = dense_reference(q, pk, pv, sk, sv, suffix_lengths=lengths, suffix_end=end)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5


def test_static_buffer_traced_and_eager_agree(monkeypatch):
    """Eager CPU calls cut a static buffer at ``suffix_end``; the traceable path (as under ``torch.compile``) masks
    the tail instead. Same answer, stale tail included."""
    q, pk, pv, sk, sv, lengths = make_inputs(4, 2, 3, 2, 12, 9, 16, padded=True, seed=11)
    end, lengths = torch.tensor([7]), lengths.clamp(max=7)
    sk[:, :, 7:], sv[:, :, 7:] = 1e4, 1e4
    eager = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lengths, suffix_end=end)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lengths, suffix_end=end)
    assert torch.isfinite(traced).all() and rel_err(eager, traced) < 1e-6


@pytest.mark.parametrize("P,threads", [(37, 1), (37, 2), (300, 2), (64, 3)])
def test_split_fused_passes_equal_the_float64_oracle(P, threads):
    """The fused CPU passes split the prefix's keys across the kernel's batch for more tasks than heads (and run the
    tail that fills no split apart), and the suffix pass adds its mask to the same kernel: every query, padded and
    empty rows included, still gets dense attention's answer."""
    config = ReferenceConfig(min_split_keys=4)
    q, pk, pv, sk, sv, lengths = make_inputs(4, 2, 3, 2, 9, P, 16, padded=True, seed=P)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = relay_attention_torch(q, pk, pv, sk, sv, suffix_lengths=lengths, config=config)
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(out).all()
    assert rel_err(out, dense_reference(q, pk, pv, sk, sv, suffix_lengths=lengths)) < 1e-5
