"""The embedded SmolLM2-135M-Instruct (fp32, CPU): patched batched generate == stock generate row by row."""

import pytest
import torch

import relay_hf
import relay_hf.dispatch
from relay_hf._compat import output_cache

QUESTIONS = [
    "How long does the boiler take to heat up?",
    "My shot ran in 15 seconds. What should I change?",
    "Can I descale with vinegar?",
    "What does a blinking red ring light mean, and what should I do about it right now?",
    "How often should I replace the water filter?",
    "Is the warranty longer if I register the machine, and how many days do I have to register it after buying?",
]


def render(tokenizer, system_prompt, question):
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
def test_patched_batch_equals_stock_per_row(smollm2, system_prompt):
    check_parity(*smollm2, system_prompt)


@pytest.fixture
def relay_on_small_batches(monkeypatch):
    """These batches (6 rows x ~830 tokens) are below the CUDA dispatch threshold: make relay serve them anyway."""
    monkeypatch.setattr(relay_hf.dispatch, "CUDA_MIN_SHARED_TOKENS", 0)


@pytest.mark.gpu
def test_patched_batch_equals_stock_per_row_on_gpu(smollm2, system_prompt, relay_on_small_batches):
    model, tokenizer = smollm2
    try:
        check_parity(model.cuda(), tokenizer, system_prompt)
    finally:
        model.cpu()


def check_parity(model, tokenizer, system_prompt):
    device = model.device
    texts = [render(tokenizer, system_prompt, q) for q in QUESTIONS]
    system_len = len(tokenizer(render(tokenizer, system_prompt, "")[:-len("<|im_start|>user\n<|im_end|>\n"
                                                                           "<|im_start|>assistant\n")])["input_ids"])
    assert system_len >= 300
    stock = []
    for text in texts:  # stock, one row at a time, no padding
        enc = tokenizer(text, return_tensors="pt").to(device)
        out = model.generate(**enc, max_new_tokens=32, do_sample=False)
        stock.append(out[0, enc["input_ids"].shape[1]:])
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(device)
    assert len(set(batch["attention_mask"].sum(1).tolist())) == len(QUESTIONS)  # different lengths, padded
    relay_hf.patch(model)
    try:
        out = model.generate(**batch, max_new_tokens=32, do_sample=False, return_dict_in_generate=True)
        decision = model.relay_last_decision
    finally:
        relay_hf.unpatch(model)
    assert decision.used and decision.rows == len(QUESTIONS)
    T = batch["input_ids"].shape[1]
    assert torch.equal(out.sequences[:, :T], batch["input_ids"])
    print(f"relay on {device}: prefix {decision.prefix_length} tokens, {len(QUESTIONS)} rows, token-identical checked")
    for row, expected in enumerate(stock):
        got = out.sequences[row, T:T + len(expected)]
        assert torch.equal(got, expected), f"row {row}: {tokenizer.decode(got)!r} != {tokenizer.decode(expected)!r}"
    cache = output_cache(out)
    assert isinstance(cache, relay_hf.RelayCache)
    assert cache.prefix_length >= system_len
    cfg = model.config
    per_layer = 2 * cfg.num_key_value_heads * cache.prefix_length * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert cache.prefix_nbytes() == cfg.num_hidden_layers * per_layer  # one copy, not one per row


def _chat_batch(tokenizer, system_prompt, device):
    texts = [render(tokenizer, system_prompt, q) for q in QUESTIONS]
    return tokenizer(texts, return_tensors="pt", padding=True).to(device)


@pytest.mark.gpu
def test_compiled_relay_equals_eager_relay_on_gpu(smollm2, system_prompt, relay_on_small_batches):
    """fp32: transformers' compiled decode (inductor + CUDA graphs) over a static RelayCache == the eager relay path."""
    model, tokenizer = smollm2
    batch = _chat_batch(tokenizer, system_prompt, "cuda")
    relay_hf.patch(model.cuda())
    try:
        eager = model.generate(**batch, max_new_tokens=32, do_sample=False)
        assert not model.relay_last_decision.static
        compiled = model.generate(**batch, max_new_tokens=32, do_sample=False, cache_implementation="static")
        assert model.relay_last_decision.static and hasattr(model, "_compiled_call")
    finally:
        relay_hf.unpatch(model)
        model.cpu()
    assert torch.equal(eager, compiled)


@pytest.mark.gpu
@pytest.mark.xfail(reason="measured 0.656 free-running agreement on the H200 (docs/performance.md); issue 5 target "
                          "is 0.99", strict=False)
def test_compiled_relay_agrees_with_stock_in_bf16_on_gpu(smollm2, system_prompt, relay_on_small_batches):
    """bf16 rounding differs between relay (fp32 LSE merge) and SDPA, so greedy paths may fork; >= 99% must agree."""
    import copy

    model, tokenizer = smollm2
    model = copy.deepcopy(model).to("cuda", torch.bfloat16)
    model.__dict__.pop("_compiled_call", None)  # a deepcopy would keep the original model's compiled forward
    batch = _chat_batch(tokenizer, system_prompt, "cuda")
    T = batch["input_ids"].shape[1]
    stock = model.generate(**batch, max_new_tokens=64, min_new_tokens=64, do_sample=False)[:, T:]
    relay_hf.patch(model)
    relay = model.generate(**batch, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                           cache_implementation="static")[:, T:]
    assert model.relay_last_decision.static
    agreement = (stock == relay).float().mean().item()
    print(f"bf16 greedy agreement relay-compiled vs stock: {agreement:.4f} over {stock.numel()} tokens")
    assert agreement >= 0.99
