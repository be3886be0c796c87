"""Rotary embeddings whose frequencies follow a forward's length: dynamic NTK (rescaled to the longest position past
``max_position_embeddings``) and longrope (Phi-3's long factors past ``original_max_position_embeddings``, where
Phi-3's ``generate`` also recomputes the whole sequence). Relay prefills the shared prefix alone, at its own length,
so a call that can cross that point runs stock and says why; calls that stay below it (and, for longrope, calls whose
every shared prefix is already past it) keep relay with stock's tokens.

Tiny random fp32 models with larger weights than the helpers' (``initializer_range=0.3``): with them a change of
frequencies changes the greedy tokens, so a test that compares tokens sees it."""

import pytest
import torch

import relay_hf
from relay_hf import policy
from relay_hf.policy import decide, model_reason
from relay_hf.rope import rope_limits
from tests.helpers import shared_prefix_batch, tiny_model

LIMIT = 40  # positions: max_position_embeddings (dynamic NTK), original_max_position_embeddings (longrope)
SUFFIXES = (3, 9, 1)
# (shared prefix, new tokens) against LIMIT: the longest row (prefix + 9) plus the new tokens
CROSSING = (36, 12)  # the prompt's longest row (45) is past LIMIT, the prefix (36) is not
BELOW = (20, 8)  # 29 + 8 = 37 positions
PAST = (44, 12)  # the prefix alone is past LIMIT


def _dynamic(limit: int = LIMIT):
    return tiny_model("llama", initializer_range=0.3, max_position_embeddings=limit,
                      rope_parameters={"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0})


def _longrope(limit: int = LIMIT, init: float = 0.3):
    head = 16  # the tiny Phi-3's head dim: 8 factors of each kind
    return tiny_model("phi3", initializer_range=init, max_position_embeddings=1024,
                      original_max_position_embeddings=limit,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                       "short_factor": [1.0] * (head // 2),
                                       "long_factor": [1.0 + 4 * i for i in range(head // 2)]})


def _pair(make, decode: str):
    """Two models with the same weights, one stock and one patched: dynamic NTK keeps the frequencies a forward grew
    it to for the next forwards (stock's own tokens depend on the calls before), so each side keeps its own history."""
    stock, patched = make(), make()
    relay_hf.patch(patched, min_prefix_length=8, decode=decode)
    return stock, patched


def _both(stock, patched, case, seed: int = 0):
    """The call on both models; returns ``(stock's, relay's)`` sequences."""
    prefix, new = case
    ids, mask, _ = shared_prefix_batch(prefix_len=prefix, suffix_lens=SUFFIXES, seed=seed)
    gen = dict(attention_mask=mask, max_new_tokens=new, do_sample=False)
    return stock.generate(ids, **gen), patched.generate(ids, **gen)


@pytest.mark.parametrize("make, decode", [(_dynamic, "auto"), (_longrope, "graph")], ids=["dynamic", "longrope"])
def test_relay_serving_a_crossing_call_would_change_its_tokens(make, decode, monkeypatch):
    """The premise of the tests below: on these models relay's prefix prefilled alone, at its base frequencies, gives
    other tokens than stock's whole prompt, so a test comparing tokens sees relay serving such a call."""
    monkeypatch.setattr(policy, "rope_reason", lambda *args: None)
    stock, patched = _pair(make, decode)
    want, got = _both(stock, patched, CROSSING)
    assert patched.relay_last_decision.used and not torch.equal(want, got)


@pytest.mark.parametrize("decode", ["auto", "graph"])
def test_dynamic_ntk_runs_stock_past_max_positions_and_relay_below(decode):
    stock, patched = _pair(_dynamic, decode)
    want, got = _both(stock, patched, CROSSING)
    decision = patched.relay_last_decision
    assert not decision.used, decision
    assert "dynamic NTK" in decision.reason and f"max_position_embeddings={LIMIT}" in decision.reason, decision.reason
    assert torch.equal(want, got)
    counted = relay_hf.stats(patched)
    assert (counted.stock_calls, counted.relay_steps, counted.kv_bytes_not_reread) == (1, 0, 0)
    # below the limit, after that call grew both models' frequencies: the first forward of each resets them
    want, got = _both(stock, patched, BELOW, seed=1)
    decision = patched.relay_last_decision
    assert decision.used and decision.fast_decode == (decode == "graph"), decision
    assert torch.equal(want, got)
    assert relay_hf.stats(patched).relay_steps == BELOW[1] - 1


@pytest.mark.parametrize("decode", ["auto", "graph"])
def test_longrope_runs_stock_across_its_switch_and_relay_on_either_side(decode):
    stock, patched = _pair(_longrope, decode)
    want, got = _both(stock, patched, CROSSING)
    decision = patched.relay_last_decision
    assert not decision.used, decision
    assert "longrope" in decision.reason and f"original_max_position_embeddings={LIMIT}" in decision.reason
    assert torch.equal(want, got)
    assert relay_hf.stats(patched).stock_calls == 1 and relay_hf.stats(patched).relay_steps == 0
    for case in (BELOW, PAST):  # every forward short, or every forward (the prefix's too) long
        want, got = _both(stock, patched, case, seed=2)
        decision = patched.relay_last_decision
        assert decision.used and decision.fast_decode == (decode == "graph"), (case, decision)
        assert torch.equal(want, got), case
    assert relay_hf.stats(patched).stock_calls == 1


def test_a_relay_cache_whose_prefix_is_below_the_switch_serves_no_crossing_call():
    """The caller's own ``RelayCache`` is held to the same rule as a prefix relay finds itself."""
    model = relay_hf.patch(_longrope(), min_prefix_length=8, decode="graph")
    ids, mask, prefix = shared_prefix_batch(prefix_len=CROSSING[0], suffix_lens=SUFFIXES)
    cache = relay_hf.RelayCache.from_prefix(model, prefix)
    plan = decide(model, dict(inputs=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=CROSSING[1]))
    assert not plan.relay and not plan.expected and "longrope" in plan.reason
    ids, mask, _ = shared_prefix_batch(prefix_len=CROSSING[0], suffix_lens=(1, 2, 1))  # 38 columns + 2 tokens
    plan = decide(model, dict(inputs=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2))
    assert plan.relay, plan.reason


def test_limits_name_the_rope_and_phi3s_recompute():
    (dynamic,) = rope_limits(_dynamic())
    assert (dynamic.positions, dynamic.beyond) == (LIMIT, False)
    kinds = {limit.what.split()[0]: (limit.positions, limit.beyond) for limit in rope_limits(_longrope())}
    assert kinds == {"longrope": (LIMIT, True), "Phi3ForCausalLM.generate": (LIMIT, True)}
    assert rope_limits(tiny_model("llama")) == []  # default RoPE: nothing depends on the length


def test_the_probe_declines_a_dynamic_rope_too_short_to_probe_below_and_names_it():
    """A probe past the limit would compare frequencies relay never runs with (its prompt rescaled, relay's prefix
    not) and call the model's attention non-standard."""
    with pytest.warns(relay_hf.RelayFallbackWarning, match="dynamic NTK"):
        model = relay_hf.patch(_dynamic(limit=6), min_prefix_length=8)
    assert "dynamic NTK" in model_reason(model) and "non-standard" not in model_reason(model)
    model = relay_hf.patch(_dynamic(limit=12), min_prefix_length=8)  # room below the limit for the probe
    assert model_reason(model) is None


def test_the_probe_runs_past_a_short_longrope_switch_and_accepts_the_model():
    """Past the switch every forward takes the long factors, relay's as stock's: a model whose switch comes before
    the probe's prompt ends is probed there, and relay then serves the calls whose prefix is past it."""
    model = relay_hf.patch(_longrope(limit=6, init=0.02), min_prefix_length=8, decode="graph")
    assert model_reason(model) is None, model_reason(model)
    stock = _longrope(limit=6, init=0.02)
    want, got = _both(stock, model, (12, 6))
    assert model.relay_last_decision.used and torch.equal(want, got)


def test_phi3s_recompute_counts_the_columns_of_relays_own_layout():
    """Phi-3's ``generate`` recomputes the sequence once its ids (relay's layout, on transformers' loop) pass
    ``original_max_position_embeddings``, dropping relay's cache. Two prompts of 24 and 8 tokens under rows of 25
    tokens lay out in 24 + 17 columns: past the point with 4 new tokens, while the stock prompt's 25 + 4 is not."""
    model = relay_hf.patch(tiny_model("phi3", original_max_position_embeddings=30), min_prefix_length=8)
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(3, 256, (n,), generator=g)  # noqa: E731
    long, short = rand(24), rand(8)
    rows = [torch.cat([long, rand(1)]), torch.cat([short, rand(17)]), torch.cat([long, rand(1)]),
            torch.cat([short, rand(17)])]
    ids, mask = torch.stack(rows), torch.ones(4, 25, dtype=torch.long)
    plan = decide(model, dict(inputs=ids, attention_mask=mask, max_new_tokens=4))
    assert not plan.relay and "Phi3ForCausalLM.generate recomputes" in plan.reason and "45 positions" in plan.reason
    plan = decide(model, dict(inputs=ids[::2], attention_mask=mask[::2], max_new_tokens=4))  # one prompt: 29
    assert plan.relay, plan.reason
