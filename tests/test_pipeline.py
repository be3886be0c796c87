"""relay_hf.pipeline on the embedded SmolLM2 (fp32, CPU): same answers as the stock text-generation pipeline."""

import pytest
import torch
import transformers
from transformers.generation.streamers import BaseStreamer

import relay_hf
from examples.chat_batch import QUESTIONS  # the demo's 8 questions

GEN = dict(max_new_tokens=16, do_sample=False)
pytestmark = pytest.mark.slow


def chats(system, questions):
    return [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]


@pytest.fixture(scope="module")
def stock_answers(smollm2, system_prompt):
    """Stock pipeline outputs per batch size (model unpatched)."""
    model, tokenizer = smollm2
    relay_hf.unpatch(model)
    stock = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    return {bs: stock(chats(system_prompt, QUESTIONS), batch_size=bs, **GEN) for bs in (1, 3, 8)}


@pytest.fixture
def relay_pipe(smollm2, system_prompt, stock_answers):
    model, tokenizer = smollm2
    pipe = relay_hf.pipeline("text-generation", model=model, tokenizer=tokenizer, system_prompt=system_prompt)
    yield pipe
    relay_hf.unpatch(model)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_answers_equal_stock(relay_pipe, stock_answers, batch_size):
    got = relay_pipe(QUESTIONS, batch_size=batch_size, **GEN)
    assert got == stock_answers[batch_size]
    assert relay_pipe.model.relay_last_decision.used


def test_prefix_prefilled_once_and_again_after_a_change(relay_pipe, system_prompt):
    P = len(relay_pipe.prefix_ids())
    prefills = []
    hook = relay_pipe.model.base_model.register_forward_pre_hook(
        lambda mod, args, kwargs: prefills.append(kwargs["input_ids"].shape) if kwargs.get("input_ids") is not None
        and kwargs["input_ids"].shape == (1, P) else None, with_kwargs=True)
    try:
        relay_pipe(QUESTIONS[:3], batch_size=3, **GEN)
        relay_pipe(QUESTIONS[3:], batch_size=2, **GEN)
        assert len(prefills) == 1
        relay_pipe.system_prompt = system_prompt.replace("Brewbot", "Beanbot")
        assert relay_pipe.prefix_cache() is not None and len(prefills) == 2
        relay_pipe(QUESTIONS[:2], batch_size=2, **GEN)
        assert len(prefills) == 2
    finally:
        hook.remove()


def test_chat_with_its_own_system_message(relay_pipe, smollm2, system_prompt):
    model, tokenizer = smollm2
    pirate = [{"role": "system", "content": "You are a pirate. Answer like one."},
              {"role": "user", "content": "How long does the boiler take to heat up?"}]
    mixed = [QUESTIONS[0], pirate, [{"role": "user", "content": QUESTIONS[1]}]]
    got = relay_pipe(mixed, batch_size=3, **GEN)
    relay_hf.unpatch(model)
    stock = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    expected = stock([*chats(system_prompt, QUESTIONS[:1]), pirate, *chats(system_prompt, QUESTIONS[1:2])],
                     batch_size=3, **GEN)
    assert got == expected
    assert got[1][0]["generated_text"][0]["content"].startswith("You are a pirate")


def test_return_full_text_and_streaming_match_stock(relay_pipe, smollm2, system_prompt):
    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.append(value.flatten().tolist())

        def end(self):
            pass

    relay_stream = Collect()
    got = relay_pipe(QUESTIONS[2], return_full_text=False, streamer=relay_stream, **GEN)
    model, tokenizer = smollm2
    relay_hf.unpatch(model)
    stock_stream = Collect()
    stock = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    expected = stock(chats(system_prompt, QUESTIONS[2:3])[0], return_full_text=False, streamer=stock_stream, **GEN)
    assert got == expected and isinstance(got[0]["generated_text"], str)
    assert relay_stream.tokens == stock_stream.tokens and len(relay_stream.tokens) > 2


def test_registered_with_transformers(smollm2, system_prompt):
    model, tokenizer = smollm2
    try:
        pipe = transformers.pipeline("relay-text-generation", model=model, tokenizer=tokenizer,
                                     system_prompt=system_prompt)
        assert isinstance(pipe, relay_hf.RelayTextGenerationPipeline) and relay_hf.is_patched(model)
        assert torch.equal(pipe.prefix_cache().prefix_ids, pipe.prefix_ids())
    finally:
        relay_hf.unpatch(model)
