"""A kept prefix's check run as a spare row of the call's recorded prefill (``relay_hf/check_row.py``): which calls
get a spare row, what the row is, and, turn after turn under a pinned prompt, that the standalone check runs only
until the graph has a reference, that a change to the model is still found (the call then runs again on the prompt
prefilled anew), and that the tokens are stock's throughout: on the CPU with the recorded prefill stood in for by
the eager forward, and on CUDA as ``patch`` runs it."""

import copy
import dataclasses
import weakref

import pytest
import torch

import relay_hf
from relay_hf import decode as decode_module
from relay_hf import generate as generate_module
from relay_hf.check_row import MAX_REFERENCES, CheckRow
from relay_hf.freshness import CHECK_TOKENS, _Replay, _where
from relay_hf.kept import launch_checks
from relay_hf.prefix import PrefixTree
from relay_hf.state import relay_state
from relay_hf.step import DEFAULT_DECODE, DecodeConfig
from relay_hf.suffix_prefill import SuffixPrefill, prefill_logits
from tests.helpers import VOCAB, tiny_model


def test_a_spare_row_is_the_buckets_own_or_a_one_row_call_grown_to_two():
    decode = DecodeConfig()
    assert [decode.check_row_bucket(r) for r in (1, 2, 3, 5, 63, 64, 65)] == [2, None, 4, 8, 64, None, 128]
    assert DecodeConfig(check_row_rows=4).check_row_bucket(2) == 4
    assert DecodeConfig(check_row_rows=1).check_row_bucket(1) is None


def test_the_row_is_padding_then_the_prefixs_first_tokens_where_the_standalone_check_puts_them():
    ids, pos = torch.arange(100, 130), torch.arange(30)
    row = CheckRow(None, None, prefix_length=20)
    row.lay_out(ids, pos, 20)
    assert row.n == CHECK_TOKENS and row.pads(10) == 10 - CHECK_TOKENS
    assert torch.equal(ids[:20], torch.arange(100, 120)) and torch.equal(ids[-CHECK_TOKENS:], torch.arange(100, 108))
    assert bool((ids[20:-CHECK_TOKENS] == 100).all())
    assert torch.equal(pos[:20], torch.arange(20)) and not pos[20:-CHECK_TOKENS].any()
    assert torch.equal(pos[-CHECK_TOKENS:], torch.arange(CHECK_TOKENS))
    assert CheckRow(None, None, prefix_length=5).n == 5


class _Graph:
    """Stands in for a recorded prefill (weakly referable, compared by identity)."""


def _turns(seed: int):
    """A tiny fp32 Llama, an unpatched copy, a 40-token prompt and one-row turns under it."""
    model = tiny_model("llama")
    stock = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (40,), generator=g)
    turns = [torch.cat([prompt, torch.randint(3, VOCAB, (n,), generator=g)])[None] for n in (9, 5, 12, 7, 10, 6)]
    return model, stock, prompt, turns


def test_turns_check_their_prompt_in_the_prefills_spare_row_and_still_find_a_change(monkeypatch):
    """On the CPU, calls routed as CUDA routes them (a one-row turn at two rows, the check row in row 1, its prefill
    "recorded": the eager forward, one stand-in graph per shape): the first turn runs the standalone check and keeps
    the row as the graph's reference, later turns compare the row and run no check forward; a write in place is
    found by the row (the standalone check then fails: the call runs again on the prompt prefilled anew), a write of
    the same values is not a change; stock's tokens every time, greedy and sampled."""
    model, stock, prompt, turns = _turns(seed=81)
    graphs: dict = {}
    monkeypatch.setattr(decode_module, "_recorded", lambda model, ids, cache, decode: True)
    monkeypatch.setattr(SuffixPrefill, "__call__",
                        lambda self, model, cache, ids, pos, step=None: prefill_logits(model, self.name, cache, ids,
                                                                                        pos))
    monkeypatch.setattr(SuffixPrefill, "replays", lambda self, ids, step=None: graphs.setdefault(ids.shape, _Graph()))
    real = generate_module.decide

    def as_on_cuda(model, call, *rest):
        route = real(model, call, *rest)
        if not (route.relay and route.static and route.prefix_length == 40):
            return route
        rows = DEFAULT_DECODE.check_row_bucket(route.rows)
        length = DEFAULT_DECODE.prefill_length(rows, route.suffix_columns)
        return dataclasses.replace(route, check_row=True, static_rows=rows, suffix_columns=length,
                                   static_capacity=length + route.new_tokens)

    monkeypatch.setattr(generate_module, "decide", as_on_cuda)
    forwards = []
    run = _Replay.run
    monkeypatch.setattr(_Replay, "run", lambda self, m, head: forwards.append(1) or run(self, m, head))
    relay_hf.patch(model, decode="graph")
    relay_hf.pin(model, prompt)
    store = relay_state(model).store
    (entry,) = store.values()

    def turn(row, kept, gen=None):
        gen = gen or dict(max_new_tokens=5, do_sample=False)
        forwards.clear()
        torch.manual_seed(3)
        out = model.generate(row, attention_mask=torch.ones_like(row), **gen)
        torch.manual_seed(3)
        assert torch.equal(out, stock.generate(row, attention_mask=torch.ones_like(row), **gen))
        decision = model.relay_last_decision
        assert decision.fast_decode and decision.prefix_kept == kept, decision
        return len(forwards)

    assert turn(turns[0], kept=40) == 1  # no reference yet: the standalone check, then the row kept
    assert len(entry.check.rows) == 1
    assert turn(turns[1], kept=40) == 0  # the row equals the reference
    assert turn(turns[2], kept=40, gen=dict(max_new_tokens=5, do_sample=True, top_k=20)) == 0
    assert relay_state(model).idle_static().cache.layers[0].keys.shape[0] == 2  # one row and the check row
    for m in (model, stock):
        m.model.layers[0].mlp.down_proj.weight.data[:, 2] *= 1.5
    stale = store.stale
    assert turn(turns[3], kept=0) >= 1  # the row differs, the standalone check fails: prefilled anew
    assert store.stale == stale + 1
    (entry,) = store.values()
    assert turn(turns[4], kept=40) == 1 and entry.check.rows  # a new entry: checked once, then its row kept
    for m in (model, stock):
        m.model.layers[1].self_attn.v_proj.weight.data.copy_(m.model.layers[1].self_attn.v_proj.weight.data.clone())
    assert turn(turns[5], kept=40) == 0


def test_a_row_that_differs_from_its_reference_falls_back_to_the_standalone_check(monkeypatch):
    """A reference that no longer matches (a kernel that did not repeat its bits) costs one standalone check, which
    passes and takes the new row as the reference; nothing is dropped."""
    model, _, prompt, turns = _turns(seed=82)
    relay_hf.patch(model)
    relay_hf.pin(model, prompt)
    store = relay_state(model).store
    (entry,) = store.values()
    check, graph = entry.check, _Graph()
    row = CheckRow(model, store, 40)
    row.graph, row.kv = graph, torch.arange(6.0)
    forwards = []
    run = _Replay.run
    monkeypatch.setattr(_Replay, "run", lambda self, m, head: forwards.append(1) or run(self, m, head))
    full = prompt
    assert row.holds(check, full, {}) and forwards == [1]  # no reference: standalone, kept
    assert row.holds(check, full, {}) and forwards == [1]  # equal: no forward
    row.kv = torch.arange(6.0) + 1
    assert row.holds(check, full, {}) and forwards == [1, 1]
    assert torch.equal(check.rows[id(graph)][1], row.kv) and len(store) == 1
    del graph, row
    CheckRow(model, store, 40).keep(check)  # no row computed: nothing kept
    rows = [CheckRow(model, store, 40) for _ in range(MAX_REFERENCES + 1)]
    for other in rows:
        other.graph, other.kv = _Graph(), torch.zeros(6)
        other.keep(check)
    # the freed graph's reference went, and the oldest beyond the cap
    assert list(check.rows) == [id(other.graph) for other in rows[1:]]


def test_a_call_that_may_run_a_check_row_launches_no_check_but_one_whose_graphs_reads_moved_is_refused():
    """A call that may run a check row launches no check (``{}``: the row is compared, or the standalone check runs
    after the prefill), but where a tensor a check's captured graph read is gone the launch is refused all the same
    (the call then walks the model before any verdict, so a call left without a row never replays that graph on
    freed memory)."""
    model, _, prompt, _ = _turns(seed=85)
    relay_hf.patch(model)
    relay_hf.pin(model, prompt)
    (entry,) = relay_state(model).store.values()
    check, tree = entry.check, PrefixTree.from_prefixes([prompt])
    read = torch.zeros(3)
    check.replay.graph, check.replay.reads = object(), ((weakref.ref(read), _where(read)),)  # "captured"
    assert check.launch(model, check_row=True) == {} and launch_checks(model, tree, True) == ({}, True)
    del read
    assert check.launch(model, check_row=True) is None and launch_checks(model, tree, True) == ({}, False)
    assert check.launch(model) is None  # (as without a check row)


@pytest.mark.gpu
def test_turns_check_their_prompt_in_the_recorded_prefills_spare_row_on_gpu(monkeypatch):
    """fp32 on CUDA as ``patch`` runs it: one-row turns under a pinned prompt run at two rows; once a recorded prefill
    has replayed under a passing check, later turns launch and run no check forward; a write in place is still found
    (prefilled anew); a batch of three rows under the prompt uses its bucket's spare row; stock's tokens throughout,
    and a sampled turn's draws and generator too."""
    model, stock, prompt, turns = _turns(seed=83)
    model, stock = model.cuda(), stock.cuda()
    forwards = []
    run, launch = _Replay.run, _Replay.launch
    monkeypatch.setattr(_Replay, "run", lambda self, m, head: forwards.append("run") or run(self, m, head))
    monkeypatch.setattr(_Replay, "launch", lambda self, m: forwards.append("launch") or launch(self, m))
    relay_hf.patch(model)
    relay_hf.pin(model, prompt)
    store = relay_state(model).store

    def turn(row, kept, **sampling):
        row = row.cuda()
        forwards.clear()
        gen = dict(attention_mask=torch.ones_like(row), max_new_tokens=5, **(sampling or dict(do_sample=False)))
        torch.manual_seed(4)
        out = model.generate(row, **gen)
        draw = torch.rand(2, device="cuda")
        torch.manual_seed(4)
        assert torch.equal(out, stock.generate(row, **gen)) and torch.equal(draw, torch.rand(2, device="cuda"))
        assert model.relay_last_decision.prefix_kept == kept, model.relay_last_decision
        return list(forwards)

    assert turn(turns[0], 40)  # the length's first run (recorded): standalone
    assert turn(turns[1], 40)  # its first replay: standalone, the row kept
    (entry,) = store.values()
    assert entry.check.rows
    assert turn(turns[2], 40) == [] and turn(turns[3], 40, do_sample=True, top_k=20) == []
    assert relay_state(model).idle_static().cache.layers[0].keys.shape[0] == 2
    for m in (model, stock):
        m.model.layers[-1].self_attn.k_proj.weight.data[3] += 0.1
    stale = store.stale
    assert turn(turns[4], 0)
    assert store.stale == stale + 1
    g = torch.Generator().manual_seed(84)
    ran = []
    for _ in range(3):  # its shape's first run, its first replay (the row kept), then the row alone
        ids = torch.cat([prompt.expand(3, -1), torch.randint(3, VOCAB, (3, 6), generator=g)], 1).cuda()
        forwards.clear()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
        assert torch.equal(out, stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                               do_sample=False))
        assert model.relay_last_decision.prefix_kept == 40
        ran.append(bool(forwards))
    assert ran == [True, True, False]
    assert relay_state(model).idle_static().cache.layers[0].keys.shape[0] == 4
