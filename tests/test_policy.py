"""Every relay-or-stock rule: when relay pays, and the one frozen route ``decide`` gives each call."""

import copy
import dataclasses

import pytest
import torch

import relay_hf
from relay_hf.dependencies import kv_dependencies
from relay_hf.policy import CUDA_MIN_SHARED_TOKENS, cost_reason, decide
from relay_hf.sampling import loop_sampler
from tests.helpers import VOCAB, shared_prefix_batch, tiny_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_single_row_and_short_prefix_go_plain():
    assert "single row" in cost_reason(1, 4096, CPU, 32)
    assert "min_prefix_length" in cost_reason(8, 16, CPU, 32)
    assert cost_reason(2, 32, CPU, 32) is None


def test_cuda_needs_enough_shared_tokens():
    """The threshold is where the kernel benchmark measured relay beating SDPA over the expanded prefix
    (``benchmarks/kernel.py``; docs/performance.md)."""
    assert cost_reason(4, 512, CUDA, 32) is not None  # below the smallest measured win
    assert cost_reason(8, 512, CUDA, 32) is None
    assert cost_reason(32, 512, CUDA, 32) is None
    assert cost_reason(4, CUDA_MIN_SHARED_TOKENS // 4, CUDA, 32) is None


def test_captured_loop_runs_relay_from_one_row_on_cuda_only():
    assert cost_reason(1, 100, CUDA, 32, captured_loop=True) is None  # the loop, not the kernel, decides
    assert cost_reason(2, 100, CUDA, 32, captured_loop=True) is None  # below CUDA_MIN_SHARED_TOKENS
    assert "min_prefix_length" in cost_reason(1, 16, CUDA, 32, captured_loop=True)
    assert "single row" in cost_reason(1, 4096, CPU, 32, captured_loop=True)  # no captured loop on CPU
    assert "single row" in cost_reason(1, 4096, CUDA, 32)


# -- decide: one frozen route per call -----------------------------------------------------------------------------
def _call(ids, mask, **kw):
    return dict(inputs=ids, attention_mask=mask, **kw)


@pytest.fixture(scope="module")
def batch():
    ids, mask, _ = shared_prefix_batch()
    return ids, mask


@pytest.fixture
def model():
    model = tiny_model("llama")
    relay_hf.patch(model, min_prefix_length=8)
    return model


def test_an_unpatched_model_runs_stock_as_expected(batch):
    route = decide(tiny_model("llama"), _call(*batch))
    assert not route.relay and route.expected and "not patched" in route.reason


def test_a_relay_route_is_frozen_and_says_what_runs(model, batch):
    route = decide(model, _call(*batch, max_new_tokens=5))
    assert route.relay and (route.rows, route.prefix_length, route.new_tokens) == (4, 40, 5) and not route.static
    assert "decode='graph'" in route.loop_reason  # off CUDA the default is transformers' loop, and says so
    with pytest.raises(dataclasses.FrozenInstanceError):
        route.relay = False
    decision = route.decision()
    assert (decision.used, decision.prefix_length, decision.rows) == (True, 40, 4)


# (patch's decode mode, generate arguments) -> what the route, and the sampler the loop builds from it, must say
SCENARIOS = {
    "static: relay_hf's loop, no compile on the CPU": (
        "auto", dict(cache_implementation="static"),
        lambda p, sampler: p.static and p.fast_decode and p.compile_config is None),
    "static sampling: the loop samples too": (
        "auto", dict(cache_implementation="static", do_sample=True),
        lambda p, sampler: p.static and p.fast_decode and sampler.sample),
    "scores: transformers' loop on a static cache": (
        "auto", dict(cache_implementation="static", output_scores=True, return_dict_in_generate=True),
        lambda p, sampler: p.static and not p.fast_decode and "return_dict_in_generate" in p.loop_reason),
    "repetition penalty off the loop: stock (its processor reads pad positions)": (
        "auto", dict(repetition_penalty=1.2),
        lambda p, sampler: not p.relay and "repetition_penalty" in p.reason),
    "repetition penalty on the loop: relay": (
        "graph", dict(repetition_penalty=1.2),
        lambda p, sampler: p.relay and p.fast_decode and sampler.penalty == 1.2),
    "a processor the loop does not serve: transformers' loop": (
        "graph", dict(suppress_tokens=[5]),
        lambda p, sampler: p.relay and not p.fast_decode and "SuppressTokens" in p.loop_reason),
    "beams: relay on transformers' loop": (
        "auto", dict(num_beams=2, num_return_sequences=2),
        lambda p, sampler: p.relay and p.rows == 8 and not p.static),
    "no_repeat_ngram_size: stock, unexpected (warned)": (
        "auto", dict(no_repeat_ngram_size=2),
        lambda p, sampler: not p.relay and not p.expected and "no_repeat_ngram_size" in p.reason),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_scenario_gets_its_route(model, batch, scenario):
    decode, kwargs, holds = SCENARIOS[scenario]
    relay_hf.patch(model, min_prefix_length=8, decode=decode)
    route = decide(model, _call(*batch, max_new_tokens=5, **kwargs))
    # deciding builds no sampler: the loop builds it from the processors the route carries
    assert (route.processors is not None) == route.fast_decode
    sampler = loop_sampler(model, route.gen, route.ids, route.processors) if route.fast_decode else None
    assert holds(route, sampler), route


def test_the_loop_rounds_rows_up_to_a_bucket(model, batch):
    relay_hf.patch(model, min_prefix_length=8, decode="graph")
    ids, mask = batch
    assert decide(model, _call(ids[:3], mask[:3], max_new_tokens=5)).static_rows == 4


def test_one_row_runs_stock_as_expected(model, batch):
    ids, mask = batch
    one = decide(model, _call(ids[:1], mask[:1]))
    assert not one.relay and one.expected and "single row" in one.reason


def test_an_implementation_set_after_patch_is_named(model, batch):
    model.set_attn_implementation("eager")
    assert "set to 'eager'" in decide(model, _call(*batch)).reason


@pytest.mark.gpu
def test_a_kernel_that_cannot_serve_the_gpu_runs_stock_with_the_reason(batch, monkeypatch):
    """patch's probe runs the reference; whether the kernel builds and agrees here is asked before the first call."""
    import relay_hf.policy as policy

    asked = []
    monkeypatch.setattr(policy, "kernel_reason", lambda *key: asked.append(key) or "relay's Triton kernel failed")
    model = tiny_model("llama").to("cuda")
    relay_hf.patch(model, min_prefix_length=8)
    route = decide(model, _call(*(t.to("cuda") for t in batch)))
    assert not route.relay and "Triton kernel failed" in route.reason
    assert asked and asked[0][:2] == (model.device, torch.float32)


def test_no_kernel_check_off_cuda(model, batch, monkeypatch):
    import relay_hf.policy as policy

    monkeypatch.setattr(policy, "kernel_reason", lambda *key: pytest.fail("a CPU model has no Triton kernel to check"))
    assert decide(model, _call(*batch)).relay


# -- a chat turn routed under the model's latest walk ---------------------------------------------------------------
def _turn_under_a_pinned_prompt():
    """A patched tiny model on relay_hf's loop with a 40-token prompt pinned (walked: the model's latest walk), an
    unpatched copy, and a one-row turn under the prompt with its greedy ``generate`` arguments."""
    model = tiny_model("llama")
    stock = copy.deepcopy(model)
    relay_hf.patch(model, min_prefix_length=8, decode="graph")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, VOCAB, (40,), generator=g)
    relay_hf.pin(model, prompt)
    row = torch.cat([prompt, torch.randint(3, VOCAB, (9,), generator=g)])[None]
    return model, stock, row, dict(attention_mask=torch.ones_like(row), max_new_tokens=4, do_sample=False)


def test_a_turn_under_a_kept_prompt_walks_the_model_once_its_prefill_is_launched(monkeypatch):
    """A call on relay_hf's loop that reads the prefix store is routed under the model's latest walk
    (``Route.deferred_walk``: the same ``Dependencies``) and walks the model itself after its prefill, once; the
    tokens are stock's. Without ``defer_walk``, where a segment is not kept or a kept check's graph could not be
    launched, or off relay_hf's loop, the route walks first."""
    import relay_hf.decode as decode
    import relay_hf.policy as policy

    model, stock, row, gen = _turn_under_a_pinned_prompt()
    call = _call(row, gen["attention_mask"], max_new_tokens=4)

    def launched(grouping, check_row):  # every kept check launched (or none recorded as a graph)
        return True

    route = decide(model, call, launched, defer_walk=True)
    assert route.deferred_walk and route.depends == kv_dependencies(model)
    assert not decide(model, call, launched).deferred_walk
    refused = lambda grouping, check_row: False  # noqa: E731 - a check refused its launch
    assert not decide(model, call, refused, defer_walk=True).deferred_walk
    assert not decide(model, {**call, "num_beams": 2}, launched, defer_walk=True).deferred_walk  # transformers' loop
    events = []
    walk, prefill = policy.walk, decode._prefill
    monkeypatch.setattr(policy, "walk", lambda m: events.append("walk") or walk(m))
    monkeypatch.setattr(decode, "_prefill", lambda *a, **k: events.append("prefill") or prefill(*a, **k))
    for _ in range(2):
        events.clear()
        assert torch.equal(model.generate(row, **gen), stock.generate(row, **gen))
        assert events == ["prefill", "walk"] and model.relay_last_decision.prefix_kept == 40
    ids, mask, _ = shared_prefix_batch(seed=9)  # a new shared prefix: not kept yet, so the call walks first
    events.clear()
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False),
                       stock.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))
    assert events[:2] == ["walk", "prefill"] and model.relay_last_decision.prefix_kept == 0


def _write_in_place(m):
    with torch.no_grad():
        m.model.layers[1].mlp.up_proj.weight.mul_(1.5)


CHANGES = {  # a change the walk sees, made to the model and to its stock copy alike
    "a hook added": lambda m: m.model.layers[1].mlp.register_forward_hook(lambda mod, args, out: out * 1.5),
    "a parameter replaced": lambda m: setattr(m.model.layers[1].mlp.up_proj, "weight", torch.nn.Parameter(
        m.model.layers[1].mlp.up_proj.weight.detach() * 1.5)),
    "a module replaced": lambda m: setattr(m.model, "norm", torch.nn.Identity()),
    "a write in place": _write_in_place,
    "the dtype": lambda m: m.to(torch.float64),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_turn_after_a_change_is_decided_again_and_gives_stock_tokens(change, monkeypatch):
    """A model changed since its latest walk: the turn routed under that walk finds the change in its own walk (or
    fails on it first: the dtype) and is decided again, walking first; its first run's hit is not counted. Stock's
    tokens (a copy changed the same way), and the next turn is routed under the new walk."""
    import relay_hf.generate as generate

    model, stock, row, gen = _turn_under_a_pinned_prompt()
    model.generate(row, **gen)
    for m in (model, stock):
        CHANGES[change](m)
    routes = []
    real = generate.decide
    monkeypatch.setattr(generate, "decide", lambda *a, **k: routes.append(real(*a, **k)) or routes[-1])
    hits = relay_hf.stats(model).prefix_hits
    assert torch.equal(model.generate(row, **gen), stock.generate(row, **gen))
    assert [r.deferred_walk for r in routes] == [True, False]
    assert relay_hf.stats(model).prefix_hits == hits  # (the change dropped the kept prompt: prefilled again)
    routes.clear()
    assert torch.equal(model.generate(row, **gen), stock.generate(row, **gen))
    assert [r.deferred_walk for r in routes] == [True] and relay_hf.stats(model).prefix_hits == hits + 1


def test_a_turn_whose_prefix_is_all_kept_gets_a_check_row_where_its_prefill_is_recorded(monkeypatch):
    """Routed as on CUDA (``runs_captured``): a one-row turn under a kept prompt is told before the walk that it may
    run a check row (so it launches no check), and, every segment kept, runs at two rows with the row, laid out at
    a recorded length; where a segment is not kept, or the call has two rows (a full bucket), or its own tokens are
    past every recorded length, at its own bucket without one."""
    import relay_hf.policy as policy

    model, _, row, gen = _turn_under_a_pinned_prompt()
    monkeypatch.setattr(policy, "runs_captured", lambda model, fast: fast)
    told = []

    def before_walk(answer):
        return lambda grouping, check_row: told.append(check_row) or answer

    call = _call(row, gen["attention_mask"], max_new_tokens=4)
    route = decide(model, call, before_walk(True))
    assert told == [True] and route.check_row and route.static_rows == 2 and route.suffix_columns == 16
    route = decide(model, call, before_walk(False))
    assert told[-1] and not route.check_row and route.static_rows == 1
    two = torch.cat([row, torch.cat([row[:, :40], row[:, 40:] % (VOCAB - 3) + 3], 1)])
    route = decide(model, _call(two, torch.ones_like(two), max_new_tokens=4), before_walk(True))
    assert told[-1] is False and not route.check_row and route.static_rows == 2
    long = torch.cat([row, torch.randint(3, VOCAB, (1, 300))], 1)
    route = decide(model, _call(long, torch.ones_like(long), max_new_tokens=4), before_walk(True))
    assert told[-1] is False and not route.check_row and route.static_rows == 1
