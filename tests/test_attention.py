"""The HF seam: relay_mask is the stock mask except on a RelayCache (suffix lengths); relay_attention_forward is the
model's own attention without a relay prefix and refuses what it cannot do with one."""

import pytest
import torch
from transformers.masking_utils import sdpa_mask

from relay_hf import attention
from relay_hf.attention import RelayMask, relay_attention_forward, relay_mask
from relay_hf.cache import RelayKV


def test_mask_on_a_relay_cache_is_the_suffix_lengths():
    mask2d = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    kw = dict(batch_size=2, q_length=2, kv_length=4, q_offset=5, kv_offset=3, attention_mask=mask2d)
    out = relay_mask(**kw)
    assert isinstance(out, RelayMask) and out.suffix_lengths.tolist() == [2, 4]
    assert relay_mask(batch_size=2, q_length=1, kv_length=4, kv_offset=3).suffix_lengths is None


def test_mask_without_a_relay_prefix_is_the_stock_mask():
    mask2d = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    kw = dict(batch_size=2, q_length=4, kv_length=4, attention_mask=mask2d)
    assert torch.equal(relay_mask(**kw), sdpa_mask(**kw))
    sliding = dict(kw, kv_offset=1, kv_length=3, local_size=3)  # a sliding-window layer also reports an offset
    assert torch.equal(relay_mask(**sliding), sdpa_mask(**sliding))
    assert relay_mask(batch_size=2, q_length=1, kv_length=0, kv_offset=5) is None  # a static RelayCache


def test_rows_padded_in_front_of_the_prefix_are_refused():
    """Without relay_hf's generate (which moves pads behind the prefix) such rows would be misaligned."""
    mask2d = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="padded in front of the RelayCache's shared prefix"):
        relay_mask(batch_size=2, q_length=2, kv_length=2, q_offset=3, kv_offset=3, attention_mask=mask2d)


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
    k = RelayKV(torch.randn(1, 2, P, 8, generator=g), torch.randn(2, 2, L, 8, generator=g))
    v = RelayKV(torch.randn(1, 2, P, 8, generator=g), torch.randn(2, 2, L, 8, generator=g))
    return q, k, v


def test_relay_path_output_layout():
    q, k, v = _inputs()
    out, weights = relay_attention_forward(_Module(), q, k, v, RelayMask(torch.tensor([3, 1])))
    assert out.shape == (2, 1, 4, 8) and weights is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(dropout=0.1), "dropout"),
    (dict(softcap=30.0), "softcap"),
    (dict(sliding_window=5), "sliding window"),
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
    k, v = k._replace(lengths=lengths), v._replace(lengths=lengths)
    out, _ = relay_attention_forward(_Module(), q, k, v, torch.ones(2, 1, 1, 7, dtype=torch.bool))
    ref, _ = relay_attention_forward(_Module(), q, k, v, RelayMask(lengths))
    assert torch.equal(out, ref)
