"""relay_hf's own decode loop (``relay_hf/decode.py``) over a static RelayCache: token for token what stock
``generate`` gives, on five architectures; what it cannot reproduce goes to transformers' loop."""

import pytest
import torch
from transformers import CompileConfig, LogitsProcessorList, TopKLogitsWarper
from transformers.generation.streamers import BaseStreamer

import relay_hf
from relay_hf.decode import _stop_length
from tests.helpers import run_relay, run_stock, shared_prefix_batch, tiny_model

STATIC = dict(cache_implementation="static", do_sample=False)


class _UserTopK(TopKLogitsWarper):
    """A user's own processor class (transformers' built-ins given by the user run stock generate)."""


def _stock_then_relay(model, ids, mask, **gen):
    """Stock greedy generate, then the patched model on a static cache (relay_hf's loop where it serves the call)."""
    return run_stock(model, ids, mask, do_sample=False, **gen), run_relay(model, ids, mask, **STATIC, **gen)


def _row_eos(model, ids, mask) -> list[int]:
    """One EOS id per row, each a token that row generates early, so every row stops at a different step."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    return sorted({int(out[r, ids.shape[1] + 2 + 2 * r]) for r in range(ids.shape[0])})



@pytest.mark.parametrize("case", ["max_new_tokens", "eos_stops_early", "min_new_tokens", "max_length_min_length"])
def test_decode_loop_gives_stock_tokens(arch_model, case):
    ids, mask, _ = shared_prefix_batch(seed=11)
    T = ids.shape[1]
    eos = _row_eos(arch_model, ids, mask)
    gen = {"max_new_tokens": dict(max_new_tokens=20),
           "eos_stops_early": dict(max_new_tokens=40, eos_token_id=eos),
           "min_new_tokens": dict(max_new_tokens=40, eos_token_id=eos, min_new_tokens=7),
           "max_length_min_length": dict(max_length=T + 9, eos_token_id=eos, min_length=T + 5)}[case]
    stock, relay = _stock_then_relay(arch_model, ids, mask, **gen)
    decision = arch_model.relay_last_decision
    assert decision.used and decision.static and decision.fast_decode, decision
    assert torch.equal(stock, relay)
    if case == "eos_stops_early":
        assert stock.shape[1] < T + 40  # the case really stops on EOS before max_new_tokens


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


def test_streamer_gets_what_stock_streams():
    model = tiny_model("qwen2")
    ids, mask, _ = shared_prefix_batch(seed=12)
    eos = _row_eos(model, ids, mask)
    stock_rec, relay_rec = _Recorder(), _Recorder()
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, streamer=stock_rec,
                           do_sample=False)
    relay_hf.patch(model, min_prefix_length=8)
    relay = model.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, streamer=relay_rec, **STATIC)
    assert model.relay_last_decision.fast_decode and torch.equal(stock, relay)
    assert relay_rec.ended and len(relay_rec.puts) == len(stock_rec.puts) == 1 + stock.shape[1] - ids.shape[1]
    for a, b in zip(stock_rec.puts, relay_rec.puts, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("gen, reason", [
    (dict(return_dict_in_generate=True, output_logits=True), "return_dict_in_generate"),
    (dict(suppress_tokens=[5, 6]), "suppress_tokens"),
    (dict(logits_processor=LogitsProcessorList([_UserTopK(5)])), "logits_processor"),
])
def test_calls_the_loop_cannot_reproduce_run_on_transformers_loop(gen, reason):
    model = tiny_model("llama")
    ids, mask, _ = shared_prefix_batch(seed=13)
    stock, relay = _stock_then_relay(model, ids, mask, max_new_tokens=8, **gen)
    decision = model.relay_last_decision
    assert decision.static and not decision.fast_decode and reason in decision.loop_reason
    seq = (lambda o: o if isinstance(o, torch.Tensor) else o.sequences)
    assert torch.equal(seq(stock), seq(relay))


def test_compiled_step_traces_as_one_graph_and_matches_eager():
    """``fullgraph=True`` compile of the whole step (model forward, greedy choice, bookkeeping). CPU CI uses the
    ``eager`` backend (tracing is what can break); on the GPU inductor compiles it and a CUDA graph captures it."""
    model = relay_hf.patch(tiny_model("llama"), min_prefix_length=8)
    ids, mask, _ = shared_prefix_batch(seed=14)
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told otherwise
    torch._dynamo.reset()
    compiled = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, compile_config=config)
    assert model.relay_last_decision.fast_decode
    assert hasattr(model._relay_state.idle_static().stepper.fn, "_torchdynamo_orig_callable")  # the compiled step ran
    assert torch.equal(eager, compiled)
    assert model.config._attn_implementation == "relay"


def test_a_step_that_fails_to_compile_decodes_eagerly_with_a_warning():
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    model = relay_hf.patch(tiny_model("mistral"), min_prefix_length=8)
    ids, mask, _ = shared_prefix_batch(seed=15)
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    config = CompileConfig(fullgraph=True, backend=broken_backend, mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="compiling the decode step failed"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, compile_config=config)
    assert torch.equal(eager, out)
    again = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(eager, again)  # the model stays usable


def test_a_patched_model_with_a_kept_step_can_be_deep_copied():
    import copy

    model = relay_hf.patch(tiny_model("qwen3"), min_prefix_length=8)
    ids, mask, _ = shared_prefix_batch(seed=16)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, **STATIC)
    assert model._relay_state.idle_static().stepper is not None
    twin = copy.deepcopy(model)
    assert twin._relay_state.idle_static() is None and relay_hf.is_patched(twin)
    assert torch.equal(out, twin.generate(ids, attention_mask=mask, max_new_tokens=6, **STATIC))


def test_stop_length_is_where_the_last_row_hits_eos():
    eos = torch.tensor([7, 9])
    assert _stop_length(torch.tensor([[1, 7, 0, 0], [9, 0, 0, 0]]), eos) == 2
    assert _stop_length(torch.tensor([[1, 2, 3, 4], [9, 0, 0, 0]]), eos) == 4  # row 0 never stops
    assert _stop_length(torch.tensor([[7], [9]]), eos) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, None])
def test_capture_blas_preference_is_scoped(dtype):
    """The decode graph's cuBLASLt preference holds only inside the capture, only for 16-bit models (fp32 steps keep
    the GEMMs the eager path uses), and a build without cuBLASLt (the CPU one) just keeps what it has."""
    from relay_hf.decode import DEFAULT_DECODE, _capture_blas

    before = torch.backends.cuda.preferred_blas_library()
    with _capture_blas(DEFAULT_DECODE.capture_blas, dtype):
        inside = torch.backends.cuda.preferred_blas_library()
    assert torch.backends.cuda.preferred_blas_library() == before
    if dtype in (torch.bfloat16, torch.float16) and torch.cuda.is_available() and not torch.version.hip:
        assert inside.name.lower() == DEFAULT_DECODE.capture_blas
    else:
        assert inside == before


def test_step_compile_arguments_add_combo_kernels_on_cuda_under_the_users_options():
    """Inductor on CUDA gets the decode config's step options with the mode's own options spelled out (torch.compile
    takes a mode or options, not both); the user's options win; other backends and the CPU get the user's settings
    unchanged."""
    from relay_hf.decode import _compile_kwargs

    cuda = _compile_kwargs(CompileConfig(fullgraph=True), "cuda")
    assert cuda == dict(fullgraph=True, backend="inductor", mode=None, options={"combo_kernels": True})
    tuned = _compile_kwargs(CompileConfig(mode="max-autotune"), "cuda")
    assert tuned["mode"] is None and tuned["options"]["max_autotune"] and tuned["options"]["combo_kernels"]
    assert "triton.cudagraphs" not in tuned["options"]  # the loop captures its own graph
    off = _compile_kwargs(CompileConfig(mode=None, options={"combo_kernels": False}), "cuda")
    assert off["options"] == {"combo_kernels": False}
    assert _compile_kwargs(CompileConfig(), "cpu") == dict(fullgraph=False, backend="inductor", mode=None,
                                                           options=None)
    eager = _compile_kwargs(CompileConfig(backend="eager", mode=None), "cuda")
    assert eager["backend"] == "eager" and eager["options"] is None
    torch.compile(lambda x: x + 1, dynamic=False, **cuda)  # a combination torch.compile accepts


def test_step_options_this_torch_does_not_know_are_left_out():
    from relay_hf.decode import _compile_kwargs

    options = (("combo_kernels", True), ("no_such_inductor_option", 1))
    assert _compile_kwargs(CompileConfig(), "cuda", options)["options"] == {"combo_kernels": True}
    assert _compile_kwargs(CompileConfig(), "cuda", ())["options"] is None
