"""The HF seam: relay_mask is sdpa_mask plus suffix lengths; relay_attention_forward refuses what it cannot do."""

import pytest
import torch
from transformers.masking_utils import sdpa_mask

from relay_hf.attention import RelayMask, relay_attention_forward, relay_mask
from relay_hf.cache import RelayKV


def test_mask_is_sdpa_mask_plus_suffix_lengths():
    mask2d = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    kw = dict(batch_size=2, q_length=2, kv_length=4, q_offset=5, kv_offset=3, attention_mask=mask2d)
    out = relay_mask(**kw)
    assert torch.equal(out.dense, sdpa_mask(**kw))
    assert out.suffix_lengths.tolist() == [2, 4]
    assert relay_mask(batch_size=2, q_length=1, kv_length=4, kv_offset=3).suffix_lengths is None


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
    out, weights = relay_attention_forward(_Module(), q, k, v, RelayMask(None, torch.tensor([3, 1])))
    assert out.shape == (2, 1, 4, 8) and weights is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(dropout=0.1), "dropout"),
    (dict(softcap=30.0), "softcap"),
    (dict(sliding_window=5), "sliding window"),
])
def test_refusals_name_the_problem(kwargs, match):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=match):
        relay_attention_forward(_Module(), q, k, v, RelayMask(None, None), **kwargs)


def test_custom_4d_mask_is_refused():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="custom attention mask"):
        relay_attention_forward(_Module(), q, k, v, torch.ones(2, 1, 1, 7, dtype=torch.bool))
