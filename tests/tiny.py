"""Tiny random-init causal LMs of several architectures, and a batch that shares a prefix."""

from __future__ import annotations

import torch
import transformers

from tests.conftest import left_pad

# name -> (config class, kwargs); GQA ratios 1, 3, 4, 8 and 2 across them.
ARCHS = {
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4)),
    "mistral": ("MistralConfig", dict(num_attention_heads=6, num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=8, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=8, num_key_value_heads=1)),
    "phi3": ("Phi3Config", dict(num_attention_heads=6, num_key_value_heads=2)),
}
VOCAB = 256


def tiny_model(arch: str, seed: int = 0, **overrides):
    cls_name, kw = ARCHS[arch]
    heads = overrides.get("num_attention_heads", kw["num_attention_heads"])
    kw = {**dict(vocab_size=VOCAB, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=2,
                 max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 attn_implementation="sdpa"), **kw, **overrides}
    if arch in ("llama", "mistral", "qwen3"):
        kw["head_dim"] = 16
    config = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def shared_prefix_batch(prefix_len: int = 40, suffix_lens=(3, 9, 1, 6), seed: int = 0):
    """Left-padded rows = one shared prefix + a random suffix each (tokens >= 3, so never pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB, (prefix_len,), generator=g)
    rows = [torch.cat([prefix, torch.randint(3, VOCAB, (n,), generator=g)]) for n in suffix_lens]
    ids, mask = left_pad(rows)
    return ids, mask, prefix
