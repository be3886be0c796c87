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
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import relay_hf

VOCAB = 128
PREFIX = 8  # shared tokens; also the min_prefix_length passed to patch
SUFFIXES = (3, 1, 2)  # tokens after the prefix per row (left-padded to the longest)
NEW_TOKENS = 4
MAX_PARAMS = 8_000_000  # a tiny config that is not tiny (an override missing) fails loudly instead of eating memory

# sizes every config gets where it has the field (as a field or through its attribute_map)
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    # mixture of experts
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    # multi-head latent attention (key head dim 24 = 16 + 8, value head dim 16)
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    # decoders of encoder-decoder families
    d_model=64, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=64, decoder_ffn_dim=64,
)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
DROP = object()  # an override that removes a SIZES entry (the config derives it)
MLA = dict(num_key_value_heads=4, head_dim=DROP)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_ssm=128, mamba_d_state=16, mamba_chunk_size=16)
LINEAR_THEN_FULL = dict(layer_types=["linear_attention", "full_attention"])
QWEN_LINEAR = dict(LINEAR_THEN_FULL, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4)
QWEN4_TEXT = dict(QWEN_LINEAR, ngram_vocab_size_base=256, heads_per_ngram=2, split_ngram_parts=2, hc_lowrank=8,
                  hc_count=2, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                  indexer_compress_ratio=2)
DOTS3_TEXT = dict(MLA, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, head_dim=24, use_dsa=False,
                  use_sliding_window=False, index_head_dim=16, index_n_heads=2, index_topk=16)
GEMMA4_TEXT = dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)
INKLING2_TEXT = dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, d_rel=4, rel_extent=64,
                     unpadded_vocab_size=VOCAB, n_layers_per_attn_res_block=1)

# per-architecture constraints the generic sizes break (transformers 5.17 .. 5.24)
OVERRIDES: dict[str, dict] = {
    **{name: MLA for name in ("axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite",
                              "glm_moe_dsa", "minicpm3", "sarvam_mla", "youtu")},
    "bailing_hybrid": dict(MLA, **LINEAR_THEN_FULL),
    "bamba": dict(MAMBA, attn_layer_indices=[1]),
    "blt": dict(encoder_hash_byte_group_vocab=64, patch_in_forward=False,
                **{name: dict(hidden_size_global=64) for name in ("patcher_config", "encoder_config",
                                                                 "decoder_config")}),
    "codegen": dict(rotary_dim=8),
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0,
                                                                        mrope_section=[3, 3, 2])}),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_output_layers=1),
    "dots3_note": dict(text_config=DOTS3_TEXT,
                       vision_config=dict(num_hidden_layers=DROP, adapter_in_dim=64, adapter_out_dim=64),
                       audio_config=dict(adapter_input_size=64, adapter_out_dim=64)),
    "dots3_note_text": DOTS3_TEXT,
    "falcon_h1": MAMBA,
    "gemma3n_text": dict(num_kv_shared_layers=0, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                         laurel_rank=8, altup_num_inputs=2),
    "gemma4": dict(text_config=GEMMA4_TEXT),
    "gemma4_text": GEMMA4_TEXT,
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2),
    "gptj": dict(rotary_dim=8),
    "granitemoehybrid": dict(MAMBA, layer_types=["mamba", "attention"]),
    "inkling2_loop_text": INKLING2_TEXT,
    "inkling2_text": INKLING2_TEXT,
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  use_mamba_kernels=False),
    "kimi_linear": dict(LINEAR_THEN_FULL, linear_head_dim=16, linear_num_heads=4, num_key_value_heads=4),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "longcat_flash": dict(MLA, head_dim=8, num_layers=2, ffn_hidden_size=64, expert_ffn_hidden_size=32, moe_topk=2,
                          zero_expert_num=2),
    "mamba2": dict(num_heads=4, head_dim=32, n_groups=1, state_size=16, chunk_size=16),
    "nemotron_h": dict(layers_block_type=["linear_attention", "full_attention"], ssm_state_size=16, mamba_num_heads=4,
                       mamba_head_dim=32, n_groups=1, chunk_size=16, moe_shared_expert_intermediate_size=32),
    "phi4_multimodal": dict(audio_config=dict(num_blocks=1, nemo_conv_channels=32, ext_pw_out_channel=64,
                                              depthwise_separable_out_channel=64)),
    "prophetnet": dict(num_hidden_layers=DROP, num_encoder_layers=2, num_decoder_layers=2,
                       num_encoder_attention_heads=4, num_decoder_attention_heads=4),
    "qwen3_5": dict(text_config=QWEN_LINEAR),
    "qwen3_5_moe": dict(text_config=QWEN_LINEAR),
    "qwen3_5_moe_text": QWEN_LINEAR,
    "qwen3_5_text": QWEN_LINEAR,
    "qwen3_next": QWEN_LINEAR,
    "qwen4_exp": dict(text_config=QWEN4_TEXT),
    "qwen4_exp_text": QWEN4_TEXT,
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64),
    "reformer": dict(is_decoder=True, attn_layers=["local", "local"], axial_pos_shape=[16, 16],
                     axial_pos_embds_dim=[32, 32], attention_head_size=16, feed_forward_size=64,
                     local_attn_chunk_length=16),
    "roc_bert": dict(pronunciation_vocab_size=32, shape_vocab_size=32, pronunciation_embed_dim=16,
                     shape_embed_dim=16),
    "xlnet": dict(max_position_embeddings=DROP, n_layer=2, n_head=4, d_inner=64),
    "xlstm": dict(num_heads=4, qk_dim_factor=1.0),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                  use_mamba_kernels=False),
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], use_mamba_kernels=False, mamba_d_state=16,
                   n_mamba_heads=4, chunk_size=16),
    "zaya": dict(num_experts_per_tok=1),
}
# what a user must call before stock can generate at all
PREPARE = {"xmod": lambda model: model.set_default_language("en_XX")}


class _TooBig(AssertionError):
    pass


def _settable(config: PretrainedConfig, key: str) -> bool:
    """Whether ``key`` is a field (or an attribute_map alias) of ``config``, not a derived read-only property."""
    try:
        if not hasattr(config, key):
            return False
    except Exception:  # a per-layer attribute that the global config refuses to answer
        return False
    key = getattr(config, "attribute_map", {}).get(key, key)
    prop = getattr(type(config), key, None)
    return not (isinstance(prop, property) and prop.fset is None)


def _tiny_kwargs(cls, overrides: dict) -> dict:
    """Constructor kwargs: ``SIZES`` (and ``TOKENS`` where there is a vocabulary) for every field ``cls`` has, the
    same for each sub-config (text, vision, audio...), then ``overrides`` (a dict for a sub-config merges into it)."""
    default = cls()
    wanted = dict(SIZES, **TOKENS) if _settable(default, "vocab_size") else dict(SIZES)
    kwargs = {k: v for k, v in wanted.items() if _settable(default, k)}
    for name, value in vars(default).items():
        if isinstance(value, PretrainedConfig):
            kwargs[name] = _tiny_kwargs(type(value), overrides.get(name, {}))
    kwargs.update({k: v for k, v in overrides.items() if not isinstance(kwargs.get(k), dict)})
    return {k: v for k, v in kwargs.items() if v is not DROP}


def tiny_config(model_type: str) -> PretrainedConfig:
    cls = CONFIG_MAPPING[model_type]
    return cls(**_tiny_kwargs(cls, OVERRIDES.get(model_type, {})))


def tiny_model(model_type: str):
    """The tiny random model in eval mode, on sdpa where the class supports it (else eager)."""
    config = tiny_config(model_type)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if n_params > MAX_PARAMS:
        raise _TooBig(f"the tiny {model_type} config has {n_params} parameters: add an override")
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError as err:
        if "does not support" not in str(err):
            raise
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    PREPARE.get(model_type, lambda m: None)(model)
    return model.eval()


def _special_ids(model) -> set[int]:
    ids = set()
    for config in (model.config, model.config.get_text_config(decoder=True), model.generation_config):
        for key, value in vars(config).items():
            if key.endswith(("_id", "_ids", "_index")):
                ids.update(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int))
    return ids


def shared_prefix_batch(model):
    """3 left-padded rows: one ``PREFIX``-token prefix plus ``SUFFIXES`` tokens each, never a special id."""
    vocab = model.get_input_embeddings().num_embeddings
    ordinary = torch.tensor([t for t in range(3, vocab) if t not in _special_ids(model)])
    g = torch.Generator().manual_seed(0)
    pick = lambda n: ordinary[torch.randint(len(ordinary), (n,), generator=g)]
    prefix = pick(PREFIX)
    T = PREFIX + max(SUFFIXES)
    pad = model.generation_config.pad_token_id
    pad = int(ordinary[0]) if pad is None else pad
    ids = torch.full((len(SUFFIXES), T), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(SUFFIXES):
        ids[b, T - PREFIX - n:] = torch.cat([prefix, pick(n)])
        mask[b, T - PREFIX - n:] = 1
    return ids, mask, pad


ARCHS = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster, and far faster on a shared machine (no spinning worker threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stock(model_type: str):
    """The tiny model, its batch and stock's greedy tokens; skips where stock itself cannot build or run."""
    try:
        model = tiny_model(model_type)
    except _TooBig:
        raise
    except Exception as err:
        pytest.skip(f"stock cannot build a tiny {model_type}: {type(err).__name__}: {str(err)[:200]}")
    ids, mask, pad = shared_prefix_batch(model)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad)
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
        relay_hf.patch(model, min_prefix_length=PREFIX)
    with torch.no_grad():
        out = model.generate(ids, **kwargs)  # a crash here is one stock does not have
    decision = model.relay_last_decision
    if decision.used:
        assert decision.prefix_length == PREFIX and decision.rows == len(SUFFIXES)
        assert torch.equal(out, stock), f"{type(model).__name__}: relay tokens differ from stock"
    else:
        assert decision.reason, f"{type(model).__name__} ran stock without a reason"
        assert torch.equal(out, stock), f"{type(model).__name__}: the stock fallback differs from stock"


@pytest.mark.parametrize("static", [False, True])
def test_value_head_dim_may_differ_from_the_keys(static):
    """MLA shapes (DeepSeek-V3, MiniCPM3: key head dim 24, value head dim 16): the suffix buffers are sized from their
    own states, and relay attention over them equals dense attention over the concatenated prefix and suffix."""
    from relay_hf import RelayCache, relay_attention
    from tests.conftest import dense_reference

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
        key, value = lay.update(k, v)
        keys.append(k)
        values.append(v)
    suffix_k, suffix_v = torch.cat(keys, 2), torch.cat(values, 2)  # [B, H, 10, D], [B, H, 10, D_v]
    L = suffix_k.shape[2]
    assert lay._kbuf.shape[-1] == D and lay._vbuf.shape[-1] == D_v and lay._kbuf.shape[2] == lay._vbuf.shape[2]
    end = key.end if static else None
    assert torch.equal(key.suffix[:, :, :L], suffix_k) and torch.equal(value.suffix[:, :, :L], suffix_v)
    query = torch.randn(B, H, 1, D, generator=g)
    out = relay_attention(query, key.prefix, value.prefix, key.suffix, value.suffix, suffix_end=end)
    assert out.shape == (B, H, 1, D_v)
    ref = dense_reference(query, prefix_k, prefix_v, suffix_k, suffix_v)
    assert torch.allclose(out.double(), ref, atol=1e-5)
