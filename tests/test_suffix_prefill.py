"""The rows' own tokens prefilled at a recorded length (``relay_hf/suffix_prefill.py``; the lengths in
``DecodeConfig.prefill_lengths``): the extra suffix columns are masked padding, so tokens stay stock's (on the CPU
with the layout widened by hand, on CUDA as ``patch`` lays calls out), and on CUDA a chat turn under a pinned prompt
replays one recorded prefill per length."""

import dataclasses

import pytest
import torch

import relay_hf
from relay_hf import generate as generate_module
from relay_hf.graphs import Eager
from relay_hf.state import relay_state
from relay_hf.step import DEFAULT_DECODE, DecodeConfig
from relay_hf.suffix_prefill import _Graph, recorded_length
from tests.helpers import VOCAB, run_stock, shared_prefix_batch, tiny_model


def test_prefill_length_is_the_next_recorded_length_within_the_token_budget():
    decode = DecodeConfig(prefill_lengths=(16, 64), prefill_tokens=256)
    assert [decode.prefill_length(1, s) for s in (1, 16, 17, 64, 65)] == [16, 16, 64, 64, None]
    assert decode.prefill_length(4, 40) == 64 and decode.prefill_length(8, 40) is None  # 8 x 64 > 256
    assert decode.prefill_length(16, 3) == 16 and decode.prefill_length(17, 3) is None
    assert DecodeConfig(prefill_lengths=()).prefill_length(1, 1) is None
    assert all(DEFAULT_DECODE.prefill_length(1, n) == n for n in DEFAULT_DECODE.prefill_lengths)


def test_recorded_length_leaves_out_one_token_windowed_models_and_a_model_whose_recording_failed():
    """A one-token suffix (a one-row call's own prefix leaves one), sliding-window layers (their trimmed prefixes'
    tables are pinned for the decode shape) and a model whose recording failed run eagerly at their own length."""
    model = relay_hf.patch(tiny_model("llama"))
    assert recorded_length(model, 4, 9) == DEFAULT_DECODE.prefill_length(4, 9) == 16
    assert recorded_length(model, 4, 1) is None
    assert recorded_length(model, 1, 300) is None  # past the longest recorded length
    windowed = relay_hf.patch(tiny_model("mistral", sliding_window=16))
    assert recorded_length(windowed, 4, 9) is None
    relay_state(model).stop_recording_prefills("no capture here")
    assert recorded_length(model, 4, 9) is None and relay_state(model).prefill_eager == "no capture here"


@pytest.mark.parametrize("arch, window", [("llama", None), ("qwen2", None), ("mistral", 16)])
def test_a_call_laid_out_at_more_suffix_columns_gives_stock_tokens(monkeypatch, arch, window):
    """On the CPU, relay_hf's loop (``decode="graph"``) with every call's layout widened as a recorded length would
    widen it (``Route.suffix_columns``, the static capacity with it): greedy and sampled, the tokens and the RNG are
    stock's, and the slot was laid out that wide; also with a sliding window shorter than the prompt (the masked
    columns do not count as positions)."""
    model = tiny_model(arch, **({} if window is None else dict(sliding_window=window)))
    ids, mask, _ = shared_prefix_batch(suffix_lens=(3, 9, 1), seed=70)
    real = generate_module.decide

    def widened(model, call, *rest):
        route = real(model, call, *rest)
        return dataclasses.replace(route, suffix_columns=route.suffix_columns + 13,
                                   static_capacity=route.static_capacity + 16) if route.static else route

    monkeypatch.setattr(generate_module, "decide", widened)
    for gen in (dict(max_new_tokens=8, do_sample=False), dict(max_new_tokens=8, do_sample=True, top_k=20)):
        stock, draw = run_stock(model, ids, mask, **gen), torch.rand(3)
        relay_hf.patch(model, min_prefix_length=8, decode="graph")
        torch.manual_seed(0)
        out = model.generate(ids, attention_mask=mask, **gen)
        assert model.relay_last_decision.fast_decode, model.relay_last_decision
        assert torch.equal(out, stock) and torch.equal(torch.rand(3), draw), gen
        padding = relay_state(model).idle_static().cache.layers[0].suffix_padding
        assert int(padding[:3].min()) == 13  # the longest row's suffix starts after 13 masked columns


@pytest.mark.gpu
def test_chat_turns_under_a_pinned_prompt_replay_one_recorded_prefill_per_length_on_gpu():
    """fp32 on CUDA: one-row turns under a pinned prompt, with own tokens of lengths in two recorded lengths (16 and
    32) and again: each length is recorded once (its first turn runs eagerly, then records), later turns replay it,
    and every turn's tokens are stock's; a batch of rows under the same prompt too."""
    model = tiny_model("llama").cuda()
    g = torch.Generator().manual_seed(71)
    prompt = torch.randint(3, VOCAB, (40,), generator=g)
    turns = [torch.cat([prompt, torch.randint(3, VOCAB, (n,), generator=g)])[None].cuda() for n in (5, 11, 20, 3, 27)]
    gen = dict(max_new_tokens=6, do_sample=False)
    stock = [run_stock(model, row, torch.ones_like(row), **gen) for row in turns]
    relay_hf.patch(model)
    relay_hf.pin(model, prompt)
    recorded = []
    for row, out in zip(turns, stock, strict=True):
        assert torch.equal(model.generate(row, attention_mask=torch.ones_like(row), **gen), out)
        decision = model.relay_last_decision
        assert decision.fast_decode and decision.prefix_kept == 40, decision
        graphs = relay_state(model).idle_static().prefill.graphs
        assert all(isinstance(entry, _Graph) for entry in graphs.values())
        recorded.append({key[0][1]: entry for key, entry in graphs.items()})  # by recorded length
    assert [sorted(r) for r in recorded] == [[16], [16], [16, 32], [16, 32], [16, 32]]
    assert recorded[-1][16] is recorded[0][16] and recorded[-1][32] is recorded[2][32]  # replayed, not recorded again
    ids, mask, _ = shared_prefix_batch(suffix_lens=(3, 9, 1, 6), seed=72)
    ids, mask = ids.cuda(), mask.cuda()
    out = run_stock(model, ids, mask, **gen)
    relay_hf.patch(model, min_prefix_length=8)
    assert torch.equal(model.generate(ids, attention_mask=mask, **gen), out)
    assert not any(isinstance(e, Eager) for e in relay_state(model).idle_static().prefill.graphs.values())


def _pinned_turns(seed: int, lengths: tuple[int, ...]):
    """A tiny fp32 Llama on CUDA, a 40-token prompt and one-row turns under it with ``lengths`` own tokens."""
    model = tiny_model("llama").cuda()
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (40,), generator=g)
    turns = [torch.cat([prompt, torch.randint(3, VOCAB, (n,), generator=g)])[None].cuda() for n in lengths]
    return model, prompt, turns


def _recorded(model) -> dict:
    """The idle slot's recorded prefills as ``{(recorded length, compiled): entry}``."""
    graphs = relay_state(model).idle_static().prefill.graphs
    return {(key[0][1], key[2] is not None): entry for key, entry in graphs.items()}


@pytest.mark.gpu
def test_once_the_step_runs_compiled_a_length_is_recorded_again_through_its_compiled_layer_on_gpu(tmp_path,
                                                                                                 monkeypatch):
    """fp32 on CUDA with ``decode="compile"``: a slot's first turn records its prefill through the eager forward (the
    region compiles for the decode step first); the next turn at that length records it through the step's compiled
    decoder layer and drops the eager graph, and what inductor compiled for it is kept in a file of its own; later
    turns replay it; every turn's tokens are stock's."""
    monkeypatch.setenv("RELAY_HF_CACHE_DIR", str(tmp_path))
    model, prompt, turns = _pinned_turns(73, (5, 11, 7, 20))
    gen = dict(max_new_tokens=6, do_sample=False)
    stock = [run_stock(model, row, torch.ones_like(row), **gen) for row in turns]
    relay_hf.patch(model, decode="compile")
    relay_hf.pin(model, prompt)
    seen = []
    for row, out in zip(turns, stock, strict=True):
        assert torch.equal(model.generate(row, attention_mask=torch.ones_like(row), **gen), out)
        assert model.relay_last_decision.decode_step == "compiled", model.relay_last_decision
        seen.append(_recorded(model))
    assert [sorted(r) for r in seen] == [[(16, False)], [(16, True)], [(16, True)], [(16, True), (32, True)]]
    assert all(isinstance(entry, _Graph) for r in seen for entry in r.values())
    assert seen[2][16, True] is seen[1][16, True]  # replayed, not recorded again
    assert relay_state(model).prefill_uncompiled is None
    step = relay_state(model).idle_static().stepper
    assert step.prefill_artifacts.parent == tmp_path / "compiled" and step.prefill_artifacts != step.artifacts
    assert step.prefill_artifacts.exists()


@pytest.mark.gpu
def test_a_prefill_that_fails_to_compile_is_recorded_eagerly_from_then_on_on_gpu():
    """A backend whose prefill graph (more than one token a row) fails when the second layer runs it, after the
    first layer wrote its positions: the turn warns once, puts back those positions, records the eager forward, and
    keeps stock's tokens; the model's later turns record eagerly without trying again."""
    from transformers import CompileConfig

    runs = []

    def decode_only(gm, example_inputs):
        if not any(isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] != 1 for t in example_inputs):
            return gm.forward

        def second_layer_fails(*args):
            runs.append(1)
            if len(runs) >= 2:
                raise RuntimeError("this backend runs no prefill past one layer")
            return gm.forward(*args)

        return second_layer_fails

    model, prompt, turns = _pinned_turns(74, (5, 11, 20))
    gen = dict(max_new_tokens=6, do_sample=False, compile_config=CompileConfig(backend=decode_only, mode=None))
    stock = [run_stock(model, row, torch.ones_like(row), max_new_tokens=6, do_sample=False) for row in turns]
    relay_hf.patch(model, decode="compile")
    relay_hf.pin(model, prompt)
    torch._dynamo.reset()
    assert torch.equal(model.generate(turns[0], attention_mask=torch.ones_like(turns[0]), **gen), stock[0])
    with pytest.warns(RuntimeWarning, match="compiling the suffix prefill failed") as caught:
        out = model.generate(turns[1], attention_mask=torch.ones_like(turns[1]), **gen)
    assert sum("suffix prefill" in str(w.message) for w in caught) == 1 and len(runs) == 2
    assert torch.equal(out, stock[1]) and model.relay_last_decision.decode_step == "compiled"
    assert relay_state(model).prefill_uncompiled is not None and sorted(_recorded(model)) == [(16, False)]
    ends = {int(layer.end) for layer in relay_state(model).idle_static().cache.layers}
    assert len(ends) == 1  # every layer holds the turn's positions once
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert torch.equal(model.generate(turns[2], attention_mask=torch.ones_like(turns[2]), **gen), stock[2])
    assert sorted(_recorded(model)) == [(16, False), (32, False)]
