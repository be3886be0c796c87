"""The embedded SmolLM2-135M-Instruct (fp32, CPU): patched batched generate == stock generate row by row."""

import pytest
import torch

import relay_hf
import relay_hf.policy
from relay_hf._compat import output_cache
from relay_hf.state import relay_state

QUESTIONS = [
    "How long does the boiler take to heat up?",
    "My shot ran in 15 seconds. What should I change?",
    "Can I descale with vinegar?",
    "What does a blinking red ring light mean, and what should I do about it right now?",
    "How often should I replace the water filter?",
    "Is the warranty longer if I register the machine, and how many days do I have to register it after buying?",
]
# 18 more rows for the bf16 agreement rate on the GPU: 24 rows x 64 tokens, so that one token is 0.07 %, not 0.26 %
MORE_QUESTIONS = [
    "How much does the machine weigh?",
    "What grind setting should I start with for a double shot?",
    "How hot does the steam wand get, and how long should I steam milk for a latte?",
    "The ring light is orange. What does that mean?",
    "How big is the water tank?",
    "Can I use pre-ground coffee in the Aurora 3?",
    "How many grams of beans go into a double shot?",
    "What voltage does the machine need in the US?",
    "My espresso tastes sour. What should I try?",
    "How do I backflush the group head, and how often?",
    "Where can I buy a replacement portafilter and how much does it cost?",
    "Does the warranty cover a cracked water tank?",
    "How do I clean the steam wand after use?",
    "The pump is very loud and no water comes out. What now?",
    "What size is the portafilter?",
    "How many grind settings does the grinder have?",
    "Can I leave the machine on all day?",
    "Who do I contact if my question is not in the manual?",
]


def render(tokenizer, system_prompt, question):
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
def test_patched_batch_equals_stock_per_row(smollm2, system_prompt):
    """The quick check of the default run: the shortest question and the two longest (the most padding), 16 tokens."""
    check_parity(*smollm2, system_prompt, [QUESTIONS[2], QUESTIONS[3], QUESTIONS[5]], new_tokens=16)


@pytest.mark.slow
@pytest.mark.long
def test_patched_batch_equals_stock_per_row_all_questions(smollm2, system_prompt):
    check_parity(*smollm2, system_prompt)


@pytest.fixture
def relay_on_small_batches(monkeypatch):
    """These batches (6 rows x ~830 tokens) are below the CUDA dispatch threshold: make relay serve them anyway."""
    monkeypatch.setattr(relay_hf.policy, "CUDA_MIN_SHARED_TOKENS", 0)


@pytest.mark.gpu
def test_patched_batch_equals_stock_per_row_on_gpu(smollm2, system_prompt, relay_on_small_batches):
    model, tokenizer = smollm2
    try:
        check_parity(model.cuda(), tokenizer, system_prompt)
    finally:
        model.cpu()


def check_parity(model, tokenizer, system_prompt, questions=QUESTIONS, new_tokens=32):
    device = model.device
    texts = [render(tokenizer, system_prompt, q) for q in questions]
    system_len = len(tokenizer(render(tokenizer, system_prompt, "")[:-len("<|im_start|>user\n<|im_end|>\n"
                                                                           "<|im_start|>assistant\n")])["input_ids"])
    assert system_len >= 300
    stock = []
    for text in texts:  # stock, one row at a time, no padding
        enc = tokenizer(text, return_tensors="pt").to(device)
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False)
        stock.append(out[0, enc["input_ids"].shape[1]:])
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(device)
    assert len(set(batch["attention_mask"].sum(1).tolist())) == len(questions)  # different lengths, padded
    relay_hf.patch(model)
    try:
        out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
        decision = model.relay_last_decision
    finally:
        relay_hf.unpatch(model)
    assert decision.used and decision.rows == len(questions)
    T = batch["input_ids"].shape[1]
    assert torch.equal(out.sequences[:, :T], batch["input_ids"])
    print(f"relay on {device}: prefix {decision.prefix_length} tokens, {len(questions)} rows, token-identical checked")
    for row, expected in enumerate(stock):
        got = out.sequences[row, T:T + len(expected)]
        assert torch.equal(got, expected), f"row {row}: {tokenizer.decode(got)!r} != {tokenizer.decode(expected)!r}"
    cache = output_cache(out)
    assert isinstance(cache, relay_hf.RelayCache)
    assert cache.prefix_length >= system_len
    cfg = model.config
    per_layer = 2 * cfg.num_key_value_heads * cache.prefix_length * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert cache.prefix_nbytes() == cfg.num_hidden_layers * per_layer  # one copy, not one per row


@pytest.mark.gpu
def test_one_row_with_static_cache_runs_relay_loop_and_equals_stock_on_gpu(smollm2, system_prompt):
    """One row asking for a static cache runs relay_hf's captured loop (its prompt but the last token as the
    "prefix"; relay_hf.policy), fp32 token-identical to stock; without a static cache one row stays stock."""
    model, tokenizer = smollm2
    enc = tokenizer(render(tokenizer, system_prompt, QUESTIONS[3]), return_tensors="pt").to("cuda")
    model.cuda()
    try:
        stock = model.generate(**enc, max_new_tokens=32, do_sample=False)
        relay_hf.patch(model)
        try:
            looped = model.generate(**enc, max_new_tokens=32, do_sample=False, cache_implementation="static")
            one_row = model.relay_last_decision
            plain = model.generate(**enc, max_new_tokens=32, do_sample=False)
            assert not model.relay_last_decision.used and "single row" in model.relay_last_decision.reason
        finally:
            relay_hf.unpatch(model)
    finally:
        model.cpu()
    assert one_row.used and one_row.fast_decode and one_row.rows == 1
    assert one_row.prefix_length == enc["input_ids"].shape[1] - 1
    assert torch.equal(looped, stock) and torch.equal(plain, stock)


def _chat_batch(tokenizer, system_prompt, device, questions=QUESTIONS):
    texts = [render(tokenizer, system_prompt, q) for q in questions]
    return tokenizer(texts, return_tensors="pt", padding=True).to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("separate", [False, True], ids=["kernel layout by rule", "separate launches with PDL"])
def test_compiled_relay_equals_eager_relay_on_gpu(smollm2, system_prompt, relay_on_small_batches, separate):
    """fp32, static RelayCache: relay_hf's decode loop (step compiled by inductor, captured as one CUDA graph) and
    transformers' compiled loop (inductor + CUDA graphs; asked for through ``return_dict_in_generate``) both give the
    eager relay path's tokens. 6 rows x 3 query heads per KV head are below ``KernelConfig.separate_rows``; the second
    case forces the separate prefix/suffix launches (the suffix launch programmatically dependent on the prefix
    launch)."""
    import contextlib
    import dataclasses

    from relay_hf.kernels import triton_relay

    model, tokenizer = smollm2
    layout = contextlib.nullcontext()
    if separate:
        layout = triton_relay.use_config(dataclasses.replace(triton_relay.DEFAULT_CONFIG, separate_rows=(1, 1 << 30)))
        model.__dict__.pop("_compiled_call", None)  # its CUDA graphs were captured with the other layout
    batch = _chat_batch(tokenizer, system_prompt, "cuda")
    relay_hf.patch(model.cuda())
    try:
        with layout:
            eager = model.generate(**batch, max_new_tokens=32, do_sample=False)
            assert not model.relay_last_decision.static
            graphed = model.generate(**batch, max_new_tokens=32, do_sample=False, cache_implementation="static")
            assert model.relay_last_decision.fast_decode and relay_state(model).idle_static().stepper.graph is not None
            again = model.generate(**batch, max_new_tokens=32, do_sample=False, cache_implementation="static")
            hf_loop = model.generate(**batch, max_new_tokens=32, do_sample=False, cache_implementation="static",
                                     return_dict_in_generate=True).sequences
            assert not model.relay_last_decision.fast_decode and hasattr(model, "_compiled_call")
    finally:
        relay_hf.unpatch(model)
        model.cpu()
    assert torch.equal(eager, graphed) and torch.equal(eager, again) and torch.equal(eager, hf_loop)


BF16_NOISE = 0.021  # four tokens of 192: the measured spread of bf16 agreement rates (see the CPU test)


class _ForceTokens:
    """Logits processor for teacher forcing: records the model's own greedy choice at every step, then forces the
    token ``forced[:, step]`` so the next step sees the same history as the run being compared against."""

    def __init__(self, forced: torch.Tensor, prompt_len: int):
        self.forced, self.T, self.choices = forced, prompt_len, []

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.T
        self.choices.append(scores.argmax(-1))
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, self.forced[:, step:step + 1].to(scores.device), 0.0)


def _forced_choices(model, batch, forced: torch.Tensor, **kwargs) -> torch.Tensor:
    """The model's greedy choice at every step of ``generate`` when fed ``forced`` tokens ``[B, n]``."""
    T, n = batch["input_ids"].shape[1], forced.shape[1]
    force = _ForceTokens(forced, T)
    model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False, logits_processor=[force], **kwargs)
    return torch.stack(force.choices, 1).to(forced.device)


def bf16_agreement(model, tokenizer, system_prompt, device, new_tokens: int, questions=QUESTIONS,
                   **relay_kwargs) -> dict:
    """Fractions of greedy tokens equal to stock's batched run, bf16.

    * ``relay_free``: relay's own greedy run vs stock's, position by position: after a first fork every later position
      usually differs.
    * ``relay_forced``: teacher forcing: relay is fed stock's tokens and its next-token choice is compared at every
      step (agreement per token, without the cascade).
    * ``stock_self_forced``: the same for stock run row by row (another batch composition, so other GEMM shapes and
      roundings): the bf16 noise floor of stock itself.
    """
    batch = _chat_batch(tokenizer, system_prompt, device, questions)
    T = batch["input_ids"].shape[1]
    stock = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[:, T:]
    per_row = []
    for row, question in enumerate(questions):
        enc = tokenizer(render(tokenizer, system_prompt, question), return_tensors="pt").to(device)
        per_row.append(_forced_choices(model, enc, stock[row:row + 1]))
    relay_hf.patch(model)
    try:
        free = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              **relay_kwargs)[:, T:]
        forced = _forced_choices(model, batch, stock, **relay_kwargs)
        assert model.relay_last_decision.used
    finally:
        relay_hf.unpatch(model)
    rate = lambda a: (a == stock).float().mean().item()  # noqa: E731
    return dict(relay_free=rate(free), relay_forced=rate(forced), stock_self_forced=rate(torch.cat(per_row)))


@pytest.mark.slow
@pytest.mark.long  # a rate over 192 forced tokens: fewer would widen the noise the bound has to allow
def test_bf16_relay_agrees_with_stock_as_well_as_stock_agrees_with_itself(smollm2, system_prompt):
    """bf16 on CPU (the PyTorch relay path): exact in fp32, so in bf16 relay may differ from stock only about as much
    as stock differs from itself under another batch composition. 192 forced tokens: one token is 0.5%, and the two
    rates swap places between transformers releases (5.24: relay 0.984 vs stock 0.969; 5.17: 0.979 vs 0.990), so the
    bound allows four tokens of noise; a real bf16 precision bug (e.g. a bf16 merge) lands far below it."""
    import copy

    model, tokenizer = smollm2
    rates = bf16_agreement(copy.deepcopy(model).to(torch.bfloat16), tokenizer, system_prompt, "cpu", 32)
    print(f"bf16 CPU agreement with stock's batched run: {rates}")
    assert rates["relay_forced"] >= rates["stock_self_forced"] - BF16_NOISE


@pytest.mark.gpu
def test_compiled_relay_agrees_with_stock_in_bf16_on_gpu(smollm2, system_prompt, relay_on_small_batches):
    """The same on the GPU path (Triton kernel, compiled decode), over 24 rows (1,536 forced tokens; sessions 3-5
    measured the first 6 rows, 384 tokens, where one token moved the rate by 0.26 %)."""
    import copy

    model, tokenizer = smollm2
    model = copy.deepcopy(model).to("cuda", torch.bfloat16)
    model.__dict__.pop("_compiled_call", None)  # a deepcopy would keep the original model's compiled forward
    rates = bf16_agreement(model, tokenizer, system_prompt, "cuda", 64, QUESTIONS + MORE_QUESTIONS,
                           cache_implementation="static")
    print(f"bf16 GPU agreement with stock's batched run, {len(QUESTIONS + MORE_QUESTIONS)} rows x 64 tokens: {rates}")
    assert rates["relay_forced"] >= rates["stock_self_forced"] - BF16_NOISE


def _other_prompts(system_prompt: str) -> tuple[str, str, str]:
    """Two more system prompts (the manual's sections in another order under another intro, and a short one) and a
    block of the manual that some questions quote: distinct texts of different lengths."""
    intro, _, manual = system_prompt.partition("\n\n# ")
    sections = manual.split("\n## ")
    second = ("You are the Northwind returns desk. Answer from the manual excerpts below, in one sentence.\n\n## "
              + "\n## ".join(reversed(sections[1:5])))
    third = ("You are a terse assistant for Northwind Appliances. Reply in at most ten words. Never mention prices "
             "or part numbers, and refer anything about repairs to support@northwind.example.")
    block = "Here is the part of the manual my question is about:\n## " + sections[3] + "\n\nMy question: "
    return second, third, block


@pytest.mark.slow
@pytest.mark.long  # 11 rows of up to ~900 tokens; the tiny-model tests cover grouped prefixes in the default run
def test_three_system_prompts_a_second_level_and_a_row_with_none_equal_stock(smollm2, system_prompt):
    """One batch under three system prompts of different lengths (2 to 5 rows each), three rows of the first also
    quoting one block of the manual (a second level), and a plain-text row that shares nothing: greedy fp32 tokens
    are stock's batched generate's, and each shared part is prefilled and read once."""
    model, tokenizer = smollm2
    second, third, block = _other_prompts(system_prompt)
    texts = ([render(tokenizer, system_prompt, q) for q in QUESTIONS[:2]]
             + [render(tokenizer, system_prompt, block + q) for q in QUESTIONS[2:5]]
             + [render(tokenizer, second, q) for q in MORE_QUESTIONS[:2]]
             + [render(tokenizer, third, q) for q in MORE_QUESTIONS[2:5]]
             + ["Question: " + QUESTIONS[5] + "\nAnswer:"])
    order = [0, 5, 7, 1, 2, 6, 8, 3, 10, 4, 9]  # interleaved, as a dataset would bring them
    batch = tokenizer([texts[i] for i in order], return_tensors="pt", padding=True)
    stock = model.generate(**batch, max_new_tokens=16, do_sample=False)
    relay_hf.patch(model)
    try:
        out = model.generate(**batch, max_new_tokens=16, do_sample=False)
        decision = model.relay_last_decision
    finally:
        relay_hf.unpatch(model)
    assert decision.used, decision
    levels = sorted((level, rows) for level, rows, _ in decision.groups)
    assert levels == [(0, 2), (0, 3), (0, 5), (1, 3)], decision.groups
    assert min(tokens for _, _, tokens in decision.groups) >= 32
    assert torch.equal(out, stock)
