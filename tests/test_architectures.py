"""Every causal-LM architecture the installed transformers has: relay equals stock, or patch / the call declines.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny random model (hidden 64, 2 layers, vocab 128)
greedily continues 3 left-padded rows that share a prefix, stock and then patched. The patched call must give the
same tokens with relay attention, or run stock with the reason in ``relay_last_decision`` (declined at patch time,
by ``unsupported_reason`` or the probe, or by the call's policy). A crash stock does not have fails the test. Only an
architecture stock itself cannot build or run (a missing optional dependency, inputs a text prompt cannot give) is
skipped, with stock's error in the skip message.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import relay_hf
from tests.helpers import (
    TYPE_NEW_TOKENS,
    TYPE_PREFIX,
    TYPE_SUFFIXES,
    TooBig,
    tiny_config,
    tiny_model_of_type,
    type_batch,
    type_grouped_batch,
)

ARCHS = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster, and far faster on a shared machine (no spinning worker threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stock(model_type: str, batch=type_batch):
    """The tiny model, its batch (``batch(model)``) and stock's greedy tokens; skips where stock itself cannot build
    or run."""
    try:
        model = tiny_model_of_type(model_type)
    except TooBig:
        raise
    except Exception as err:
        pytest.skip(f"stock cannot build a tiny {model_type}: {type(err).__name__}: {str(err)[:200]}")
    ids, mask, pad = batch(model)
    kwargs = dict(attention_mask=mask, max_new_tokens=TYPE_NEW_TOKENS, do_sample=False, pad_token_id=pad)
    try:
        with torch.no_grad():
            stock = model.generate(ids, **kwargs)
    except Exception as err:
        pytest.skip(f"stock {type(model).__name__} cannot generate: {type(err).__name__}: {str(err)[:200]}")
    return model, ids, kwargs, stock


@pytest.mark.parametrize("model_type", ARCHS)
def test_relay_equals_stock_or_declines(model_type):
    model, ids, kwargs, stock = _stock(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", relay_hf.RelayFallbackWarning)
        relay_hf.patch(model, min_prefix_length=TYPE_PREFIX)
    with torch.no_grad():
        out = model.generate(ids, **kwargs)  # a crash here is one stock does not have
    decision = model.relay_last_decision
    if decision.used:
        assert decision.prefix_length == TYPE_PREFIX and decision.rows == len(TYPE_SUFFIXES)
        assert torch.equal(out, stock), f"{type(model).__name__}: relay tokens differ from stock"
    else:
        assert decision.reason, f"{type(model).__name__} ran stock without a reason"
        assert torch.equal(out, stock), f"{type(model).__name__}: the stock fallback differs from stock"


def _on_relay_loop(model, ids, kwargs):
    """The patched call on relay_hf's decode loop (``decode="graph"``): ``(tokens, decision)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", relay_hf.RelayFallbackWarning)
        relay_hf.patch(model, min_prefix_length=TYPE_PREFIX, decode="graph")
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    return out, model.relay_last_decision


@pytest.mark.parametrize("model_type", ARCHS)
def test_relay_hf_loop_equals_stock_or_goes_to_transformers_loop(model_type):
    """The same call on relay_hf's decode loop (the default on CUDA; ``decode="graph"`` runs it here): stock's tokens,
    or transformers' loop / stock with the reason recorded; never a crash stock does not have."""
    model, ids, kwargs, stock = _stock(model_type)
    out, decision = _on_relay_loop(model, ids, kwargs)
    assert torch.equal(out, stock), f"{type(model).__name__}: {decision}"
    assert decision.fast_decode or decision.loop_reason or not decision.used, decision


@pytest.mark.parametrize("model_type", ARCHS)
def test_several_prompts_and_a_row_with_none_equal_stock_or_decline(model_type):
    """Two prompts of different lengths with two rows each and a row that shares nothing, on relay_hf's loop: stock's
    tokens, or stock / transformers' loop with the reason recorded."""
    model, ids, kwargs, stock = _stock(model_type, type_grouped_batch)
    out, decision = _on_relay_loop(model, ids, kwargs)
    assert torch.equal(out, stock), f"{type(model).__name__}: {decision}"
    if decision.used:
        assert sorted(rows for _, rows, _ in decision.groups) == [2, 2], decision


@pytest.mark.parametrize("static", [False, True])
def test_value_head_dim_may_differ_from_the_keys(static):
    """MLA shapes (DeepSeek-V3, MiniCPM3: key head dim 24, value head dim 16): the suffix buffers are sized from their
    own states, and relay attention over them equals dense attention over the concatenated prefix and suffix."""
    from relay_hf import RelayCache, relay_attention
    from tests.helpers import dense_reference

    g = torch.Generator().manual_seed(0)
    B, H, P, D, D_v = 3, 2, 6, 24, 16
    prefix_k, prefix_v = torch.randn(1, H, P, D, generator=g), torch.randn(1, H, P, D_v, generator=g)
    base = RelayCache(tiny_config("llama"), [(prefix_k, prefix_v)] * 2)
    cache = base.fork(max_suffix_length=40) if static else base.fork()
    lay = cache.layers[0]
    lay.MIN_CAPACITY = 4  # the dynamic buffers grow (and copy what they hold) twice below
    keys, values = [], []
    for n in (3, 1, 5, 1):
        k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D_v, generator=g)
        key, value = lay.relay_update(k, v)
        keys.append(k)
        values.append(v)
    suffix_k, suffix_v = torch.cat(keys, 2), torch.cat(values, 2)  # [B, H, 10, D], [B, H, 10, D_v]
    L = suffix_k.shape[2]
    assert lay.keys.shape[-1] == D and lay.values.shape[-1] == D_v and lay.keys.shape[2] == lay.values.shape[2]
    end = key.step.suffix_end if static else None
    assert torch.equal(key.suffix[:, :, :L], suffix_k) and torch.equal(value.suffix[:, :, :L], suffix_v)
    query = torch.randn(B, H, 1, D, generator=g)
    out = relay_attention(query, key.prefix, value.prefix, key.suffix, value.suffix, suffix_end=end)
    assert out.shape == (B, H, 1, D_v)
    ref = dense_reference(query, prefix_k, prefix_v, suffix_k, suffix_v)
    assert torch.allclose(out.double(), ref, atol=1e-5)
