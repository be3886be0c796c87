"""The patch-time probe: declines what relay cannot reproduce, with a reason, accepts standard attention, and leaves
the model exactly as it found it. Deeper models are probed on their first layers (a layer of each kind and one more),
checked against the whole model's, and at full depth whenever the cut does not accept: the same declines either way."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import relay_hf
from relay_hf import probe_inputs
from relay_hf.names import ATTN_NAME
from relay_hf.prefill import trim_window
from relay_hf.probe import probe_reason, probed_layers
from tests.helpers import tiny_config
from tests.helpers import tiny_model as tiny_arch_model
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


def llama(layers: int = 2, **kwargs):
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                         **kwargs)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def deep_model(model_type: str, layers: int):
    """The tiny random model of ``model_type`` with ``layers`` layers (per-layer config lists repeated)."""
    config = tiny_config(model_type)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = (list(config.layer_types) * layers)[:layers]
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # a class without sdpa
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


def whole_model_reason(model):
    """What the probe says at full depth, with no cut tried: the verdict every decline must equal."""
    return probe_reason(model, whole_model=True)


def completed_calls(modules) -> tuple[list[int], list]:
    """Forward hooks counting each module's completed forwards: ``(counts, handles)``."""
    counts = [0] * len(modules)

    def counter(i):
        def count(module, args, output):
            counts[i] += 1
        return count

    return counts, [m.register_forward_hook(counter(i)) for i, m in enumerate(modules)]


class PositionsFromTheCache(LlamaForCausalLM):
    """A forward without ``position_ids`` (as some remote-code models have): positions count from the cache length,
    so they follow the token layout, and relay's layout differs from stock's for a padded row."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        kwargs.pop("position_ids", None)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


@pytest.mark.parametrize("layers", [2, 6])
@pytest.mark.parametrize("model_type,cls,what", [
    ("diffllama", "DiffLlamaForCausalLM", "chunk"),  # splits the values it gets back from the cache
    ("doge", "DogeForCausalLM", "RelayKV"),
    ("jetmoe", "JetMoeForCausalLM", "repeat"),  # repeats the KV heads itself
    ("deepseek_v3", "DeepseekV3ForCausalLM", "RelayKV"),  # MLA: expands the cached latents itself
])
def test_declines_attention_that_does_not_hand_the_kv_to_the_attention_function(model_type, cls, what, layers):
    model = on_relay(deep_model(model_type, layers))
    reason = probe_reason(model)
    assert reason is not None and reason.startswith(f"{cls}: its attention module does not hand the KV")
    assert what in reason
    assert reason == whole_model_reason(model)


@pytest.mark.parametrize("layers", [2, 6])
@pytest.mark.parametrize("model_type", ["xlm-roberta", "camembert", "xlm-roberta-xl", "bert"])
def test_declines_bidirectional_models(model_type, layers):
    model = on_relay(deep_model(model_type, layers))
    assert not model.config.is_decoder  # used as a causal LM without is_decoder: it attends both ways
    assert (probed_layers(model) is not None) == (layers > 2)  # six layers: the cut is tried first
    reason = probe_reason(model)
    assert reason is not None and reason.startswith(type(model).__name__)
    assert "causal" in reason or "differs" in reason
    assert reason == whole_model_reason(model)


@pytest.mark.parametrize("layers", [2, 6])
def test_declines_a_model_whose_positions_follow_the_layout(layers):
    model = llama(layers)
    model.__class__ = PositionsFromTheCache
    reason = probe_reason(on_relay(model))
    assert reason is not None and reason.startswith("PositionsFromTheCache: relay output differs from stock")
    assert "takes no position_ids" in reason
    assert reason == whole_model_reason(model)


def test_declines_with_stocks_error_when_the_plain_forward_fails():
    model = on_relay(llama())
    model.model.layers[0].register_forward_pre_hook(lambda module, args: (_ for _ in ()).throw(RuntimeError("boom")))
    reason = probe_reason(model)
    assert reason == ("LlamaForCausalLM: a plain forward fails under relay's attention implementation "
                      "(RuntimeError: boom)")


def test_an_accepted_model_is_probed_on_its_first_two_layers_without_the_vocabulary_projection():
    """Six layers of one kind: the probe runs layers 0 and 1 only (layer 2 begins once, in the whole model's stock
    prompt, where the faithfulness check stops it), and the output embedding is handed no positions."""
    model = on_relay(llama(6))
    counts, handles = completed_calls(list(model.model.layers))
    head_rows = []
    handles.append(model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(out.shape[-2])))
    assert probed_layers(model) == 2
    assert probe_reason(model) is None
    for handle in handles:
        handle.remove()
    assert counts[0] > 0 and counts[1] > 0 and counts[2:] == [0, 0, 0, 0]
    assert head_rows and set(head_rows) == {0}


def test_the_cut_keeps_the_first_layer_of_every_kind_and_the_one_after():
    """A layer whose type (the config's ``layer_types``) or whose modules' settings differ is a kind of its own:
    the cut runs to the layer after the first one of the last kind to appear, so a later layer relay cannot serve is
    still probed."""
    assert probed_layers(on_relay(llama(8))) == 2
    qwen2 = deep_model("qwen2", 8)
    qwen2.config.use_sliding_window, qwen2.config.sliding_window, qwen2.config.max_window_layers = True, 8, 3
    qwen2.config.layer_types = ["full_attention"] * 3 + ["sliding_attention"] * 5
    qwen2 = AutoModelForCausalLM.from_config(qwen2.config, attn_implementation="sdpa").eval()
    assert probed_layers(on_relay(qwen2)) == 5
    assert probe_reason(qwen2) is None

    model = on_relay(llama(8))
    model.model.layers[3].self_attn.is_causal = False  # one layer attends both ways: relay must refuse it
    assert probed_layers(model) == 5
    reason = probe_reason(model)
    assert reason is not None and "relay attention is causal" in reason
    assert reason == whole_model_reason(model)


def test_a_cut_that_changes_the_computation_is_not_trusted():
    """A model whose first layer reads the config's layer count computes differently with fewer layers: the
    faithfulness check refuses the cut and the whole model is probed (and accepted: stock and relay agree there)."""
    model = on_relay(llama(6))
    model.model.layers[0].register_forward_hook(lambda module, args, out: out * (6 / model.config.num_hidden_layers))
    assert probed_layers(model) == 2  # the cut is tried first
    counts, handles = completed_calls(list(model.model.layers))
    assert probe_reason(model) is None
    for handle in handles:
        handle.remove()
    # every layer ran: the cut was refused (an accepted cut never completes a layer past it) and the whole model decided
    assert min(counts) > 0


def test_a_small_sliding_window_is_probed_past():
    """A window of 8 tokens: the prefix runs past it and relay stores it trimmed to the window, and an attention
    module that fails only once its cache holds more than the window is declined, first on the decode step over the
    model's own sliding-window cache (stock ``generate``'s road past the window). With the window above
    ``MAX_WINDOW`` the probe stays short of it and does not see the failure."""
    model = on_relay(tiny_arch_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0))
    prefixes, windows, shapes = [], [], []  # what the relay side prefills and keeps; the ids each forward embeds
    build = relay_hf.RelayCache.from_prefix.__func__

    def from_prefix(cls, model, prefix_ids):
        cache = build(cls, model, prefix_ids)
        prefixes.append(torch.as_tensor(prefix_ids).numel())
        windows.extend(lay.window for lay in cache.layers)
        return cache

    embedded = model.get_input_embeddings().register_forward_pre_hook(lambda m, args: shapes.append(args[0].shape))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(relay_hf.RelayCache, "from_prefix", classmethod(from_prefix))
        assert probe_reason(model) is None
    embedded.remove()
    n_prefix = prefixes[0]
    assert set(prefixes) == {n_prefix} and n_prefix > 8 and trim_window(8, [n_prefix]) == 8
    assert max(cols for rows, cols in shapes if rows == 2) > 8  # the stock prompt of the two rows runs past it too
    assert windows and set(windows) == {8}

    def fails_past_the_window(module, args, kwargs):
        cache = next((kwargs[k] for k in ("cache", "past_key_values", "past_key_value") if k in kwargs), None)
        if cache is not None and cache.get_seq_length() > 8:
            raise RuntimeError("past the window")

    model.model.layers[0].self_attn.register_forward_pre_hook(fails_past_the_window, with_kwargs=True)
    reason = probe_reason(model)
    assert reason == ("Qwen2ForCausalLM: a plain forward fails under relay's attention implementation "
                      "(RuntimeError: past the window)")
    prefixes.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe_inputs, "MAX_WINDOW", 4)
        mp.setattr(relay_hf.RelayCache, "from_prefix", classmethod(from_prefix))
        assert probe_reason(model) is None
    assert prefixes and set(prefixes) == {probe_inputs.PROBE_PREFIX}


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


def test_the_cut_model_comes_back_whole_with_no_hooks_left():
    """After a probe on the first layers: the same layer list holding the same layers, the config's layer count, and
    no hook left of those transformers installs for ``output_hidden_states`` (a 16-bit model asks for them): a later
    forward reports each layer's hidden state once."""
    model = on_relay(llama(6).to(torch.bfloat16))
    layers, modules = model.model.layers, list(model.model.layers)
    hooks = {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()}
    config = dict(vars(model.config))
    assert probed_layers(model) is not None
    assert probe_reason(model) is None
    assert model.model.layers is layers and list(layers) == modules and vars(model.config) == config
    assert model.config.num_hidden_layers == 6
    assert {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()} == hooks
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7]]), output_hidden_states=True)
    assert len(out.hidden_states) == 7


def test_the_probe_runs_on_one_thread_on_the_cpu_and_puts_the_count_back():
    model = on_relay(llama(6))
    seen = []
    model.model.layers[0].register_forward_hook(lambda module, args, out: seen.append(torch.get_num_threads()))
    torch.set_num_threads(2)
    assert probe_reason(model) is None
    assert seen and set(seen) == {1} and torch.get_num_threads() == 2


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


def test_the_relay_side_runs_the_reference_for_this_thread_only(monkeypatch):
    """The probe decides on structure: its relay attention calls run the PyTorch reference (on CUDA: no Triton kernel
    compiled while patching), and only inside the probe, only on the probing thread."""
    import threading

    import relay_hf.kernels as kernels

    seen, reference = [], kernels.relay_attention_torch

    def spy(*args, **kwargs):
        seen.append(kernels._REFERENCE_ONLY.get())
        return reference(*args, **kwargs)

    monkeypatch.setattr(kernels, "relay_attention_torch", spy)
    assert probe_reason(on_relay(llama())) is None
    assert seen and all(seen)
    assert not kernels._REFERENCE_ONLY.get()
    other = []
    with kernels.reference_only():
        thread = threading.Thread(target=lambda: other.append(kernels._REFERENCE_ONLY.get()))
        thread.start()
        thread.join()
        assert kernels._REFERENCE_ONLY.get()
    assert other == [False] and not kernels._REFERENCE_ONLY.get()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_accepts_standard_attention_on_cuda(dtype, monkeypatch):
    """On CUDA the probe's relay side runs the reference too: no kernel is planned (or compiled) while patching."""
    import relay_hf.kernels as kernels

    def no_kernels():
        raise AssertionError("the probe planned a Triton kernel")

    monkeypatch.setattr(kernels, "_eager_planner", no_kernels)
    assert probe_reason(on_relay(tiny_model("qwen2").to("cuda", dtype))) is None
    assert probe_reason(on_relay(tiny_model("diffllama").to("cuda", dtype))) is not None


def test_a_16_bit_model_is_held_to_its_early_hidden_state_and_loosely_to_its_logits():
    """16-bit summation noise grows through deep random-weight models: the logits get the loose tolerance, the hidden
    state after an early layer the dtype's own; either beyond its tolerance is a reason."""
    from relay_hf.probe import HALF_LOGIT_RTOL, RTOL, compare_steps

    logits, hidden = torch.full((2, 8), 4.0), torch.full((2, 16), 2.0)
    step = lambda dl, dh: (logits + dl, hidden + dh)  # noqa: E731
    rtol = RTOL[torch.bfloat16]
    stock = (step(0, 0), step(0, 0))
    assert compare_steps(stock, (step(0, 0), step(0.5 * HALF_LOGIT_RTOL * 4, 0)), rtol) is None
    assert "logits" in compare_steps(stock, (step(0, 0), step(2 * HALF_LOGIT_RTOL * 4, 0)), rtol)
    assert "hidden state" in compare_steps(stock, (step(0, 2 * rtol * 2), step(0, 0)), rtol)
    fp32 = ((logits, None), (logits, None))
    assert "logits" in compare_steps(fp32, ((logits + 1e-2, None), (logits, None)), RTOL[torch.float32])
