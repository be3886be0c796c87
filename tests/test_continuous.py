"""relay_hf.continuous: transformers' continuous batching on a patched model gives stock continuous batching's tokens,
reads shared blocks once per step where requests share them (``relay_hf.stats``), and runs stock where relay cannot
serve."""

import gc
import time
import weakref
from unittest import mock

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import relay_hf
from relay_hf._compat import attn_implementation
from relay_hf.names import is_relay_name
from tests.helpers import VOCAB, tiny_model

PAGE = 16
_FIELDS = ContinuousBatchingConfig.__dataclass_fields__
# transformers 5.17 calls the page a block
_PAGE_KW = {"page_size": PAGE} if _FIELDS.get("page_size") and _FIELDS["page_size"].default is not None else {
    "block_size": PAGE}


def cb_config(**kw):
    """Small, explicit sizes: without them transformers sizes the paged cache from the machine's memory."""
    return ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=64, **_PAGE_KW, **kw)


def greedy(n=10):
    return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)


def _tokens(g, n):
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def requests_under(prompts, seed=0, own=(3, 9, 1, 14, 6)):
    """Per system prompt length in ``prompts``, requests = that prompt + own tokens of the lengths ``own`` (cycled)."""
    g = torch.Generator().manual_seed(seed)
    out, k = [], 0
    for length, rows in prompts:
        prompt = _tokens(g, length)
        for _ in range(rows):
            out.append(prompt + _tokens(g, own[k % len(own)]))
            k += 1
    return out


def tokens(results, n):
    return [results[f"req_{i}"].generated_tokens for i in range(n)]


@pytest.fixture
def llama():
    return tiny_model("llama", seed=3)


def stock_then_relay(model, inputs, gen, cbc=None, min_prefix_length=8):
    stock = tokens(model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cbc or cb_config()),
                   len(inputs))
    relay_hf.patch(model, min_prefix_length=min_prefix_length)
    relay = tokens(model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cbc or cb_config()),
                   len(inputs))
    return stock, relay


@pytest.mark.parametrize("prompts", [[(48, 6)], [(40, 3), (35, 3), (0, 1)]], ids=["one prompt", "several + none"])
def test_generate_batch_gives_stock_tokens_and_reads_shared_blocks_once(llama, prompts):
    inputs = requests_under(prompts)
    stock, relay = stock_then_relay(llama, inputs, greedy())
    assert relay == stock and all(len(t) == 10 for t in relay)
    seen = relay_hf.stats(llama)
    assert seen.relay_steps > 0 and seen.kv_bytes_not_reread > 0
    assert llama.config._attn_implementation == "relay"  # the manager switched back when it stopped
    assert llama.relay_continuous_reason is None


def test_a_document_under_a_prompt_is_a_second_shared_level(llama):
    g = torch.Generator().manual_seed(1)
    prompt, document = _tokens(g, 32), _tokens(g, 32)
    inputs = [prompt + document + _tokens(g, n) for n in (2, 5, 9)] + [prompt + _tokens(g, n) for n in (4, 7)]
    stock, relay = stock_then_relay(llama, inputs, greedy(8))
    assert relay == stock and relay_hf.stats(llama).relay_steps > 0


def test_requests_that_share_nothing_give_stock_tokens_and_count_no_relay_step(llama):
    inputs = requests_under([(0, 4)], own=(20, 33, 7, 12))
    stock, relay = stock_then_relay(llama, inputs, greedy())
    assert relay == stock
    assert relay_hf.stats(llama).relay_steps == 0 and relay_hf.stats(llama).kv_bytes_not_reread == 0


def test_seeded_sampling_gives_stock_tokens(llama):
    inputs = requests_under([(48, 5)], seed=2)
    gen = GenerationConfig(max_new_tokens=10, do_sample=True, top_k=20, temperature=0.9, eos_token_id=2,
                           pad_token_id=0)
    stock, relay = stock_then_relay(llama, inputs, gen, cb_config(seed=11))
    assert relay == stock and relay_hf.stats(llama).relay_steps > 0


def _stream_until(manager, request_id, n, timeout=60.0):
    """Wait until ``request_id`` has streamed ``n`` tokens (bounded in time)."""
    deadline = time.monotonic() + timeout
    for out in manager.request_id_iter(request_id):
        if len(out.generated_tokens) >= n or time.monotonic() > deadline:
            return out


def finished(manager, n: int, skip=None, timeout: float = 120.0) -> dict:
    """Request id -> generated tokens of the first ``n`` requests to finish (``skip``'s aside), bounded in time."""
    got, deadline = {}, time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished() and out.request_id != skip:
            got[out.request_id] = out.generated_tokens
    return got


def test_requests_added_while_others_decode_and_a_cancelled_one(llama):
    inputs = requests_under([(48, 4)], seed=4)
    gen = greedy(24)
    want = [llama.generate(torch.tensor([p]), generation_config=gen)[0, len(p):].tolist() for p in inputs]
    relay_hf.patch(llama, min_prefix_length=8)
    manager = llama.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config())
    manager.start()
    try:
        first = [manager.add_request(inputs[i], request_id=f"r{i}", streaming=True) for i in (0, 1)]
        assert len(_stream_until(manager, first[0], 3).generated_tokens) >= 3  # decoding now
        manager.add_request(inputs[2], request_id="r2")
        doomed = manager.add_request(inputs[3], request_id="doomed", max_new_tokens=200)
        manager.cancel_request(doomed)
        manager.add_request(inputs[3], request_id="r3")
        got = finished(manager, 4, skip=doomed)
    finally:
        manager.stop(block=True, timeout=30)
    assert [got.get(f"r{i}") for i in range(4)] == want
    assert relay_hf.stats(llama).relay_steps > 0
    assert llama.config._attn_implementation == "relay"


def test_sliding_window_layers_run_stock_continuous_batching():
    model = tiny_model("mistral", seed=5, sliding_window=24)
    inputs = requests_under([(40, 4)], seed=5)
    stock, relay = stock_then_relay(model, inputs, greedy())
    assert relay == stock
    assert "sliding" in model.relay_continuous_reason and relay_hf.stats(model).relay_steps == 0
    assert model.config._attn_implementation == "relay"


def test_a_config_that_asks_for_cuda_graphs_runs_stock_and_is_not_modified(llama):
    inputs = requests_under([(48, 3)], seed=6)
    cbc = cb_config(use_cuda_graph=True)
    stock, relay = stock_then_relay(llama, inputs, greedy(), cbc)
    assert relay == stock and "CUDA graphs" in llama.relay_continuous_reason
    assert cbc.use_cuda_graph is True and relay_hf.stats(llama).relay_steps == 0


def test_unpatch_leaves_stock_continuous_batching(llama):
    inputs = requests_under([(48, 3)], seed=7)
    stock = tokens(llama.generate_batch(inputs, generation_config=greedy(), continuous_batching_config=cb_config()), 3)
    hooks = len(llama._forward_pre_hooks)
    relay_hf.patch(llama, min_prefix_length=8)
    relay_hf.unpatch(llama)
    assert "init_continuous_batching" not in llama.__dict__ and len(llama._forward_pre_hooks) == hooks
    again = tokens(llama.generate_batch(inputs, generation_config=greedy(), continuous_batching_config=cb_config()), 3)
    assert again == stock and llama.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="patched"):
        relay_hf.stats(llama)


def test_generate_while_a_manager_runs_gives_stock_tokens_or_a_clear_error(llama):
    from relay_hf._compat import masks_skip_paged_cache

    g = torch.Generator().manual_seed(8)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in (40, 33)]
    ids = torch.stack([torch.cat([torch.zeros(40 - len(r), dtype=torch.long), r]) for r in rows])
    mask = (ids != 0).long()
    want = llama.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    relay_hf.patch(llama, min_prefix_length=8)
    manager = llama.init_continuous_batching(generation_config=greedy(), continuous_batching_config=cb_config())
    manager.start()
    try:
        if masks_skip_paged_cache():
            assert torch.equal(llama.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False), want)
        else:
            with pytest.raises(ValueError, match="continuous batching manager"):
                llama.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        with pytest.raises(ValueError, match="stop it before relay_hf.unpatch"):
            relay_hf.unpatch(llama)
    finally:
        manager.stop(block=True, timeout=30)
    assert llama.config._attn_implementation == "relay"
    relay_hf.unpatch(llama)
    assert llama.config._attn_implementation == "sdpa"


def test_two_managers_keep_relay_until_the_last_stops(llama):
    inputs = requests_under([(48, 3)], seed=9)
    want = [llama.generate(torch.tensor([p]), generation_config=greedy())[0, len(p):].tolist() for p in inputs]
    relay_hf.patch(llama, min_prefix_length=8)
    first = llama.init_continuous_batching(generation_config=greedy(), continuous_batching_config=cb_config())
    second = llama.init_continuous_batching(generation_config=greedy(), continuous_batching_config=cb_config())
    first.start()
    second.start()
    first.stop(block=True, timeout=30)
    assert llama.config._attn_implementation != "relay"  # the second still runs under relay's paged name
    try:
        for i, ids in enumerate(inputs):
            second.add_request(ids, request_id=f"r{i}")
        got = {}
        deadline = time.monotonic() + 60
        while len(got) < len(inputs) and time.monotonic() < deadline:
            out = second.get_result(timeout=1)
            if out is not None and out.is_finished():
                got[out.request_id] = out.generated_tokens
    finally:
        second.stop(block=True, timeout=30)
    assert [got.get(f"r{i}") for i in range(len(inputs))] == want
    assert llama.config._attn_implementation == "relay"


def test_a_config_carried_by_the_generation_config_is_honoured(llama):
    inputs = requests_under([(48, 4)], seed=10)
    gen = GenerationConfig(max_new_tokens=8, do_sample=True, top_k=20, eos_token_id=2, pad_token_id=0)
    gen.continuous_batching_config = cb_config(seed=123)
    stock = tokens(llama.generate_batch(inputs, generation_config=gen), len(inputs))
    relay_hf.patch(llama, min_prefix_length=8)
    relay = tokens(llama.generate_batch(inputs, generation_config=gen), len(inputs))
    assert relay == stock and relay_hf.stats(llama).relay_steps > 0


def test_unpatch_drops_a_persistent_manager_built_for_relay(llama):
    inputs = requests_under([(48, 3)], seed=11)
    stock = tokens(llama.generate_batch(inputs, generation_config=greedy(), continuous_batching_config=cb_config()), 3)
    relay_hf.patch(llama, min_prefix_length=8)
    relay = tokens(llama.generate_batch(inputs, generation_config=greedy(), continuous_batching_config=cb_config(),
                                        persistent_manager=True), 3)
    relay_hf.unpatch(llama)
    again = tokens(llama.generate_batch(inputs, generation_config=greedy(), continuous_batching_config=cb_config(),
                                        persistent_manager=True), 3)
    llama.destroy_cached_continuous_batching_manager()
    assert relay == stock and again == stock and llama.config._attn_implementation == "sdpa"


def freed_without_the_cycle_collector(model, make) -> bool:
    """Whether the manager ``make(model)`` returns (stopped) is gone as soon as the model lets go of it, with the
    cyclic collector off: a manager kept alive by a reference cycle keeps its paged cache, most of a GPU's memory."""
    gc.collect()
    gc.disable()
    try:
        ref = weakref.ref(make(model))
        model.destroy_cached_continuous_batching_manager()
        return ref() is None
    finally:
        gc.enable()


def persistent_generate_batch(model):
    inputs = requests_under([(48, 3)], seed=12)
    model.generate_batch(inputs, generation_config=greedy(), continuous_batching_config=cb_config(),
                         persistent_manager=True)
    return model._cached_continuous_batching_manager


def started_and_stopped(model):
    manager = model.init_continuous_batching(generation_config=greedy(), continuous_batching_config=cb_config())
    manager.start()
    assert None not in _serve(manager, requests_under([(48, 2)], seed=13))
    manager.stop(block=True, timeout=60)
    return manager


@pytest.mark.parametrize("make", [persistent_generate_batch, started_and_stopped])
def test_a_manager_let_go_of_is_freed_at_once_as_stock(llama, make):
    assert freed_without_the_cycle_collector(llama, make)  # stock's
    relay_hf.patch(llama, min_prefix_length=8)
    assert freed_without_the_cycle_collector(llama, make)
    assert relay_hf.stats(llama).relay_steps > 0 and is_relay_name(attn_implementation(llama.config))


def test_a_stop_that_outlives_its_manager_still_counts_it_out(llama):
    relay_hf.patch(llama, min_prefix_length=8)
    llama.init_continuous_batching(generation_config=greedy(), continuous_batching_config=cb_config()).stop()
    manager = llama.init_continuous_batching(generation_config=greedy(), continuous_batching_config=cb_config())
    stop = manager.stop
    del manager  # nothing holds it now: the kept stop finds it gone
    stop(block=True)
    assert is_relay_name(attn_implementation(llama.config))
    relay_hf.unpatch(llama)  # refused while a manager counts as running
    assert llama.config._attn_implementation == "sdpa"


def test_the_wrapped_stop_finds_the_classes_stop_as_attribute_lookup_does(llama):
    relay_hf.patch(llama, min_prefix_length=8)
    manager = llama.init_continuous_batching(generation_config=greedy(), continuous_batching_config=cb_config())
    with mock.patch.object(type(manager), "stop") as stock_stop:  # a mock on the class: not bound to the manager
        manager.stop(block=True, timeout=1)
    stock_stop.assert_called_once_with(block=True, timeout=1)
    assert is_relay_name(attn_implementation(llama.config))


# -- unpatch and managers, in every order of events ------------------------------------------------------------------
def _serve(manager, inputs, timeout=120.0) -> list:
    """Every request of ``inputs`` through a running ``manager``: the generated tokens, in order."""
    ids = [manager.add_request(p, request_id=f"s{i}") for i, p in enumerate(inputs)]
    got = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(ids) and time.monotonic() < deadline:
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            got[out.request_id] = out.generated_tokens
    return [got.get(i) for i in ids]


# stock-served: relay runs stock continuous batching for the manager of a sliding-window model (or of a config that
# asks for CUDA graphs); a manager started before patch is stock's own, whatever the model
STOCK_SERVED_ORDERS = [
    ("patch", "start", "unpatch", "serve", "stop"),
    ("patch", "start", "stop", "unpatch"),
    ("start", "patch", "stop", "unpatch"),
    ("start", "patch", "unpatch", "stop"),
    ("patch", "start", "unpatch", "stop", "patch", "unpatch"),
    ("patch", "start", "unpatch", "patch", "stop", "unpatch"),
    ("patch", "start", "unpatch", "patch", "unpatch", "stop"),
    ("patch", "start", "start", "stop", "unpatch", "stop"),
]
# relay-served: unpatch is refused while the manager runs relay attention, and undoes everything once it stopped
RELAY_SERVED_ORDERS = [
    ("patch", "start", "serve", "stop", "unpatch"),
    ("patch", "start", "refused unpatch", "serve", "stop", "unpatch"),
    ("patch", "start", "stop", "unpatch", "patch", "start", "stop", "unpatch"),
    ("start", "patch", "stop", "unpatch"),
    ("start", "patch", "unpatch", "stop"),
]


def _run_events(model, events, inputs, want, cbc):
    """Play ``events`` on ``model``: patch / unpatch / a refused unpatch, start a manager, stop the oldest running
    one, serve ``inputs`` on the newest (its tokens must be ``want``). A stop leaves the managers still running on
    the attention they run."""
    running = []
    try:
        for event in events:
            if event == "patch":
                relay_hf.patch(model, min_prefix_length=8)
            elif event == "unpatch":
                relay_hf.unpatch(model)
            elif event == "refused unpatch":
                with pytest.raises(ValueError, match="stop it before relay_hf.unpatch"):
                    relay_hf.unpatch(model)
                assert relay_hf.is_patched(model)
            elif event == "start":
                running.append(model.init_continuous_batching(generation_config=greedy(),
                                                              continuous_batching_config=cbc))
                running[-1].start()
            elif event == "stop":
                running.pop(0).stop(block=True, timeout=30)
                if running:  # the others still run stock continuous batching: the model stays off relay
                    assert not is_relay_name(attn_implementation(model.config))
            else:
                assert _serve(running[-1], inputs) == want, event
    finally:  # a failed check leaves no manager thread behind
        for manager in running:
            manager.stop(block=True, timeout=30)
    assert not running


def _check_stock(model, inputs, want, cbc, hooks):
    """The model is stock again: its own attention, no patch, no hook, stock continuous batching's tokens."""
    assert attn_implementation(model.config) == "sdpa" and not relay_hf.is_patched(model)
    assert "init_continuous_batching" not in model.__dict__ and len(model._forward_pre_hooks) == hooks
    again = tokens(model.generate_batch(inputs, generation_config=greedy(), continuous_batching_config=cbc),
                   len(inputs))
    assert again == want and attn_implementation(model.config) == "sdpa"


@pytest.mark.parametrize("served", ["sliding window", "CUDA graphs asked"])
@pytest.mark.parametrize("events", STOCK_SERVED_ORDERS, ids=" > ".join)
def test_unpatch_leaves_stock_in_every_order_with_a_stock_served_manager(events, served):
    if served == "sliding window":
        model, cbc = tiny_model("mistral", seed=5, sliding_window=24), cb_config()
    else:
        model, cbc = tiny_model("llama", seed=3), cb_config(use_cuda_graph=True)
    inputs = requests_under([(40, 3)], seed=12)
    want = tokens(model.generate_batch(inputs, generation_config=greedy(), continuous_batching_config=cbc), 3)
    hooks = len(model._forward_pre_hooks)
    _run_events(model, events, inputs, want, cbc)
    _check_stock(model, inputs, want, cbc, hooks)


@pytest.mark.parametrize("events", RELAY_SERVED_ORDERS, ids=" > ".join)
def test_unpatch_leaves_stock_in_every_order_with_a_relay_served_manager(llama, events):
    inputs = requests_under([(40, 3)], seed=13)
    want = tokens(llama.generate_batch(inputs, generation_config=greedy(), continuous_batching_config=cb_config()), 3)
    hooks = len(llama._forward_pre_hooks)
    _run_events(llama, events, inputs, want, cb_config())
    _check_stock(llama, inputs, want, cb_config(), hooks)
