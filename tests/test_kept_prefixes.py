"""A patched model keeps prefilled prefixes between ``generate`` calls (``relay_hf.prefill.prefill_tree`` with the
model's ``PrefixStore``): a later call under a kept system prompt prefills only what is new, gives stock's tokens, and
never reads KV of a model that has changed since."""

import pytest
import torch

import relay_hf
from relay_hf.state import relay_state
from tests.helpers import VOCAB, RecordingStreamer, left_pad, tiny_model

GEN = dict(max_new_tokens=6, do_sample=False)


def batch(prompt: torch.Tensor, seed: int, own=(3, 9, 1, 6), document: torch.Tensor | None = None):
    """Rows = ``prompt`` (+ ``document`` for the first two) + random own tokens, left-padded."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.cat([prompt, document if document is not None and i < 2 else prompt[:0],
                       torch.randint(3, VOCAB, (n,), generator=g)]) for i, n in enumerate(own)]
    return left_pad(rows)


def stock(model, ids, mask):
    return type(model).generate(model, input_ids=ids, attention_mask=mask, **GEN)


@pytest.fixture
def model():
    m = tiny_model("llama", seed=1)
    relay_hf.patch(m)
    yield m
    relay_hf.unpatch(m)


@pytest.fixture
def prompt():
    return torch.randint(3, VOCAB, (48,), generator=torch.Generator().manual_seed(11))


def test_a_second_call_under_a_kept_prompt_prefills_only_its_rows(model, prompt):
    first = batch(prompt, 1)
    out = model.generate(*first[:1], attention_mask=first[1], **GEN)
    assert model.relay_last_decision.used and model.relay_last_decision.prefix_kept == 0
    assert torch.equal(out, stock(model, *first))
    second = batch(prompt, 2, own=(5, 2, 7))
    out = model.generate(second[0], attention_mask=second[1], **GEN)
    assert model.relay_last_decision.used and model.relay_last_decision.prefix_kept == 48
    assert torch.equal(out, stock(model, *second))
    seen = relay_hf.stats(model)
    assert seen.prefix_hits == 1 and seen.prefill_tokens_saved == 48 and seen.relay_steps > 0


def test_a_new_document_under_a_kept_prompt_prefills_alone(model, prompt):
    model.generate(*batch(prompt, 1)[:1], attention_mask=batch(prompt, 1)[1], **GEN)
    document = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(5))
    ids, mask = batch(prompt, 3, own=(4, 2, 6, 3), document=document)
    out = model.generate(ids, attention_mask=mask, **GEN)
    decision = model.relay_last_decision
    assert decision.used and {level for level, _, _ in decision.groups} == {0, 1}
    assert decision.prefix_kept == 48  # the document was prefilled after the kept prompt's KV
    assert torch.equal(out, stock(model, ids, mask))
    out = model.generate(ids, attention_mask=mask, **GEN)
    assert model.relay_last_decision.prefix_kept == 48 + 40 and torch.equal(out, stock(model, ids, mask))


def _load_other_weights(m):
    m.load_state_dict({k: v * 1.01 for k, v in m.state_dict().items()})


def _edit_in_place(m):
    with torch.no_grad():
        m.model.layers[0].self_attn.k_proj.weight.mul_(1.5)


def _write_through_data(m):
    m.model.layers[1].self_attn.v_proj.weight.data.copy_(torch.randn_like(m.model.layers[1].self_attn.v_proj.weight))


def _to_float64(m):
    m.to(torch.float64)


def _optimizer_step(m):
    m.train()
    loss = m(input_ids=torch.randint(3, VOCAB, (1, 12)), labels=torch.randint(3, VOCAB, (1, 12))).loss
    loss.backward()
    torch.optim.SGD(m.parameters(), lr=0.5).step()
    m.zero_grad()
    m.eval()


def _steer(m):  # a forward hook that adds to a layer's output (activation steering)
    m.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out + 0.5)


def _rescale_attention(m):  # a plain attribute the attention's forward reads
    m.model.layers[1].self_attn.scaling *= 1.3


def _reinit_embedding_rows(m, prompt):
    """New embedding rows for some of the prompt's tokens, through ``.data`` (no version counter moves), none of them
    the table's first, middle or last row."""
    table = m.model.embed_tokens.weight
    rows = [int(t) for t in prompt[10:20] if 0 < int(t) < table.shape[0] - 1 and int(t) != table.shape[0] // 2]
    assert rows
    table.data[rows] = torch.randn(len(rows), table.shape[1], generator=torch.Generator().manual_seed(3))


def _write_raw_storage(m):  # into the storage itself, past any tensor's version counter
    weight = m.model.layers[0].mlp.down_proj.weight  # (layer 1's MLP feeds no KV of a two-layer model)
    raw = torch.empty(0).set_(weight.untyped_storage()).view(weight.dtype)
    raw[5:40] += 0.25


def _replace_forward(m):  # activation steering by a forward replaced on the instance
    mlp = m.model.layers[0].mlp
    original = mlp.forward
    mlp.forward = lambda x: original(x) + 0.5


def _rescale_through_a_dict(m):  # a scale its forward reads from a dict attribute (as PEFT keeps LoRA scales)
    mlp = m.model.layers[0].mlp
    mlp.scales = {"default": 1.0}
    original = type(mlp).forward
    mlp.forward = lambda x: original(mlp, x) * mlp.scales["default"]
    relay_hf.clear_prefixes(m)  # the replaced forward alone would be caught: only the dict changes below
    m.generate(*batch(m.relay_test_prompt, 1)[:1], attention_mask=batch(m.relay_test_prompt, 1)[1], **GEN)
    mlp.scales["default"] = 1.5


CHANGES = [_load_other_weights, _edit_in_place, _write_through_data, _to_float64, _optimizer_step, _steer,
           _rescale_attention, _reinit_embedding_rows, _write_raw_storage, _replace_forward, _rescale_through_a_dict]


@pytest.mark.parametrize("change", CHANGES)
def test_a_kept_prompt_is_dropped_when_what_its_kv_depends_on_changes(model, prompt, change):
    ids, mask = batch(prompt, 1)
    model.generate(ids, attention_mask=mask, **GEN)
    model.relay_test_prompt = prompt
    change(model, prompt) if change is _reinit_embedding_rows else change(model)
    ids, mask = batch(prompt, 4, own=(2, 8, 5))
    out = model.generate(ids, attention_mask=mask, **GEN)
    assert model.relay_last_decision.used and model.relay_last_decision.prefix_kept == 0
    assert torch.equal(out, stock(model, ids, mask))


@pytest.mark.parametrize("how", ["scale_layer", "rescale_adapter_scale"])
def test_a_kept_prompt_is_dropped_when_a_lora_scale_changes(prompt, how):
    """PEFT keeps LoRA scales in a dict; a scale changed after a call must not serve that call's kept prompt."""
    peft = pytest.importorskip("peft")
    m = tiny_model("llama", seed=1)
    m = peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["k_proj", "v_proj"],
                                                      init_lora_weights=False), m)
    relay_hf.patch(m)
    ids, mask = batch(prompt, 1)
    m.generate(ids, attention_mask=mask, **GEN)
    ids, mask = batch(prompt, 4, own=(2, 8, 5))
    lora = [mod for mod in m.modules() if isinstance(mod, peft.tuners.lora.LoraLayer)]
    if how == "scale_layer":
        for mod in lora:
            mod.scale_layer(3.0)
        out = m.generate(ids, attention_mask=mask, **GEN)
    else:
        with peft.helpers.rescale_adapter_scale(m, 3.0):
            out = m.generate(ids, attention_mask=mask, **GEN)
            expected = stock(m, ids, mask)
    assert m.relay_last_decision.used and m.relay_last_decision.prefix_kept == 0
    assert torch.equal(out, stock(m, ids, mask) if how == "scale_layer" else expected)
    relay_hf.unpatch(m)


def test_a_kept_prompt_still_serves_an_unchanged_model_and_a_stale_one_is_counted(model, prompt):
    ids, mask = batch(prompt, 1)
    model.generate(ids, attention_mask=mask, **GEN)
    store = relay_state(model).store
    for seed in (2, 3):
        out = model.generate(*batch(prompt, seed)[:1], attention_mask=batch(prompt, seed)[1], **GEN)
        assert model.relay_last_decision.prefix_kept == 48
        assert torch.equal(out, stock(model, *batch(prompt, seed)))
    assert store.stale == 0
    _write_raw_storage(model)
    model.generate(ids, attention_mask=mask, **GEN)
    assert store.stale == 1 and model.relay_last_decision.prefix_kept == 0


@pytest.mark.parametrize("prompts", [1, 3])
def test_after_every_call_the_store_is_within_its_budget(prompt, prompts):
    """A call whose own prefixes exceed the budget uses them, then keeps none of what does not fit."""
    from tests.helpers import grouped_batch

    m = tiny_model("llama", seed=1)
    one = sum(k.nbytes + v.nbytes for k, v in ((lay.prefix_keys, lay.prefix_values)
                                               for lay in relay_hf.RelayCache.from_prefix(m, prompt).layers))
    relay_hf.patch(m, prefix_cache_bytes=one // 2)
    store = relay_state(m).store
    ids, mask = batch(prompt, 1) if prompts == 1 else grouped_batch(seed=2, prompts=(48, 40, 32))[:2]
    out = m.generate(ids, attention_mask=mask, **GEN)
    assert m.relay_last_decision.used and torch.equal(out, stock(m, ids, mask))
    assert store.nbytes() <= store.budget_bytes
    relay_hf.unpatch(m)


def test_training_mode_keeps_nothing(model, prompt):
    ids, mask = batch(prompt, 1)
    model.generate(ids, attention_mask=mask, **GEN)
    relay_hf.clear_prefixes(model)
    model.train()
    model.generate(ids, attention_mask=mask, **GEN)
    assert len(relay_state(model).store) == 0
    model.eval()


def test_the_store_never_holds_more_than_its_budget(prompt):
    m = tiny_model("llama", seed=1)
    relay_hf.patch(m, prefix_cache_bytes=0)
    ids, mask = batch(prompt, 1)
    m.generate(ids, attention_mask=mask, **GEN)
    m.generate(ids, attention_mask=mask, **GEN)
    assert m.relay_last_decision.prefix_kept == 0 and len(relay_state(m).store) == 0  # 0 keeps nothing
    one = sum(k.nbytes + v.nbytes for k, v in ((lay.prefix_keys, lay.prefix_values)
                                               for lay in relay_hf.RelayCache.from_prefix(m, prompt).layers))
    relay_hf.patch(m, prefix_cache_bytes=int(1.5 * one))  # room for one 48-token prompt
    store = relay_state(m).store
    for seed in range(4):  # four different prompts of 48 tokens, past the budget
        other = torch.randint(3, VOCAB, (48,), generator=torch.Generator().manual_seed(100 + seed))
        ids, mask = batch(other, seed)
        out = m.generate(ids, attention_mask=mask, **GEN)
        assert torch.equal(out, stock(m, ids, mask))
        assert 0 < store.nbytes() <= store.budget_bytes and len(store) == 1
    out = m.generate(ids, attention_mask=mask, **GEN)  # the last one is kept
    assert m.relay_last_decision.prefix_kept == 48
    relay_hf.clear_prefixes(m)
    assert len(store) == 0 and store.nbytes() == 0
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        relay_hf.patch(m, prefix_cache_bytes=-1)
    assert store.budget_bytes == int(1.5 * one)  # a refused budget changes nothing
    relay_hf.unpatch(m)
    with pytest.raises(ValueError, match="patched"):
        relay_hf.clear_prefixes(m)


def test_a_captured_loop_refilled_for_a_kept_prompt_copies_no_prefix(prompt):
    m = tiny_model("llama", seed=1)
    relay_hf.patch(m, decode="graph")
    ids, mask = batch(prompt, 1)
    first = m.generate(ids, attention_mask=mask, **GEN)
    assert m.relay_last_decision.fast_decode
    slot = relay_state(m).idle_slots()[0]
    versions = [lay.prefix_keys._version for lay in slot.cache.layers]
    ids2, mask2 = batch(prompt, 2, own=(5, 2, 7, 4))
    out = m.generate(ids2, attention_mask=mask2, **GEN)
    assert m.relay_last_decision.fast_decode and m.relay_last_decision.prefix_kept == 48
    assert relay_state(m).idle_slots()[0] is slot  # refilled in place
    assert [lay.prefix_keys._version for lay in slot.cache.layers] == versions  # nothing written to the prefix
    assert torch.equal(out, stock(m, ids2, mask2)) and torch.equal(first, stock(m, ids, mask))
    relay_hf.unpatch(m)


def test_a_one_row_call_under_a_kept_prompt_prefills_only_its_own_tokens(model, prompt):
    ids, mask = batch(prompt, 1)
    model.generate(ids, attention_mask=mask, **GEN)  # a batch keeps the prompt
    row = torch.cat([prompt, torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(9))])[None]
    out = model.generate(row, attention_mask=torch.ones_like(row), **GEN)
    assert model.relay_last_decision.used and model.relay_last_decision.prefix_kept == 48
    assert torch.equal(out, stock(model, row, torch.ones_like(row)))
    assert relay_hf.stats(model).prefix_hits == 1  # one row shares nothing per step: no relay step counted for it
    other = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(10))[None]  # under no kept prompt
    out = model.generate(other, attention_mask=torch.ones_like(other), **GEN)
    assert not model.relay_last_decision.used and torch.equal(out, stock(model, other, torch.ones_like(other)))


def test_int32_ids_find_the_prompt_int64_ids_kept(model, prompt):
    """Token ids are keyed as int64 whatever the caller's dtype: a chat turn passing int32 ``input_ids`` reads the
    prompt a batch of int64 ids kept (and the other way round)."""
    ids, mask = batch(prompt, 1)
    model.generate(ids, attention_mask=mask, **GEN)
    row = torch.cat([prompt, torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(9))])[None]
    row32 = row.to(torch.int32)
    out = model.generate(row32, attention_mask=torch.ones_like(row32), **GEN)
    assert model.relay_last_decision.used and model.relay_last_decision.prefix_kept == 48
    assert torch.equal(out, stock(model, row32, torch.ones_like(row32)))
    ids32, mask32 = batch(prompt, 2, own=(5, 2, 7, 4))
    out = model.generate(ids32.to(torch.int32), attention_mask=mask32, **GEN)
    assert model.relay_last_decision.prefix_kept == 48
    assert torch.equal(out, stock(model, ids32.to(torch.int32), mask32))


@pytest.fixture
def looped():
    """A patched model decoding on relay_hf's loop (``decode="graph"``), where a kept prompt's check is read only
    once the call's own prefill is launched."""
    m = tiny_model("llama", seed=1)
    relay_hf.patch(m, decode="graph")
    yield m
    relay_hf.unpatch(m)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_a_check_read_after_the_prefill_that_failed_runs_the_turn_again(looped, prompt, sample, monkeypatch):
    """A chat turn under a kept prompt whose check fails (a write no counter sees): what the turn computed on the
    stale KV is thrown away and it runs as a failed check runs: the prompt prefilled again, stock's tokens (a sampled
    turn draws what stock draws, and leaves the generator where stock leaves it), the streamer fed once, the entry
    counted stale and no prefix hit; the prompt prefilled again serves the next turn."""
    ids, mask = batch(prompt, 1)
    looped.generate(ids, attention_mask=mask, **GEN)  # a batch keeps the prompt
    store = relay_state(looped).store
    own = torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(9))
    row = torch.cat([prompt, own])[None]
    gen = dict(max_new_tokens=6, do_sample=sample, **(dict(top_k=20) if sample else {}))
    _write_raw_storage(looped)
    read = []  # the verdicts each read found waiting: the turn's check was left unread until its loop read it
    settle = type(store).settle
    monkeypatch.setattr(type(store), "settle", lambda self, pending: read.append(len(pending)) or settle(self, pending))
    runs = []
    for run in (lambda **kw: looped.generate(row, attention_mask=torch.ones_like(row), **kw),
                lambda **kw: type(looped).generate(looped, input_ids=row, attention_mask=torch.ones_like(row), **kw)):
        streamer = RecordingStreamer()
        torch.manual_seed(5)
        out = run(streamer=streamer, **gen)
        runs.append((out, torch.rand(3), streamer))
        if len(runs) == 1:
            decision = looped.relay_last_decision
    (out, draw, streamer), (want, want_draw, want_streamer) = runs
    assert decision.used and decision.fast_decode and decision.prefix_kept == 0 and read[0] == 1
    assert torch.equal(out, want) and torch.equal(draw, want_draw)
    assert streamer.ends == want_streamer.ends == 1 and len(streamer.puts) == len(want_streamer.puts)
    assert all(torch.equal(a, b) for a, b in zip(streamer.puts, want_streamer.puts, strict=True))
    assert store.stale == 1 and (store.hits, store.misses) == (0, 2)
    assert relay_hf.stats(looped).prefix_hits == 0
    out = looped.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=6, do_sample=False)
    assert looped.relay_last_decision.prefix_kept == 48 and relay_hf.stats(looped).prefix_hits == 1
    assert torch.equal(out, type(looped).generate(looped, input_ids=row, attention_mask=torch.ones_like(row),
                                                   max_new_tokens=6, do_sample=False))


def test_a_check_read_after_the_prefill_that_held_counts_one_hit(looped, prompt):
    ids, mask = batch(prompt, 1)
    looped.generate(ids, attention_mask=mask, **GEN)
    row = torch.cat([prompt, torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(9))])[None]
    out = looped.generate(row, attention_mask=torch.ones_like(row), **GEN)
    store = relay_state(looped).store
    assert looped.relay_last_decision.fast_decode and looped.relay_last_decision.prefix_kept == 48
    assert torch.equal(out, stock(looped, row, torch.ones_like(row)))
    assert (store.hits, store.misses, store.stale) == (1, 1, 0) and relay_hf.stats(looped).prefix_hits == 1


def test_a_document_is_never_prefilled_on_a_kept_prompt_whose_check_is_unread(looped, prompt):
    """A new document under a kept prompt is prefilled after the prompt's KV: the prompt's check is read before that
    prefill, so a stale prompt is prefilled again first and the document kept is computed on the fresh KV (a later
    call that takes both from the store gives stock's tokens)."""
    first = batch(prompt, 1)
    looped.generate(first[0], attention_mask=first[1], **GEN)
    _write_raw_storage(looped)
    document = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(5))
    ids, mask = batch(prompt, 3, own=(4, 2, 6, 3), document=document)
    out = looped.generate(ids, attention_mask=mask, **GEN)
    assert looped.relay_last_decision.used and looped.relay_last_decision.prefix_kept == 0
    assert torch.equal(out, stock(looped, ids, mask))
    store = relay_state(looped).store  # as a check read at once counts: one stale, the two segments prefilled
    assert (store.hits, store.misses, store.stale) == (0, 3, 1)
    ids, mask = batch(prompt, 6, own=(5, 3, 2, 4), document=document)
    out = looped.generate(ids, attention_mask=mask, **GEN)
    assert looped.relay_last_decision.prefix_kept == 48 + 40 and torch.equal(out, stock(looped, ids, mask))


@pytest.mark.parametrize("loop", ["default", "graph"], ids=["check read at once", "check read after the prefill"])
def test_a_document_kept_under_a_prompt_that_went_stale_is_prefilled_again(prompt, loop):
    """A prompt and a document kept under it; then embedding rows of some of the prompt's tokens change (through
    ``.data``: no counter moves), none of the document's or the prompt's first tokens. The prompt fails its check;
    the document's own check (its first tokens recomputed, its own tokens embedded) would pass, but its KV was
    computed after the prompt's stale KV: it is dropped with the prompt and prefilled again, and the call gives
    stock's tokens."""
    m = tiny_model("llama", seed=1)
    relay_hf.patch(m, **({} if loop == "default" else dict(decode=loop)))
    document = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(5))
    ids, mask = batch(prompt, 3, own=(4, 2, 6, 3), document=document)
    m.generate(ids, attention_mask=mask, **GEN)  # keeps the prompt and the document under it
    store = relay_state(m).store
    assert len(store) == 2
    spared = set(document.tolist()) | set(prompt[:8].tolist())
    rows = [int(t) for t in prompt[10:20] if int(t) not in spared]
    assert rows
    table = m.model.embed_tokens.weight
    table.data[rows] = torch.randn(len(rows), table.shape[1], generator=torch.Generator().manual_seed(3))
    ids, mask = batch(prompt, 4, own=(5, 3, 2, 4), document=document)
    out = m.generate(ids, attention_mask=mask, **GEN)
    assert m.relay_last_decision.used and m.relay_last_decision.prefix_kept == 0
    assert torch.equal(out, stock(m, ids, mask))
    assert store.stale == 2 and len(store) == 2
    out = m.generate(ids, attention_mask=mask, **GEN)  # both prefilled anew serve the next call
    assert m.relay_last_decision.prefix_kept == 48 + 40 and torch.equal(out, stock(m, ids, mask))
    relay_hf.unpatch(m)


@pytest.mark.parametrize("loop", ["default", "graph"], ids=["check read at once", "check read after the prefill"])
def test_a_document_kept_under_an_evicted_prompt_is_prefilled_again_with_it(prompt, loop):
    """The prompt is evicted (least recently used: a call reads it before the document under it) and the document
    stays; then embedding rows of some of the prompt's tokens change through ``.data``. The prompt, prefilled anew,
    takes the document along: its KV followed the prompt's old KV, and its own check would pass."""
    m = tiny_model("llama", seed=1)
    relay_hf.patch(m, **({} if loop == "default" else dict(decode=loop)))
    document = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(5))
    ids, mask = batch(prompt, 3, own=(4, 2, 6, 3), document=document)
    m.generate(ids, attention_mask=mask, **GEN)
    store = relay_state(m).store
    store.resize(store.nbytes() + 1)
    other = torch.randint(3, VOCAB, (48,), generator=torch.Generator().manual_seed(77))
    m.generate(*batch(other, 8)[:1], attention_mask=batch(other, 8)[1], **GEN)  # evicts the prompt only
    assert len(store) == 2 and m.relay_last_decision.used
    spared = set(document.tolist()) | set(prompt[:8].tolist())
    rows = [int(t) for t in prompt[10:20] if int(t) not in spared]
    table = m.model.embed_tokens.weight
    table.data[rows] = torch.randn(len(rows), table.shape[1], generator=torch.Generator().manual_seed(3))
    ids, mask = batch(prompt, 4, own=(5, 3, 2, 4), document=document)
    out = m.generate(ids, attention_mask=mask, **GEN)
    assert m.relay_last_decision.used and m.relay_last_decision.prefix_kept == 0
    assert torch.equal(out, stock(m, ids, mask)) and store.stale == 0
    relay_hf.unpatch(m)


def test_a_turn_run_again_counts_only_what_its_run_took(looped, prompt):
    """The prompt's check holds and the document's fails (its own tokens' embedding rows changed): the call runs
    again, and the store counts the prompt's hit once, as a check read at once would."""
    document = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(5))
    ids, mask = batch(prompt, 3, own=(4, 2, 6, 3), document=document)
    looped.generate(ids, attention_mask=mask, **GEN)
    rows = [t for t in sorted(set(document.tolist()) - set(prompt.tolist()))][:3]
    table = looped.model.embed_tokens.weight
    table.data[rows] = torch.randn(len(rows), table.shape[1], generator=torch.Generator().manual_seed(3))
    ids, mask = batch(prompt, 4, own=(5, 3, 2, 4), document=document)
    out = looped.generate(ids, attention_mask=mask, **GEN)
    store = relay_state(looped).store
    assert looped.relay_last_decision.prefix_kept == 48 and torch.equal(out, stock(looped, ids, mask))
    assert (store.hits, store.misses, store.stale) == (1, 3, 1) and relay_hf.stats(looped).prefix_hits == 1
