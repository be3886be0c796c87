"""relay_hf.paged: one continuous-batching step laid out from a paged cache's read index, against float64 attention
over each request's whole KV (fresh random inputs)."""

import pytest
import torch

from relay_hf.kernels import AttentionOptions
from relay_hf.paged import paged_relay_attention, paged_step


def _step(g, requests, tokens=420, H_kv=2, G=2, D=8):
    """A paged cache of ``tokens`` physical rows and one step of ``requests``: per request, the physical rows it
    reads (shared ones first) and its query count. Returns the read index, cu_q, cu_k, the cache and queries."""
    cache_k = torch.randn(tokens, H_kv, D, generator=g, dtype=torch.float64)
    cache_v = torch.randn(tokens, H_kv, D, generator=g, dtype=torch.float64)
    rows = [torch.tensor(r, dtype=torch.int64) for r, _ in requests]
    cu_q, cu_k = [0], [0]
    for r, q in zip(rows, (q for _, q in requests)):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + len(r))
    query = torch.randn(1, H_kv * G, cu_q[-1], D, generator=g, dtype=torch.float64)
    return torch.cat(rows), cu_q, cu_k, cache_k, cache_v, query


def _reference(query, read, cu_q, cu_k, cache_k, cache_v, scale, softcap=None):
    """Each request's queries over its whole KV, causal and bottom-right aligned: ``[1, T, H_q, D]``."""
    H_q = query.shape[1]
    out = torch.zeros(query.shape[2], H_q, cache_v.shape[-1], dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        q = query[0, :, cu_q[i]:cu_q[i + 1]]  # [H_q, Lq, D]
        k = cache_k[read[cu_k[i]:cu_k[i + 1]]].transpose(0, 1).repeat_interleave(H_q // cache_k.shape[1], 0)
        v = cache_v[read[cu_k[i]:cu_k[i + 1]]].transpose(0, 1).repeat_interleave(H_q // cache_k.shape[1], 0)
        Lq, Lk = q.shape[1], k.shape[1]
        s = q @ k.transpose(-1, -2) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(torch.arange(Lk)[None] > torch.arange(Lq)[:, None] + (Lk - Lq), float("-inf"))
        out[cu_q[i]:cu_q[i + 1]] = (s.softmax(-1) @ v).transpose(0, 1)
    return out.unsqueeze(0)


def _run(query, read, cu_q, cu_k, cache_k, cache_v, min_shared, scale=0.3, softcap=None):
    step = paged_step(read, cu_q, cu_k, min_shared, torch.device("cpu"))
    source = step.read_index if step.read_index is not None else read
    key, value = (c[source].transpose(0, 1).unsqueeze(0) for c in (cache_k, cache_v))  # as the cache gathers
    return step, paged_relay_attention(query, key, value, step, AttentionOptions(scale, softcap))


def _r(a, b):
    return list(range(a, b))


# two system prompts (rows 0..99 and 100..159), a document under the first (rows 200..239) read by two decoding
# requests, a request reading nothing shared, decoding requests and prefill chunks mixed
STEP = [
    (_r(0, 100) + _r(300, 305), 1),
    (_r(0, 100) + _r(200, 240) + _r(310, 320), 1),
    (_r(0, 100) + _r(200, 240) + _r(320, 322), 1),
    (_r(100, 160) + _r(330, 337), 1),
    (_r(100, 160) + _r(340, 352), 5),
    (_r(360, 380), 3),
    (_r(0, 100) + _r(380, 381), 1),
    (_r(100, 160) + _r(390, 392), 1),
    (_r(0, 100) + _r(200, 240) + _r(400, 410), 4),
]


def test_a_mixed_step_under_two_prompts_and_a_document_matches_attention_over_each_whole_kv():
    g = torch.Generator().manual_seed(0)
    read, cu_q, cu_k, ck, cv, query = _step(g, STEP)
    step, out = _run(query, read, cu_q, cu_k, ck, cv, min_shared=16)
    torch.testing.assert_close(out, _reference(query, read, cu_q, cu_k, ck, cv, 0.3), rtol=1e-10, atol=1e-10)
    # each run decoding requests share is read once: the first prompt (4 readers), the document under it (2), the
    # second prompt (2); prefilling requests read their whole KV, as stock
    assert step.prefix_length == 100 + 40 + 60
    assert torch.equal(step.read_index[:200], torch.cat([torch.arange(0, 100), torch.arange(200, 240),
                                                          torch.arange(100, 160)]))
    assert step.shared_tokens == 100 * 3 + 40 * 1 + 60 * 1
    assert step.decode.rows == 6 and step.decode.step.groups is not None and len(step.prefill) == 3
    assert step.decode.step.groups.prefix_lengths == (100, 140, 140, 60, 100, 60)


def test_one_prompt_for_every_decode_row_reads_it_once_without_groups():
    g = torch.Generator().manual_seed(1)
    read, cu_q, cu_k, ck, cv, query = _step(g, [(_r(0, 64) + _r(100 + 10 * i, 103 + 10 * i + i), 1)
                                                for i in range(5)])
    step, out = _run(query, read, cu_q, cu_k, ck, cv, min_shared=32)
    torch.testing.assert_close(out, _reference(query, read, cu_q, cu_k, ck, cv, 0.3), rtol=1e-10, atol=1e-10)
    assert step.prefix_length == 64 and step.shared_tokens == 64 * 4 and step.decode.step.groups is None
    assert step.read_index.numel() == 64 + 5 * 7  # the longest own part is 3 + 4 tokens


@pytest.mark.parametrize("min_shared", [65, 1000])
def test_runs_shorter_than_min_shared_are_read_per_request(min_shared):
    g = torch.Generator().manual_seed(2)
    read, cu_q, cu_k, ck, cv, query = _step(g, [(_r(0, 64) + [200 + i], 1) for i in range(3)])
    step, out = _run(query, read, cu_q, cu_k, ck, cv, min_shared=min_shared)
    torch.testing.assert_close(out, _reference(query, read, cu_q, cu_k, ck, cv, 0.3), rtol=1e-10, atol=1e-10)
    assert step.prefix_length == 0 and step.shared_tokens == 0


def test_a_prefilling_request_reads_its_whole_kv_and_decoding_ones_share():
    g = torch.Generator().manual_seed(3)
    read, cu_q, cu_k, ck, cv, query = _step(g, [(_r(0, 40), 8), (_r(0, 40) + [50], 1), (_r(0, 40) + [51], 1)])
    step, out = _run(query, read, cu_q, cu_k, ck, cv, min_shared=4)
    torch.testing.assert_close(out, _reference(query, read, cu_q, cu_k, ck, cv, 0.3), rtol=1e-10, atol=1e-10)
    assert step.prefix_length == 40 and step.prefill == ((0, 8, 42, 82),) and step.shared_tokens == 40


def test_a_step_that_reads_no_cache_lays_out_its_new_tokens():
    g = torch.Generator().manual_seed(4)
    lengths = [5, 1, 9]
    cu = [0, 5, 6, 15]
    k = torch.randn(1, 2, 15, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 15, 8, generator=g, dtype=torch.float64)
    query = torch.randn(1, 4, 15, 8, generator=g, dtype=torch.float64)
    step = paged_step(torch.zeros(0, dtype=torch.int64), cu, cu, 1, torch.device("cpu"))
    assert step.read_index is None and step.prefix_length == 0
    out = paged_relay_attention(query, k, v, step, AttentionOptions(0.3))
    ref = _reference(query, torch.arange(15), cu, cu, k[0].transpose(0, 1), v[0].transpose(0, 1), 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert sum(lengths) == 15


def test_positions_no_request_owns_get_zeros():
    g = torch.Generator().manual_seed(5)
    read, cu_q, cu_k, ck, cv, query = _step(g, [(_r(0, 40) + [60], 1), (_r(0, 40) + [61], 1)])
    padded = torch.cat([query, torch.randn(1, 4, 3, 8, generator=g, dtype=torch.float64)], 2)
    _, out = _run(padded, read, cu_q, cu_k, ck, cv, min_shared=8)
    assert out.shape == (1, 5, 4, 8) and not out[0, 2:].any()
    torch.testing.assert_close(out[:, :2], _reference(query, read, cu_q, cu_k, ck, cv, 0.3), rtol=1e-10,
                               atol=1e-10)


def test_a_logit_softcap_applies_to_decoding_and_prefilling_requests():
    g = torch.Generator().manual_seed(6)
    read, cu_q, cu_k, ck, cv, query = _step(g, STEP)
    query = query * 8  # scores well past the cap
    _, out = _run(query, read, cu_q, cu_k, ck, cv, min_shared=16, softcap=5.0)
    ref = _reference(query, read, cu_q, cu_k, ck, cv, 0.3, softcap=5.0)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert (out - _reference(query, read, cu_q, cu_k, ck, cv, 0.3)).abs().max() > 1e-3
