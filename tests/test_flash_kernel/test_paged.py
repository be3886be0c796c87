"""relay-flash3's paged decode step (``flash_attn_with_kvcache``) against a float64 oracle, on random block tables
with and without shared leading runs; and the groups it derives from a block table."""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
import torch

from relay_hf.flash import load_kernel

kernel = load_kernel()
paged, grouping = kernel.paged, kernel.grouping
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton path: CUDA, else the CPU interpreter


def _on(device, step):
    """The step's tensors on ``device`` (the oracle keeps the CPU originals)."""
    return tuple(t.to(device) for t in step)


def _step(seed, page_size, lens, shared, kv_heads=2, group=2, dim=16, dtype=torch.float32, pad_rows=0, spare=0,
          partial_shared=False):
    """A random decode step: ``lens[b]`` tokens cached per row; ``shared[b] = (key, pages)``: rows with the same key
    share their first ``pages`` pages (a prefix of a longer shared run keeps the same page ids); pages are allocated
    for ``spare`` more tokens per row. A row shares only pages complete before the step (transformers shares no other:
    the page a request writes to is its own), unless ``partial_shared`` (block tables no cache would hold)."""
    if not partial_shared:
        for b, n in enumerate(lens):
            if shared[b][1] and any(s[0] == shared[b][0] for i, s in enumerate(shared) if i != b):
                assert shared[b][1] <= n // page_size, f"row {b} would share a page it writes to"
    gen = torch.Generator().manual_seed(seed)
    batch = len(lens) + pad_rows
    width = max(-(-(n + 1 + spare) // page_size) for n in lens) + 1
    ids = iter(torch.randperm(4 * batch * width, generator=gen).tolist())
    runs: dict = {}
    table = torch.full((batch, width), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        key, pages = shared[b]
        run = runs.setdefault(key, [])
        while len(run) < pages:
            run.append(next(ids))
        for j in range(-(-(n + 1 + spare) // page_size)):
            table[b, j] = run[j] if j < pages else next(ids)
    pool = 4 * batch * width
    k_cache = torch.randn(pool, page_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(pool, page_size, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(batch, 1, kv_heads * group, dim, generator=gen).to(dtype)
    k = torch.randn(batch, 1, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(batch, 1, kv_heads, dim, generator=gen).to(dtype)
    past = torch.tensor(list(lens) + [-1] * pad_rows, dtype=torch.int32)
    return q, k_cache, v_cache, k, v, table, past


def _oracle(q, k_cache, v_cache, k, v, table, past, scale, softcap=0.0, sinks=None):
    """float64: the caches after the write and the attention of each row over its ``past + 1`` tokens."""
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    page_size, group = kc.shape[1], q.shape[2] // kc.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(past.tolist()):
        if n < 0:
            continue
        page = table[b, n // page_size]
        kc[page, n % page_size], vc[page, n % page_size] = k[b, 0].double(), v[b, 0].double()
        t = torch.arange(n + 1)
        keys = kc[table[b, t // page_size].long(), t % page_size].repeat_interleave(group, 1)
        values = vc[table[b, t // page_size].long(), t % page_size].repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[b, 0].double(), keys) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        out[b, 0] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1)[:, : n + 1], values)
    return out, kc, vc


SYSTEM = [("sys", 3)] * 6  # six rows under one 3-page prompt
CASES = {
    "one group": (4, [13, 15, 12, 19, 12, 17], SYSTEM),
    "no sharing": (4, [5, 0, 9, 3], [(b, 0) for b in range(4)]),
    "two levels": (4, [23, 21, 14, 25, 13],
                   [("sys", 5), ("sys", 5), ("sys", 3), ("sys", 6), ("other", 3)]),
    "run ends mid-page": (8, [21, 22, 20], [("sys", 2)] * 3),
    "one request": (4, [10], [("sys", 2)]),
    "page of 16": (16, [40, 35, 47, 33], [("a", 2), ("a", 2), ("b", 2), ("b", 2)]),
}


@pytest.mark.parametrize("path", ["triton", "triton merged", "triton merged split prefix", "triton merged overlap",
                                  "triton merge launch", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_oracle_and_writes_the_new_token(case, path):
    # "triton": split suffixes and a merge launch; "triton merged": the suffix units merge the prefix partials (one
    # prefix split, or two; "overlap": on Hopper+ the suffix launch starts beside the prefix launch); "triton merge
    # launch": one suffix split, merged by a launch of its own (Tiles)
    page_size, lens, shared = CASES[case]
    step = _step(zlib.crc32(case.encode()) % 1000, page_size, lens, shared, pad_rows=1)
    expected, kc, vc = _oracle(*step, scale=0.3)
    triton = path != "torch"
    q, k_cache, v_cache, k, v, table, past = _on(DEVICE if triton else "cpu", step)
    run = paged.paged_relay_triton if triton else paged.paged_attention_torch
    groups = grouping.share_groups(table, past, page_size, rows_per_tile=2) if triton else None
    splits = {"triton merged": (1, 1), "triton merged split prefix": (2, 1), "triton merged overlap": (2, 1),
              "triton merge launch": (2, 1)}
    prefix_splits, suffix_splits = splits.get(path, (2, 2))
    extra = dict(groups=groups, prefix_splits=prefix_splits, suffix_splits=suffix_splits) if triton else {}
    if path == "triton merge launch":
        extra["tiles"] = dataclasses.replace(paged.TILES, suffix_merges=False)
    if path == "triton merged overlap":
        extra["tiles"] = dataclasses.replace(paged.TILES, overlap=True)
    out = run(q, k_cache, v_cache, k, v, table, past, 0.3, 0.0, None, **extra)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(k_cache.double().cpu(), kc, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.double().cpu(), vc, atol=0, rtol=0)


@pytest.mark.parametrize("splits", [None, 1, 2, "fp32 partials", "fp32 partials, merge launch"],
                         ids=["interface", "merged", "merge launch", "fp32 partials", "fp32 partials, merge launch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_softcap_and_sinks(dtype, splits):
    # the prefix partials kept in the query's dtype (Tiles.half_partials, the default), merged by the suffix units or
    # by a merge launch that reads the suffix partials in that dtype too; "fp32 partials": kept in fp32
    step = _step(7, 4, [13, 14, 12, 18], [("sys", 3)] * 4, kv_heads=1, group=4, dtype=dtype)
    sinks = torch.randn(4)
    expected, _, _ = _oracle(*step, scale=0.25, softcap=5.0, sinks=sinks)
    q, k_cache, v_cache, k, v, table, past = _on(DEVICE, step)
    if splits is None:
        out = kernel.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=past, block_table=table,
                                             softmax_scale=0.25, softcap=5.0, s_aux=sinks.to(DEVICE))
    elif isinstance(splits, str):
        tiles = dataclasses.replace(paged.TILES, half_partials=False)
        out = paged.paged_relay_triton(q, k_cache, v_cache, k, v, table, past, 0.25, 5.0, sinks.to(DEVICE),
                                       prefix_splits=2, suffix_splits=2 if "merge launch" in splits else 1,
                                       tiles=tiles)
    else:
        out = paged.paged_relay_triton(q, k_cache, v_cache, k, v, table, past, 0.25, 5.0, sinks.to(DEVICE),
                                       prefix_splits=splits, suffix_splits=splits)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)


def test_strided_sinks():
    """Sink logits as a strided view, NaN between them: each head reads its own sink."""
    step = _step(7, 4, [13, 14, 12, 18], [("sys", 3)] * 4, kv_heads=1, group=4, dtype=torch.float32)
    sinks = torch.randn(4)
    expected, _, _ = _oracle(*step, scale=0.25, sinks=sinks)
    strided = torch.stack([sinks, torch.full_like(sinks, math.nan)], 1).to(DEVICE)[:, 0]
    assert not strided.is_contiguous()
    q, k_cache, v_cache, k, v, table, past = _on(DEVICE, step)
    out = kernel.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=past, block_table=table,
                                         softmax_scale=0.25, s_aux=strided)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [1, 2])
def test_without_a_new_token_attends_to_the_cached_tokens(splits):
    # k = v = None: nothing written, each row attends to its cache_seqlens tokens (0: none, zeros)
    step = _step(29, 4, [13, 14, 0, 18], [("sys", 3), ("sys", 3), ("x", 0), ("sys", 3)], pad_rows=1)
    q, k_cache, v_cache, _, _, table, past = step
    last = (past - 1).clamp(min=0).long()  # the oracle "writes" the token already at past - 1 and attends to past
    pages = table[torch.arange(len(past)), last // 4].long()
    expected, _, _ = _oracle(q, k_cache, v_cache, k_cache[pages, last % 4][:, None], v_cache[pages, last % 4][:, None],
                             table, torch.where(past > 0, past - 1, -1), scale=0.3)
    q, k_cache, v_cache, table, past = _on(DEVICE, (q, k_cache, v_cache, table, past))
    before = k_cache.clone()
    out = paged.paged_relay_triton(q, k_cache, v_cache, None, None, table, past, 0.3, 0.0, None,
                                   prefix_splits=splits, suffix_splits=splits)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(k_cache, before)


def test_groups_of_a_system_prompt_and_a_document():
    # rows 0, 1, 3 share 5 pages (prompt + document), row 2 only the 3-page prompt, row 4 nothing
    _, _, _, _, _, table, past = _step(3, 4, [23, 21, 14, 25, 13], CASES["two levels"][2])
    groups = grouping.share_groups(table, past, 4, rows_per_tile=2)
    assert groups.bounds.tolist() == [[3, 5, 5], [3, 5, 5], [3, 3, 3], [3, 5, 5], [0, 0, 0]]
    live = groups.tiles[groups.tiles[:, 3] > 0].tolist()
    # level 1: rows 0-3 under leader 0 (two tiles of two); level 2: rows 0, 1, 3 (two tiles)
    assert sorted((t[0], t[1], t[3]) for t in live) == [(1, 0, 2), (1, 0, 2), (2, 0, 1), (2, 0, 2)]
    assert groups.counts.tolist() == [2, 2]  # live tiles of each level, at the front of each half of the table
    # shared pages the rows would read (5 + 5 + 3 + 5) less those the 4 tiles read (3 + 3 + 2 + 2), in tokens
    assert grouping.prefix_reads(groups, past, 4).tolist() == [1, 5, (18 - 10) * 4]
    alone = grouping.share_groups(table[:1], past[:1], 4, rows_per_tile=2)
    assert grouping.prefix_reads(alone, past[:1], 4).tolist() == [0, 0, 0]


def test_a_new_page_is_private_until_complete():
    # rows share 2 complete pages; the tokens after them (same prompt text, pages not yet deduplicated) are private
    _, _, _, _, _, table, past = _step(5, 8, [16, 16], [("sys", 2)] * 2)
    assert grouping.share_groups(table, past, 8, rows_per_tile=4).bounds[:, 0].tolist() == [2, 2]
    groups = grouping.share_groups(table, torch.tensor([15, 16], dtype=torch.int32), 8, rows_per_tile=4)
    assert groups.bounds[:, 0].tolist() == [1, 1]  # row 0's second page is not complete before its write


def test_rejects_what_it_does_not_implement():
    q, k_cache, v_cache, k, v, table, past = _step(1, 4, [5], [("a", 0)])
    with pytest.raises(ValueError, match="window_size"):
        kernel.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=past, block_table=table,
                                       window_size=(8, 8))
    with pytest.raises(ValueError, match="paged cache"):
        kernel.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=past)
    with pytest.raises(ValueError, match="one query per request"):
        kernel.flash_attn_with_kvcache(q.expand(1, 2, -1, -1), k_cache, v_cache, cache_seqlens=past,
                                       block_table=table)
    with pytest.raises(ValueError, match="queries, keys and values"):  # values of another head size (MLA)
        kernel.flash_attn_with_kvcache(q, k_cache, v_cache[..., :8], cache_seqlens=past, block_table=table)
    call = dict(cache_seqlens=past, block_table=table)
    malformed = {
        "does not implement rotary_sin": (q, k_cache, v_cache, dict(rotary_sin=torch.ones(1))),
        "one sink logit per query head": (q, k_cache, v_cache, dict(s_aux=torch.zeros(q.shape[2] + 1))),
        "share one of fp16, bf16, fp32": (q.half(), k_cache, v_cache, {}),
        "hold integers": (q, k_cache, v_cache, dict(cache_seqlens=past.float())),
        "M >= 1": (q, k_cache, v_cache, dict(block_table=table[:, :0])),
        "H_kv >= 1": (q, k_cache[:, :, :0], v_cache[:, :, :0], {}),
        "caches \\[P, page, H_kv, D\\]": (q, k_cache[..., None], v_cache[..., None], {}),
        "do not fit the block table": (q, k_cache, v_cache, dict(cache_seqlens=past + 4 * table.shape[1])),
    }
    for message, (q_, kc, vc, change) in malformed.items():
        with pytest.raises(ValueError, match=message):
            kernel.flash_attn_with_kvcache(q_, kc, vc, k, v, **{**call, **change})


def test_a_row_past_its_tables_pages_reads_and_writes_nothing_outside_it():
    # unchecked on CUDA (that would wait for the device): the kernels themselves keep to the table's pages
    q, k_cache, v_cache, k, v, table, past = _step(31, 4, [9, 10], [("a", 2)] * 2)
    table[0, 3] = min(set(range(k_cache.shape[0])) - set(table.flatten().tolist()))  # a page beyond the slice
    q, k_cache, v_cache, k, v, table = _on(DEVICE, (q, k_cache, v_cache, k, v, table))
    narrow, before = table[:, :3], (k_cache.clone(), v_cache.clone())
    past = torch.tensor([12, 10], dtype=torch.int32, device=DEVICE)  # row 0's new token would go to column 3
    paged.paged_relay_triton(q, k_cache, v_cache, k, v, narrow, past, 0.5, 0.0, None)
    page, slot = int(table[1, 2]), 10 % 4  # row 1 is well-formed: its new token alone is written
    assert not torch.equal(k_cache[page, slot], before[0][page, slot])
    k_cache[page, slot], v_cache[page, slot] = before[0][page, slot], before[1][page, slot]
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_every_layer_of_a_step_reads_the_groups_the_first_derived():
    # two layers' pages in one allocation, as transformers lays them out; steps change the table in place
    page_size, lens = 4, [13, 14, 12, 9]
    q, pages, _, k, v, table, past = _on(DEVICE, _step(11, page_size, lens, [("sys", 3)] * 3 + [("x", 2)], spare=3))
    storage = torch.randn(4, *pages.shape, device=DEVICE)  # [layer 0 K, layer 0 V, layer 1 K, layer 1 V]
    memo = paged._StepGroups()
    for step in range(3):
        if step == 2:  # a new mix of requests in the same buffers: row 3 now shares the prompt's pages
            table[3, :3] = table[0, :3]
            past[3] = 12
        for layer in range(2):
            kc, vc = storage[2 * layer], storage[2 * layer + 1]
            expected, _, _ = _oracle(*_on("cpu", (q, kc, vc, k, v, table, past)), scale=0.5)
            groups = memo.get(table, past, kc, page_size, rows_per_tile=2)
            out = paged.paged_relay_triton(q, kc, vc, k, v, table, past, 0.5, 0.0, None, groups=groups)
            torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)
            expect_shared = [3, 3, 3, 3 if step == 2 else 0]
            assert groups.bounds[:, 0].tolist() == expect_shared
        past = past + 1  # the next step: one more token per row, same table object


def test_layers_whose_page_views_hold_different_page_counts_share_one_derivation_per_step(monkeypatch):
    # transformers (5.25) gives layer i the pages of one allocation from offset 2i (its K) and 2i + 1 (its V), each
    # view cut to the shorter: every layer's view holds a different number of pages
    _, pages, _, _, _, table, past = _step(19, 4, [13, 14, 12], [("sys", 3)] * 3, spare=6)
    flat = pages.reshape(-1, *pages.shape[2:])  # [pages * page_size, H_kv, D]
    views = [flat[2 * i * 4:].reshape(-1, *pages.shape[1:])[:pages.shape[0] - 2 * i - 1] for i in range(3)]
    assert len({v.shape[0] for v in views}) == 3
    memo = paged._StepGroups()
    derived = []
    real = paged.grouping.share_groups
    monkeypatch.setattr(paged.grouping, "share_groups", lambda *a, **kw: derived.append(1) or real(*a, **kw))
    for step in range(2):
        memo.begin_step()
        first = memo.get(table, past, views[0], 4, 2)
        assert all(memo.get(table, past, v, 4, 2) is first for v in views[1:])
        assert len(derived) == step + 1  # once per step, by its first layer


def test_a_table_at_a_freed_tables_address_is_not_read_as_it():
    # a new manager's table allocated where the last one was, at the same version count, without begin_step
    _, pages, _, _, _, table, past = _step(19, 4, [13, 14, 12], [("sys", 3)] * 3)
    half = pages.shape[0] // 2
    memo = paged._StepGroups()
    first = memo.get(table, past, pages[:half], 4, 2)
    assert memo.get(table[:], past, pages[half:2 * half], 4, 2) is first  # a view of the same table: the same
    other = torch.empty(0, dtype=table.dtype).set_(table.untyped_storage(), 0, table.shape, table.stride())
    while other._version != table._version:
        (other if other._version < table._version else table).add_(0)
    assert other.data_ptr() == table.data_ptr() and other is not table
    assert memo.get(other, past, pages[half:2 * half], 4, 2) is not first


def test_prefix_tiles_hold_128_query_rows_on_hopper_up_to_16_bit_head_size_128(monkeypatch):
    def members(dtype, heads, kv_heads, dim, tiles=paged.TILES):
        q = torch.zeros(2, 1, heads, dim, dtype=dtype)
        return tiles.rows_per_tile(q, torch.zeros(4, 16, kv_heads, dim, dtype=dtype))

    assert members(torch.bfloat16, 32, 8, 128) == 16  # not Hopper (the CPU here): 64 rows
    assert members(torch.bfloat16, 32, 8, 128, paged.Tiles(prefix_rows=128)) == 32
    monkeypatch.setattr(paged, "_hopper", lambda device: True)
    assert members(torch.bfloat16, 32, 8, 128) == 32  # 128 rows: 32 requests x 4 query heads
    assert members(torch.float16, 9, 3, 64) == 32  # a GQA group of 3 takes a power of two's rows
    assert members(torch.float32, 32, 8, 128) == 16 and members(torch.bfloat16, 16, 8, 256) == 32
    assert members(torch.float32, 8, 8, 64) == 128 and members(torch.float32, 8, 8, 96) == 64
    assert members(torch.bfloat16, 32, 8, 128, paged.Tiles(prefix_rows=64)) == 16


def test_many_requests_under_two_prompts():
    lens = [9 + (b * 7) % 13 for b in range(256)]
    shared = [("a" if b % 3 else "b", 2) for b in range(256)]
    step = _step(13, 4, lens, shared, kv_heads=1, group=2, dim=8)
    expected, _, _ = _oracle(*step, scale=0.4)
    step = _on(DEVICE, step)
    groups = grouping.share_groups(step[5], step[6], 4, rows_per_tile=32)
    assert sorted(set(groups.bounds[:, 0].tolist())) == [2]
    out = paged.paged_relay_triton(*step, 0.4, 0.0, None, groups=groups, prefix_splits=1, suffix_splits=1)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_captured_step_replays_other_tables_and_groupings(overlap):
    page_size = 16
    first = _step(21, page_size, [40, 50, 45, 60], [("a", 2)] * 4, kv_heads=2, group=4, dim=64, spare=16)
    q, kc, vc, k, v, table, past = _on("cuda", first)
    tiles = dataclasses.replace(paged.TILES, overlap=overlap)

    def step():  # the step's first layer, which derives its groups from the table
        if not overlap:  # the interface, as transformers calls it
            return paged.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=past, block_table=table)
        paged.begin_step()
        return paged.paged_relay_triton(q, kc, vc, k, v, table, past, 64 ** -0.5, 0.0, None, tiles=tiles)

    out = step()  # warm, eager
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, shared in ((22, [("a", 1), ("b", 2), ("b", 2), ("c", 0)]), (23, [("a", 2)] * 3 + [("a", 1)])):
        nxt = _step(seed, page_size, [40, 47, 35, 49], shared, kv_heads=2, group=4, dim=64, spare=16)
        for dst, src in zip((q, kc, vc, k, v, table, past), nxt):
            dst.copy_(src)
        expected, _, _ = _oracle(*nxt, scale=64 ** -0.5)
        graph.replay()
        torch.testing.assert_close(out.double().cpu(), expected, atol=1e-4, rtol=1e-4)


def test_more_live_tiles_than_programs_are_all_served():
    # 12 prompts of two rows each, one row per tile: 24 live tiles for TILES.prefix_programs programs to loop over
    lens = [9 + b % 3 for b in range(24)]
    step = _step(17, 4, lens, [(b // 2, 2) for b in range(24)], kv_heads=1, group=2, dim=8)
    expected, _, _ = _oracle(*step, scale=0.4)
    step = _on(DEVICE, step)
    groups = grouping.share_groups(step[5], step[6], 4, rows_per_tile=1)
    assert groups.counts.tolist() == [24, 0] and 24 > paged.TILES.prefix_programs
    out = paged.paged_relay_triton(*step, 0.4, 0.0, None, groups=groups, prefix_splits=1, suffix_splits=1)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


def _live(groups) -> tuple:
    """``Groups`` as plain lists, the tile rows past each level's live ones left out (their content is unused)."""
    tiles, counts, batch = groups.tiles.tolist(), groups.counts.tolist(), groups.members.shape[1]
    return (tiles[:counts[0]], tiles[batch:batch + counts[1]], counts, groups.members.tolist(),
            groups.bounds.tolist())


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("seed", range(40))
def test_random_groups_share_only_complete_identical_pages_and_cover_every_row(seed, triton):
    # the one-program grouping kernel and the tensor formulation derive the same tables
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 12 if seed < 30 else 90, (1,), generator=gen))
    lens = torch.randint(0, 40, (batch,), generator=gen).tolist()
    keys = torch.randint(0, 3, (batch,), generator=gen).tolist()
    shared = [(f"p{k}", int(torch.randint(0, 6, (1,), generator=gen))) for k in keys]
    _, _, _, _, _, table, past = _step(seed, 4, lens, shared, pad_rows=int(seed % 3 == 0), partial_shared=True)
    complete = torch.where(past >= 0, past // 4, 0)
    rows_per_tile = int(torch.randint(1, 4, (1,), generator=gen))
    groups = grouping.share_groups_torch(table, past, 4, rows_per_tile)
    if triton:
        derived = grouping.share_groups(table.to(DEVICE), past.to(DEVICE), 4, rows_per_tile, triton=True)
        assert _live(derived) == _live(groups)
        rows = batch + int(seed % 3 == 0)  # with the padding row
        counts = derived.counts.tolist()
        assert derived.tiles[counts[0]:rows].eq(0).all() and derived.tiles[rows + counts[1]:].eq(0).all()
    bounds, members = groups.bounds.tolist(), groups.members.tolist()
    seen = {1: [], 2: []}
    for level, lead, first, count in groups.tiles.tolist():
        if not count:
            continue
        hi = bounds[lead][level - 1]
        assert hi > (bounds[lead][0] if level == 2 else 0)
        for row in members[level - 1][first:first + count]:
            seen[level].append(row)
            assert complete[row] >= hi and complete[lead] >= hi and torch.equal(table[row, :hi], table[lead, :hi])
            assert bounds[row][level - 1] == hi
    assert sorted(seen[1]) == [r for r in range(len(bounds)) if bounds[r][0] > 0]
    assert sorted(seen[2]) == [r for r in range(len(bounds)) if bounds[r][1] > bounds[r][0]]
    assert all(b[2] == b[1] >= b[0] for b in bounds)
    for a in range(len(bounds)):  # rows whose first complete page is the same page are one level-1 group
        for b in range(len(bounds)):
            if a != b and min(complete[a], complete[b]) >= 1 and table[a, 0] == table[b, 0]:
                assert bounds[a][0] > 0 and bounds[a][0] == bounds[b][0]


def test_a_new_step_is_recognised_by_begin_step_a_refilled_table_or_the_first_layer():
    _, pages, _, _, _, table, past = _step(19, 4, [13, 14, 12], [("sys", 3)] * 3)
    half = pages.shape[0] // 2
    layer0, layer1 = pages[:half], pages[half:2 * half]  # two layers' page views of one allocation
    memo = paged._StepGroups()
    first = memo.get(table, past, layer0, 4, 2)
    assert memo.get(table, past, layer1, 4, 2) is first  # a later layer of the step reads them
    again = memo.get(table, past, layer0, 4, 2)
    assert again is not first  # the first layer comes again: a new step
    assert memo.get(table, past, layer1, 4, 2) is again
    memo.begin_step()  # a forward begins: whichever layer comes first derives them
    marked = memo.get(table, past, layer1, 4, 2)
    assert marked is not again and memo.get(table, past, layer0, 4, 2) is marked
    table[0, 0] = table[0, 0]  # transformers refills the table in place for a new step
    assert memo.get(table, past, layer0, 4, 2) is not marked
    memo.forget()
    assert not memo._entries
