"""The patch-time probe: declines what relay cannot reproduce, with a reason, accepts standard attention, and leaves
the model exactly as it found it."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import relay_hf
from relay_hf.cache import ATTN_NAME
from relay_hf.probe import probe_reason
from tests.helpers import tiny_model_of_type as tiny_model
from tests.helpers import type_batch as shared_prefix_batch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster, and far faster on a shared machine (no spinning worker threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def on_relay(model):
    """The state ``patch`` probes in: the model switched to the ``"relay"`` implementation."""
    model.set_attn_implementation(ATTN_NAME)
    return model


def llama(**kwargs):
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                         **kwargs)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()


class PositionsFromTheCache(LlamaForCausalLM):
    """A forward without ``position_ids`` (as some remote-code models have): positions count from the cache length,
    so they follow the token layout, and relay's layout differs from stock's for a padded row."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        kwargs.pop("position_ids", None)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


@pytest.mark.parametrize("model_type,cls,what", [
    ("diffllama", "DiffLlamaForCausalLM", "chunk"),  # splits the values it gets back from the cache
    ("doge", "DogeForCausalLM", "RelayKV"),
    ("jetmoe", "JetMoeForCausalLM", "repeat"),  # repeats the KV heads itself
    ("deepseek_v3", "DeepseekV3ForCausalLM", "RelayKV"),  # MLA: expands the cached latents itself
])
def test_declines_attention_that_does_not_hand_the_kv_to_the_attention_function(model_type, cls, what):
    reason = probe_reason(on_relay(tiny_model(model_type)))
    assert reason is not None and reason.startswith(f"{cls}: its attention module does not hand the KV")
    assert what in reason


@pytest.mark.parametrize("model_type", ["xlm-roberta", "camembert", "xlm-roberta-xl", "bert"])
def test_declines_bidirectional_models(model_type):
    model = tiny_model(model_type)
    assert not model.config.is_decoder  # used as a causal LM without is_decoder: it attends both ways
    reason = probe_reason(on_relay(model))
    assert reason is not None and reason.startswith(type(model).__name__)
    assert "causal" in reason or "differs" in reason


def test_declines_a_model_whose_positions_follow_the_layout():
    model = llama()
    model.__class__ = PositionsFromTheCache
    reason = probe_reason(on_relay(model))
    assert reason is not None and reason.startswith("PositionsFromTheCache: relay output differs from stock")
    assert "takes no position_ids" in reason


def test_declines_with_stocks_error_when_the_plain_forward_fails():
    model = on_relay(llama())
    model.model.layers[0].register_forward_pre_hook(lambda module, args: (_ for _ in ()).throw(RuntimeError("boom")))
    reason = probe_reason(model)
    assert reason == ("LlamaForCausalLM: a plain forward fails under relay's attention implementation "
                      "(RuntimeError: boom)")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "qwen3", "gemma3_text"])
def test_accepts_standard_attention(model_type):
    assert probe_reason(on_relay(tiny_model(model_type))) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accepts_half_precision(dtype):
    assert probe_reason(on_relay(tiny_model("qwen2").to(dtype))) is None


def test_accepts_a_multimodal_model_by_its_text_config():
    model = tiny_model("gemma3")
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert model.config.get_text_config(decoder=True) is not model.config
    assert probe_reason(on_relay(model)) is None


def test_meta_parameters_are_not_probed():
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4))
    assert probe_reason(model) is None


def test_tokens_are_valid_and_never_special():
    """Special ids from every config the model has (pad, bos, eos lists, a multimodal placeholder) are avoided,
    even where they sit in the range the probe picks from."""
    model = on_relay(llama(bos_token_id=70, eos_token_id=[73, 76]))
    model.config.pad_token_id = 64
    model.config.image_token_index = 79
    model.generation_config.eos_token_id = [82, 85]
    seen = []
    model.model.embed_tokens.register_forward_pre_hook(lambda module, args: seen.append(args[0].flatten()))
    assert probe_reason(model) is None
    ids = torch.cat(seen)
    assert len(seen) >= 4 and bool((ids >= 0).all()) and bool((ids < 128).all())
    assert not set(ids.tolist()) & {64, 70, 73, 76, 79, 82, 85}


def test_the_model_comes_back_exactly_as_it_was():
    """Train mode with dropout (the probe runs without it), a forward that draws random numbers and stashes state:
    afterwards the same RNG state, attention implementation, training flags, parameters (same tensors, no grads),
    buffers and attributes."""
    model = on_relay(llama(attention_dropout=0.5))
    model.train()
    model.model.layers[1].eval()  # a mixed tree: every module's own flag comes back

    def draw_and_stash(module, args):
        module.stashed = torch.rand(1)  # a forward that consumes RNG and leaves an attribute behind

    model.model.register_forward_pre_hook(draw_and_stash)
    flags = {name: m.training for name, m in model.named_modules()}
    params = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    assert probe_reason(model) is None
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.config._attn_implementation == ATTN_NAME
    assert {name: m.training for name, m in model.named_modules()} == flags
    for name, p in model.named_parameters():
        assert p is params[name][0] and torch.equal(p, params[name][1]) and p.grad is None
    assert {name: b for name, b in model.named_buffers()} == buffers
    assert not hasattr(model.model, "stashed")


def test_patch_declines_with_the_probes_reason_and_stays_stock():
    model = tiny_model("diffllama")
    ids, mask, pad = shared_prefix_batch(model)
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=pad)
    with pytest.warns(relay_hf.RelayFallbackWarning, match="DiffLlamaForCausalLM: its attention module"):
        relay_hf.patch(model, min_prefix_length=8)
    assert model.config._attn_implementation == "sdpa"
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=pad)
    assert torch.equal(out, stock)
    decision = model.relay_last_decision
    assert not decision.used and decision.reason.startswith("DiffLlamaForCausalLM: its attention module")


def test_patch_accepts_with_the_probe_and_serves_relay():
    model = tiny_model("llama")
    ids, mask, pad = shared_prefix_batch(model)
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=pad)
    with warnings.catch_warnings():
        warnings.simplefilter("error", relay_hf.RelayFallbackWarning)
        relay_hf.patch(model, min_prefix_length=8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=pad)
    assert model.relay_last_decision.used and torch.equal(out, stock)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_accepts_standard_attention_on_cuda(dtype):
    """On CUDA the relay side runs the Triton kernels; their numerics must sit inside the probe's tolerance."""
    assert probe_reason(on_relay(tiny_model("qwen2").to("cuda", dtype))) is None
    assert probe_reason(on_relay(tiny_model("diffllama").to("cuda", dtype))) is not None


def test_a_16_bit_model_is_held_to_its_early_hidden_state_and_loosely_to_its_logits():
    """16-bit summation noise grows through deep random-weight models: the logits get the loose tolerance, the hidden
    state after an early layer the dtype's own; either beyond its tolerance is a reason."""
    from relay_hf.probe import HALF_LOGIT_RTOL, RTOL, _compare

    logits, hidden = torch.full((2, 8), 4.0), torch.full((2, 16), 2.0)
    step = lambda dl, dh: (logits + dl, hidden + dh)  # noqa: E731
    rtol = RTOL[torch.bfloat16]
    stock = (step(0, 0), step(0, 0))
    assert _compare(stock, (step(0, 0), step(0.5 * HALF_LOGIT_RTOL * 4, 0)), rtol) is None
    assert "logits" in _compare(stock, (step(0, 0), step(2 * HALF_LOGIT_RTOL * 4, 0)), rtol)
    assert "hidden state" in _compare(stock, (step(0, 2 * rtol * 2), step(0, 0)), rtol)
    fp32 = ((logits, None), (logits, None))
    assert "logits" in _compare(fp32, ((logits + 1e-2, None), (logits, None)), RTOL[torch.float32])
