"""``relay_hf.pin`` / ``unpin``: a pinned prompt stays in the prefix store whatever else passes through it, counts
against its budget, is read by chat turns, batches and the pipeline (stock's tokens, prefilled once), and goes only by
``unpin``, ``clear_prefixes`` or a change that makes it stale."""

import pytest
import torch

import relay_hf
from relay_hf.pinning import chat_prefix_ids, pinned_prompts, prompt_ids
from relay_hf.prefix import Grouping, PrefixTree, split_at_pinned
from relay_hf.state import relay_state
from tests.helpers import VOCAB, left_pad, tiny_model

GEN = dict(max_new_tokens=5, do_sample=False)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _stock(model, ids, mask):
    return type(model).generate(model, input_ids=ids, attention_mask=mask, **GEN)


def _rows(prompt: torch.Tensor, seed: int, shared: int = 0, own=(3, 9, 1, 6)):
    """Rows = ``prompt`` + ``shared`` tokens they all have + their own tokens, left-padded."""
    extra = _ids(shared, seed + 100)
    return left_pad([torch.cat([prompt, extra, _ids(n, seed * 10 + i)]) for i, n in enumerate(own)])


@pytest.fixture
def model():
    m = tiny_model("llama", seed=1)
    relay_hf.patch(m)
    yield m
    relay_hf.unpatch(m)


def test_a_pinned_prompt_is_kept_counted_and_read_by_a_chat_turn(model):
    prompt = _ids(48, 1)
    assert relay_hf.pin(model, prompt) == 48
    store = relay_state(model).store
    assert relay_hf.stats(model).pinned_bytes == store.pinned_nbytes() == store.nbytes() > 0
    assert [p.tolist() for p in pinned_prompts(model)] == [prompt.tolist()]
    row = torch.cat([prompt, _ids(7, 2)])[None]
    out = model.generate(row, attention_mask=torch.ones_like(row), **GEN)
    assert model.relay_last_decision.prefix_kept == 48 and relay_hf.stats(model).prefix_hits == 1
    assert torch.equal(out, _stock(model, row, torch.ones_like(row)))
    assert relay_hf.pin(model, prompt) == 48 and len(store) == 1  # pinning again changes nothing


def test_a_batch_sharing_more_than_the_pinned_prompt_reads_it(model):
    """Rows that share the pinned prompt and a few tokens more (a chat template's next tokens) read the pinned KV
    and prefill only the rest; rows sharing a long continuation get it as a segment under the pinned root."""
    prompt = _ids(40, 3)
    relay_hf.pin(model, prompt)
    for shared, kept in ((3, 40), (36, 40)):
        ids, mask = _rows(prompt, shared, shared=shared)
        out = model.generate(ids, attention_mask=mask, **GEN)
        assert model.relay_last_decision.used and model.relay_last_decision.prefix_kept == kept, shared
        assert torch.equal(out, _stock(model, ids, mask))


def test_a_pinned_prompt_survives_eviction_and_unpin_lets_it_go():
    m = tiny_model("llama", seed=1)
    relay_hf.patch(m)
    prompt = _ids(48, 4)
    relay_hf.pin(m, prompt)
    one = relay_state(m).store.nbytes()
    relay_hf.patch(m, prefix_cache_bytes=int(2.5 * one))  # room for the pinned prompt and one or two others
    for seed in range(5):  # other prompts pass through the store
        other = _ids(48, 50 + seed)
        m.generate(*_rows(other, seed)[:1], attention_mask=_rows(other, seed)[1], **GEN)
    store = relay_state(m).store
    assert store.nbytes() <= store.budget_bytes and store.pinned_nbytes() == one
    assert any(k.tokens == 48 and torch.equal(k.ids(), prompt) for k in store.keys())
    with pytest.raises(ValueError, match="pinned"):
        relay_hf.patch(m, prefix_cache_bytes=one // 2)  # a budget below the pinned bytes is refused
    assert relay_hf.unpin(m, prompt) and not relay_hf.unpin(m, prompt)
    assert relay_hf.stats(m).pinned_bytes == 0
    for seed in range(5, 9):
        other = _ids(48, 50 + seed)
        m.generate(*_rows(other, seed)[:1], attention_mask=_rows(other, seed)[1], **GEN)
    assert not any(torch.equal(k.ids(), prompt) for k in store.keys())  # evicted like any other
    relay_hf.unpatch(m)


def test_clear_prefixes_drops_pins_and_a_changed_model_prefills_the_pinned_prompt_again(model):
    prompt = _ids(48, 5)
    relay_hf.pin(model, prompt)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)  # through torch: the store's entries are stale
    row = torch.cat([prompt, _ids(5, 6)])[None]
    out = model.generate(row, attention_mask=torch.ones_like(row), **GEN)
    assert torch.equal(out, _stock(model, row, torch.ones_like(row)))
    assert model.relay_last_decision.prefix_kept == 0  # prefilled again ...
    assert relay_hf.stats(model).pinned_bytes > 0  # ... and pinned as before
    relay_hf.clear_prefixes(model)
    assert relay_hf.stats(model).pinned_bytes == 0 and not pinned_prompts(model)


def test_a_text_prompt_is_pinned_as_the_pipeline_prefills_it(smollm2, system_prompt):
    """``pin(model, text, tokenizer)`` keys the tokens the pipeline's ``system_prompt`` prefills: a pipeline under
    that prompt takes the pinned KV (a store hit, nothing prefilled again)."""
    model, tokenizer = smollm2
    system = system_prompt.split("\n\n")[0]
    ids = chat_prefix_ids(tokenizer, system)
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "x"}]
    rendered = torch.as_tensor(tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                                             return_dict=True)["input_ids"]).flatten()
    assert ids is not None and torch.equal(rendered[:ids.numel()], ids) and torch.equal(prompt_ids(system, tokenizer),
                                                                                          ids)
    relay_hf.patch(model)
    try:
        assert relay_hf.pin(model, system, tokenizer) == ids.numel()
        pipe = relay_hf.pipeline("text-generation", model=model, tokenizer=tokenizer, system_prompt=system)
        pipe(["What is 2 + 2?", "Name a colour."], max_new_tokens=2, do_sample=False, batch_size=2)
        stats = relay_hf.stats(model)
        assert stats.prefix_hits >= 1 and stats.prefill_tokens_saved >= ids.numel() and stats.pinned_bytes > 0
        pipe.close()
    finally:
        relay_hf.unpatch(model)


@pytest.mark.parametrize("call,match", [
    (lambda m: relay_hf.pin(m, "a text"), "tokenizer"),
    (lambda m: relay_hf.pin(m, []), "no tokens"),
    (lambda m: relay_hf.pin(m, torch.zeros(2, 3, dtype=torch.long)), "shape"),
    (lambda m: relay_hf.pin(m, torch.zeros(4)), "integer"),
    (lambda m: relay_hf.pin(m, torch.zeros(10 ** 6, dtype=torch.long)), "positions"),
    (lambda m: relay_hf.pin(tiny_model("llama"), [5, 6, 7]), "patched"),
])
def test_bad_pins_are_refused_by_name_and_change_nothing(model, call, match):
    with pytest.raises(ValueError, match=match):
        call(model)
    assert relay_hf.stats(model).pinned_bytes == 0 and not len(relay_state(model).store)


def test_a_store_that_keeps_nothing_refuses_a_pin():
    m = relay_hf.patch(tiny_model("llama"), prefix_cache_bytes=0)
    with pytest.raises(ValueError, match="keeps nothing"):
        relay_hf.pin(m, _ids(20, 7))
    m.train()
    relay_hf.patch(m, prefix_cache_bytes=None)
    with pytest.raises(ValueError, match="training"):
        relay_hf.pin(m, _ids(20, 7))
    relay_hf.unpatch(m)


def test_pinned_prompts_over_the_budget_are_refused(model):
    relay_hf.pin(model, _ids(48, 8))
    one = relay_state(model).store.nbytes()
    relay_hf.patch(model, prefix_cache_bytes=int(1.5 * one))
    with pytest.raises(ValueError, match="over prefix_cache_bytes"):
        relay_hf.pin(model, _ids(48, 9))
    assert relay_state(model).store.pinned_nbytes() == one


def test_split_at_pinned_cuts_childless_roots_at_the_longest_pinned_prompt():
    root, other = _ids(50, 10), _ids(30, 11)
    grouping = Grouping(PrefixTree((root, other), (-1, -1)), ((0,), (0,), (1,), (1,)))
    pinned = [root[:20], root[:40], other[:10], _ids(5, 12)]
    cut = split_at_pinned(grouping, pinned, min_length=8)
    assert [t.tolist() for t in cut.tree.ids] == [root[:40].tolist(), other[:10].tolist(), root[40:].tolist(),
                                                  other[10:].tolist()]
    assert cut.tree.parents == (-1, -1, 0, 1) and cut.paths == ((0, 2), (0, 2), (1, 3), (1, 3))
    assert cut.prefix_lengths() == grouping.prefix_lengths()
    short = split_at_pinned(grouping, [root[:45]], min_length=8)  # 5 tokens left: they join the rows' own
    assert short.tree.lengths == (45, 30) and short.paths == grouping.paths
    nested = Grouping(PrefixTree((root, other), (-1, 0)), ((0, 1), (0,)))
    assert split_at_pinned(nested, [root[:20]], 8).tree.lengths == (50, 30)  # a root with a child stays
