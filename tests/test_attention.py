"""The HF seam: relay_mask is the stock mask except on a RelayCache (suffix lengths); relay_attention_forward is the
model's own attention without a relay prefix and refuses what it cannot do with one."""

import pytest
import torch
from transformers.masking_utils import sdpa_mask

from relay_hf import attention
from relay_hf.attention import RelayMask, relay_attention_forward, relay_mask
from relay_hf.kernels import StepMetadata
from relay_hf.layers import RelayKV, RelayOffset


def test_mask_on_a_relay_cache_is_the_suffix_lengths():
    mask2d = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    kw = dict(batch_size=2, q_length=2, kv_length=4, q_offset=5, kv_offset=RelayOffset(3), attention_mask=mask2d)
    out = relay_mask(**kw)
    assert isinstance(out, RelayMask) and out.suffix_lengths.tolist() == [2, 4]
    assert relay_mask(batch_size=2, q_length=1, kv_length=4, kv_offset=RelayOffset(3)).suffix_lengths is None


def test_mask_without_a_relay_prefix_is_the_stock_mask():
    mask2d = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    kw = dict(batch_size=2, q_length=4, kv_length=4, attention_mask=mask2d)
    assert torch.equal(relay_mask(**kw), sdpa_mask(**kw))
    sliding = dict(kw, local_size=3)  # a sliding-window layer without a relay prefix
    assert torch.equal(relay_mask(**sliding), sdpa_mask(**sliding))
    assert relay_mask(batch_size=2, q_length=1, kv_length=0, kv_offset=RelayOffset(5)) is None  # a static RelayCache


def test_a_full_stock_sliding_window_layer_gets_the_stock_mask():
    """transformers' sliding-window cache layers report ``kv_offset > 0`` once their window is full: that is no
    relay prefix (only a ``RelayOffset`` is), so the mask is stock's, padding included."""
    mask2d = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # pads in the window
    kw = dict(batch_size=2, q_length=1, kv_length=3, q_offset=7, kv_offset=5, attention_mask=mask2d, local_size=4)
    out = relay_mask(**kw)
    assert torch.is_tensor(out) and torch.equal(out, sdpa_mask(**kw))


def test_rows_padded_in_front_of_the_prefix_are_refused():
    """Without relay_hf's generate (which moves pads behind the prefix) such rows would be misaligned."""
    mask2d = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="padded in front of the RelayCache's shared prefix"):
        relay_mask(batch_size=2, q_length=2, kv_length=2, q_offset=3, kv_offset=RelayOffset(3), attention_mask=mask2d)


def test_stock_attention_follows_the_implementation_the_config_had():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8)
    module = LlamaAttention(config, layer_idx=0).eval()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 3, 8, generator=g) for _ in range(3))
    mask = torch.zeros(2, 1, 3, 3).masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
    attention.set_stock_implementation(config, "eager")
    try:
        out, _ = relay_attention_forward(module, q, k, v, mask, scaling=0.3)
        ref, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.3)
        assert torch.equal(out, ref)
    finally:
        attention.set_stock_implementation(config, None)
    assert attention.stock_implementation(config) == "sdpa"


class _Module(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def _inputs(P=4, L=3):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 8, generator=g)
    step = StepMetadata()  # the rows' extents come from the mask
    k = RelayKV(torch.randn(1, 2, P, 8, generator=g), torch.randn(2, 2, L, 8, generator=g), step)
    v = RelayKV(torch.randn(1, 2, P, 8, generator=g), torch.randn(2, 2, L, 8, generator=g), step)
    return q, k, v


def test_relay_path_output_layout():
    q, k, v = _inputs()
    out, weights = relay_attention_forward(_Module(), q, k, v, RelayMask(torch.tensor([3, 1])))
    assert out.shape == (2, 1, 4, 8) and weights is None


def test_a_sliding_layer_of_a_relay_cache_gets_the_relay_mask():
    mask2d = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    out = relay_mask(batch_size=2, q_length=1, kv_length=3, kv_offset=RelayOffset(2), attention_mask=mask2d,
                     local_size=2)
    assert isinstance(out, RelayMask) and out.suffix_lengths.tolist() == [2, 3]  # the window is applied in attention


@pytest.mark.parametrize("kwargs", [dict(softcap=2.0), dict(s_aux=torch.tensor([0.5, -1.0, 2.0, 0.0])),
                                    dict(sliding_window=3), dict(sliding_window=100)])
def test_softcap_sinks_and_windows_reach_relay_attention(kwargs):
    """The module's softcap, sinks (``s_aux``, as gpt-oss hands them) and window are what ``relay_attention``
    computes with; a window that holds every position is no window."""
    from relay_hf.kernels import relay_attention_torch

    q, k, v = _inputs()
    lengths = torch.tensor([3, 1])
    out, _ = relay_attention_forward(_Module(), q, k, v, RelayMask(lengths), **kwargs)
    window = kwargs.get("sliding_window")
    ref = relay_attention_torch(q, k.prefix, v.prefix, k.suffix, v.suffix, suffix_lengths=lengths,
                                softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"),
                                window=window if window is not None and window < 7 else None)
    assert torch.equal(out, ref.transpose(1, 2).contiguous())
    plain, _ = relay_attention_forward(_Module(), q, k, v, RelayMask(lengths))
    assert torch.equal(out, plain) == (window == 100)


@pytest.mark.parametrize("static", [False, True])
def test_a_static_cache_always_gets_the_window(monkeypatch, static):
    """A captured decode step replays for later calls whose prefixes may be longer than this one's: on a static
    cache (its keys carry ``end``) the window goes to the kernels even when this call's keys all fit inside it; a
    dynamic cache gets it only where it can exclude a key."""
    seen = []
    real = attention.attend
    monkeypatch.setattr(attention, "attend", lambda step, options, *a: seen.append(options.window) or
                        real(step, options, *a))
    q, k, v = _inputs()  # 7 positions (prefix + suffix): within a window of 100
    if static:
        step = StepMetadata(suffix_end=torch.tensor(k.suffix.shape[-2]))
        k, v = k._replace(step=step), v._replace(step=step)
    relay_attention_forward(_Module(), q, k, v, RelayMask(torch.tensor([3, 1])), sliding_window=100)
    assert seen == [100 if static else None]


@pytest.mark.parametrize("kwargs,match", [
    (dict(dropout=0.1), "dropout"),
    (dict(attention_chunk_size=4), "attention_chunk_size"),
])
def test_refusals_name_the_problem(kwargs, match):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=match):
        relay_attention_forward(_Module(), q, k, v, RelayMask(None), **kwargs)


def test_custom_4d_mask_is_refused_unless_the_cache_carries_the_layout():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="cannot read the rows' padding"):
        relay_attention_forward(_Module(), q, k, v, torch.ones(2, 1, 1, 7, dtype=torch.bool))
    lengths = torch.tensor([3, 1], dtype=torch.int32)
    step = StepMetadata(lengths)
    k, v = k._replace(step=step), v._replace(step=step)
    out, _ = relay_attention_forward(_Module(), q, k, v, torch.ones(2, 1, 1, 7, dtype=torch.bool))
    ref, _ = relay_attention_forward(_Module(), q, k, v, RelayMask(lengths))
    assert torch.equal(out, ref)


def test_a_module_s_options_are_built_once_and_follow_its_values():
    """The glue builds one ``AttentionOptions`` per module and reuses it while the module asks the same (the step's
    plans find it by its ``key``); other values build new options; a module's entry dies with it."""
    import gc

    module = _Module()
    first = attention.module_options(module, 0.5, None, {"softcap": 30.0})
    assert attention.module_options(module, 0.5, None, {"softcap": 30.0}) is first
    assert (first.scale, first.softcap, first.window, first.sinks) == (0.5, 30.0, None, None)
    other = attention.module_options(module, 0.5, 8, {"softcap": 30.0})
    assert other is not first and other.window == 8 and other.key != first.key
    sinks = torch.zeros(4)
    assert attention.module_options(module, 0.5, 8, {"s_aux": sinks}).sinks is sinks
    key = id(module)
    del module
    gc.collect()
    assert key not in attention._OPTIONS
