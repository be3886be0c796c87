"""relay_hf.pipeline on the embedded SmolLM2 (fp32, CPU): same answers as the stock text-generation pipeline.

Kept small for a 2-core CPU: a ~200-token system prompt (the manual's first sections; the relay path is the same at
any prefix length), 4 questions, 8 new tokens."""

import copy
import gc
import importlib
import threading

import pytest
import torch
import transformers
from transformers.generation.streamers import BaseStreamer
from transformers.pipelines import PIPELINE_REGISTRY

import relay_hf
from examples.chat_batch import QUESTIONS, held_bytes  # the demo's questions
from relay_hf.state import relay_state
from tests.helpers import SMOLLM2_FILE, smollm2_dir

QS = QUESTIONS[:4]
GEN = dict(max_new_tokens=8, do_sample=False)
pytestmark = pytest.mark.slow
pipeline_module = importlib.import_module("relay_hf.pipeline")  # `relay_hf.pipeline` is the function
patch_module = importlib.import_module("relay_hf.patch")  # and so is `relay_hf.patch`


def chats(system, questions):
    return [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]


@pytest.fixture(scope="module")
def system(system_prompt):
    return "\n\n".join(system_prompt.split("\n\n")[:3])


@pytest.fixture(scope="module")
def stock_answers(smollm2, system):
    """Stock pipeline outputs (model unpatched): batch size 1 for QS[:2], batch size 3 for QS (batches of 3 and 1)."""
    model, tokenizer = smollm2
    relay_hf.unpatch(model)
    stock = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    return {1: stock(chats(system, QS[:2]), batch_size=1, **GEN), 3: stock(chats(system, QS), batch_size=3, **GEN)}


@pytest.fixture
def relay_pipe(smollm2, system, stock_answers):
    model, tokenizer = smollm2
    pipe = relay_hf.pipeline("text-generation", model=model, tokenizer=tokenizer, system_prompt=system)
    yield pipe
    pipe.close()
    relay_hf.unpatch(model)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_answers_equal_stock(relay_pipe, stock_answers, batch_size):
    got = relay_pipe(QS[:len(stock_answers[batch_size])], batch_size=batch_size, **GEN)
    assert got == stock_answers[batch_size]
    assert relay_pipe.model.relay_last_decision.used


def _users(questions):
    return [[{"role": "user", "content": q}] for q in questions]


def _dataset(column, values):
    datasets = pytest.importorskip("datasets")
    from transformers.pipelines.pt_utils import KeyDataset

    return KeyDataset(datasets.Dataset.from_dict({column: values}), column)


# each input kind gets the system prompt per item, so it answers what stock answers for [system, user]
INPUTS = {
    "string": (lambda: QS[0], 1),
    "chat": (lambda: _users(QS[:1])[0], 1),
    "generator of strings": (lambda: (q for q in QS[:3]), 3),
    "generator of chats": (lambda: (c for c in _users(QS[:3])), 3),
    "KeyDataset of strings": (lambda: _dataset("question", QS[:3]), 3),
    "KeyDataset of chats": (lambda: _dataset("messages", _users(QS[:3])), 3),
}


@pytest.mark.parametrize("kind", INPUTS)
def test_every_input_kind_gets_the_system_prompt(relay_pipe, stock_answers, kind):
    make, batch_size = INPUTS[kind]
    got = relay_pipe(make(), batch_size=batch_size, **GEN)
    if batch_size == 1:  # one string or chat: one list of records, as stock returns for one conversation
        assert got == stock_answers[1][0]
    else:  # generators and datasets stream; stock batches of 3 start with the same 3 conversations
        assert list(got) == stock_answers[3][:3]
    decision = relay_pipe.model.relay_last_decision
    assert decision.used and decision.prefix_length == len(relay_pipe.prefix_ids())


def test_prefix_prefilled_once_and_again_after_a_change(relay_pipe, system):
    P = len(relay_pipe.prefix_ids())
    prefills = []
    hook = relay_pipe.model.base_model.register_forward_pre_hook(
        lambda mod, args, kwargs: prefills.append(kwargs["input_ids"].shape) if kwargs.get("input_ids") is not None
        and kwargs["input_ids"].shape == (1, P) else None, with_kwargs=True)
    try:
        relay_pipe(QS[:2], batch_size=2, max_new_tokens=1, do_sample=False)
        relay_pipe(QS[2:], batch_size=2, max_new_tokens=1, do_sample=False)
        assert len(prefills) == 1
        relay_pipe.system_prompt = system.replace("Brewbot", "Beanbot")
        assert relay_pipe.prefix_cache() is not None and len(prefills) == 2
        relay_pipe(QS[:2], batch_size=2, max_new_tokens=1, do_sample=False)
        assert len(prefills) == 2
    finally:
        hook.remove()


def test_threads_share_one_prefill(relay_pipe):
    hits = relay_hf.stats(relay_pipe.model).prefix_hits
    relay_hf.clear_prefixes(relay_pipe.model)
    barrier = threading.Barrier(4)
    got = []

    def call():
        barrier.wait()
        got.append(relay_pipe.prefix_cache())

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # one thread prefilled, three found its KV kept: the very same tensors
    assert len(got) == 4 and relay_hf.stats(relay_pipe.model).prefix_hits == hits + 3
    assert all(c.layers[0].prefix_keys is got[0].layers[0].prefix_keys for c in got)


def test_chat_with_its_own_system_message(relay_pipe, smollm2, system):
    model, tokenizer = smollm2
    pirate = [{"role": "system", "content": "You are a pirate. Answer like one."},
              {"role": "user", "content": "How long does the boiler take to heat up?"}]
    mixed = [QS[0], pirate, [{"role": "user", "content": QS[1]}]]
    got = relay_pipe(mixed, batch_size=3, **GEN)
    relay_hf.unpatch(model)
    stock = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    expected = stock([*chats(system, QS[:1]), pirate, *chats(system, QS[1:2])],
                     batch_size=3, **GEN)
    assert got == expected
    assert got[1][0]["generated_text"][0]["content"].startswith("You are a pirate")


def test_return_full_text_and_streaming_match_stock(relay_pipe, smollm2, system):
    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.append(value.flatten().tolist())

        def end(self):
            pass

    relay_stream = Collect()
    got = relay_pipe(QS[2], return_full_text=False, streamer=relay_stream, **GEN)
    model, tokenizer = smollm2
    relay_hf.unpatch(model)
    stock_stream = Collect()
    stock = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    expected = stock(chats(system, QS[2:3])[0], return_full_text=False, streamer=stock_stream, **GEN)
    assert got == expected and isinstance(got[0]["generated_text"], str)
    assert relay_stream.tokens == stock_stream.tokens and len(relay_stream.tokens) > 2


def test_callers_tokenizer_is_left_as_it_is(smollm2, system):
    model, session_tokenizer = smollm2
    relay_hf.unpatch(model)
    tokenizer = copy.deepcopy(session_tokenizer)
    tokenizer.padding_side, tokenizer.pad_token = "right", None
    with relay_hf.pipeline("text-generation", model=model, tokenizer=tokenizer, system_prompt=system) as pipe:
        out = pipe(QS[:2], batch_size=2, max_new_tokens=1, do_sample=False)  # batching needs a pad token
        assert pipe.tokenizer is not tokenizer
        assert (pipe.tokenizer.padding_side, pipe.tokenizer.pad_token) == ("left", tokenizer.eos_token)
    assert len(out) == 2 and (tokenizer.padding_side, tokenizer.pad_token) == ("right", None)
    assert not relay_hf.is_patched(model)


def test_the_patch_lives_as_long_as_the_pipelines_that_applied_it(smollm2, system):
    model, tokenizer = smollm2
    relay_hf.unpatch(model)
    first = relay_hf.pipeline(model=model, tokenizer=tokenizer, system_prompt=system)
    second = transformers.pipeline("relay-text-generation", model=model, tokenizer=tokenizer)
    assert relay_hf.is_patched(model)
    first.close()
    assert relay_hf.is_patched(model)  # the second pipeline still uses it
    del second
    gc.collect()
    assert not relay_hf.is_patched(model)


def test_a_model_patched_by_its_caller_stays_patched(smollm2, system):
    model, tokenizer = smollm2
    relay_hf.patch(model)
    try:
        relay_hf.pipeline(model=model, tokenizer=tokenizer, system_prompt=system).close()
        assert relay_hf.is_patched(model)
    finally:
        relay_hf.unpatch(model)


def test_no_cache_for_a_model_relay_cannot_serve(smollm2, system, monkeypatch):
    """Falcon with ALiBi: the patch declines, the pipeline builds no RelayCache and answers as stock."""
    _, session_tokenizer = smollm2
    config = transformers.FalconConfig(vocab_size=len(session_tokenizer), hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, alibi=True, pad_token_id=session_tokenizer.pad_token_id,
                                       attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()
    gen = dict(max_new_tokens=3, do_sample=False)
    stock = transformers.pipeline("text-generation", model=model, tokenizer=session_tokenizer)
    expected = stock(chats(system, QS[:2]), batch_size=2, **gen)
    with pytest.warns(relay_hf.RelayFallbackWarning, match="ALiBi"):
        pipe = relay_hf.pipeline(model=model, tokenizer=session_tokenizer, system_prompt=system)
    with pipe:
        assert pipe(QS[:2], batch_size=2, **gen) == expected
        assert pipe.prefix_cache() is None and pipe.kept_system_prompts() == 0


def test_registered_with_transformers(smollm2, system):
    model, tokenizer = smollm2
    _, impl, _ = PIPELINE_REGISTRY.check_task("relay-text-generation")
    stock = PIPELINE_REGISTRY.check_task("text-generation")[1]
    assert impl["impl"] is pipeline_module.RelayTextGenerationPipeline and impl["pt"] == stock["pt"]
    assert impl["type"] == stock["type"] == "text" and impl["default"] == stock["default"]
    try:
        pipe = transformers.pipeline("relay-text-generation", model=model, tokenizer=tokenizer,
                                     system_prompt=system)
        assert isinstance(pipe, pipeline_module.RelayTextGenerationPipeline) and relay_hf.is_patched(model)
        assert torch.equal(pipe.prefix_cache().prefix_ids, pipe.prefix_ids())
    finally:
        relay_hf.unpatch(model)
    with pytest.raises(ValueError, match="summarization"):
        relay_hf.pipeline("summarization", model=model)


def test_model_by_path_with_loading_kwargs(smollm2, stock_answers, system):
    """A local path (or Hub id) with what transformers.pipeline takes: model_kwargs (a GGUF file), dtype,
    device_map."""
    pipe = relay_hf.pipeline("text-generation", model=smollm2_dir(), model_kwargs={"gguf_file": SMOLLM2_FILE},
                             dtype=torch.float32, device_map="cpu", system_prompt=system)
    assert pipe.model is not smollm2[0] and pipe.model.dtype == torch.float32 and relay_hf.is_patched(pipe.model)
    assert pipe(QS[:3], batch_size=3, **GEN) == stock_answers[3][:3]
    assert pipe.model.relay_last_decision.used


def test_kv_bytes_count_held_storage_once():
    """examples/chat_batch.py measures KV memory from the caches' tensors: each storage once, however many layers
    or forks refer to it."""
    from transformers import DynamicCache

    n, H, D = 2, 2, 16
    config = transformers.LlamaConfig(num_hidden_layers=n, num_attention_heads=H, num_key_value_heads=H,
                                      hidden_size=H * D, head_dim=D)
    dynamic = DynamicCache()
    for i in range(n):
        dynamic.update(torch.randn(3, H, 5, D), torch.randn(3, H, 5, D), i)
    assert held_bytes(dynamic) == 2 * n * 3 * H * 5 * D * 4
    shared = (torch.randn(1, H, 7, D), torch.randn(1, H, 7, D))
    cache = relay_hf.RelayCache(config, [shared] * n)  # every layer refers to one prefix storage
    assert held_bytes(cache) == 2 * H * 7 * D * 4
    fork = cache.fork()  # shares the prefix storage, adds per-row suffix buffers
    for i in range(n):
        fork.update(torch.randn(3, H, 2, D), torch.randn(3, H, 2, D), i)
    assert held_bytes(fork) - held_bytes(cache) >= 2 * n * 3 * H * 2 * D * 4


def test_a_pipeline_let_go_of_during_another_patch_does_not_deadlock():
    """A pipeline's finalizer may run from garbage collection while ``hold_patch`` holds its lock on the same thread
    (patching allocates); letting go must not wait for that lock."""
    from tests.helpers import tiny_model

    model = tiny_model("llama")
    release = patch_module.hold_patch(model)
    assert relay_hf.is_patched(model)

    def collect_inside_the_lock():
        with patch_module._HELD_LOCK:  # where hold_patch runs patch()
            release()

    worker = threading.Thread(target=collect_inside_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "letting go of a pipeline deadlocked on the pipelines' lock"
    assert not relay_hf.is_patched(model)  # the last pipeline let go: the patch is undone


# -- a system prompt per input --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(system):
    """Three system prompts of different lengths."""
    return [system, "You are a pirate. Answer every question like one, in one short sentence, and never mention "
                    "anything you cannot find in the manual of the espresso machine.", system.split("\n\n")[0]]


def test_a_system_prompt_per_input_answers_as_stock_and_reads_each_once(smollm2, relay_pipe, prompts):
    model, tokenizer = smollm2
    per_input = [prompts[0], prompts[1], prompts[2], prompts[1], prompts[0], prompts[2]]
    questions = QS + QUESTIONS[4:6]
    got = relay_pipe(questions, system_prompt=per_input, batch_size=6, **GEN)
    decision = relay_pipe.model.relay_last_decision
    assert decision.used and sorted(rows for _, rows, _ in decision.groups) == [2, 2, 2]
    assert relay_pipe.kept_system_prompts() == 3
    relay_hf.unpatch(model)
    stock = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    expected = stock([chats(s, [q])[0] for s, q in zip(per_input, questions)], batch_size=6, **GEN)
    assert got == expected


def prefills(pipe, since: int) -> int:
    """Prefills of system prompts since the model's prefix store had ``since`` misses."""
    return relay_state(pipe.model).store.misses - since


def test_kept_system_prompts_are_reused_across_calls_within_the_byte_budget(smollm2, relay_pipe, prompts,
                                                                          monkeypatch):
    relay_hf.clear_prefixes(relay_pipe.model)
    start = relay_state(relay_pipe.model).store.misses
    packed = []
    combine = pipeline_module.RelayCache.combine
    monkeypatch.setattr(pipeline_module.RelayCache, "combine", staticmethod(lambda c: packed.append(1) or combine(c)))
    relay_pipe(QS[:2], system_prompt=prompts[:2], batch_size=2, max_new_tokens=1, do_sample=False)
    relay_pipe(QS[2:4], system_prompt=prompts[:2], batch_size=2, max_new_tokens=1, do_sample=False)
    assert prefills(relay_pipe, start) == 2 and len(packed) == 1  # both prefilled once, packed once, reused
    one = relay_pipe.prefix_cache(prompts[0]).prefix_nbytes()
    start = relay_state(relay_pipe.model).store.misses
    relay_pipe.prefix_cache_bytes = one  # room for one prompt: the least recently used goes
    relay_pipe(QS[:2], system_prompt=[prompts[2], prompts[2]], batch_size=2, max_new_tokens=1, do_sample=False)
    assert relay_pipe.kept_system_prompts() == 1 and prefills(relay_pipe, start) == 1
    relay_pipe(QS[:2], system_prompt=prompts[:2], batch_size=2, max_new_tokens=1, do_sample=False)
    assert prefills(relay_pipe, start) == 3  # evicted ones are prefilled again; a batch keeps its own prompts
    assert relay_state(relay_pipe.model).store.nbytes() <= one


def test_a_batch_with_a_row_under_no_system_prompt_finds_its_own_groups(smollm2, relay_pipe, prompts):
    model, tokenizer = smollm2
    per_input = [prompts[0], None, prompts[0], prompts[1], prompts[1]]
    questions = QUESTIONS[:5]
    got = relay_pipe(questions, system_prompt=per_input, batch_size=5, **GEN)
    decision = relay_pipe.model.relay_last_decision
    assert decision.used and len(decision.groups) >= 2
    relay_hf.unpatch(model)
    stock = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    conversations = [chats(s, [q])[0] if s is not None else q for s, q in zip(per_input, questions)]
    assert got == [stock(c, **GEN) for c in conversations]


def test_chats_bring_their_own_system_prompts(smollm2, relay_pipe, prompts):
    conversations = [chats(prompts[i % 2], [q])[0] for i, q in enumerate(QUESTIONS[:4])]
    got = relay_pipe(_dataset("messages", conversations), batch_size=4, **GEN)
    assert relay_pipe.model.relay_last_decision.used and len(relay_pipe.model.relay_last_decision.groups) == 2
    model, tokenizer = smollm2
    relay_hf.unpatch(model)
    stock = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    assert list(got) == list(stock(_dataset("messages", conversations), batch_size=4, **GEN))


@pytest.mark.parametrize("call, match", [
    (lambda pipe, s: pipe(QS[:2], system_prompt=s[:1]), "1 system prompts for 2 inputs"),
    (lambda pipe, s: pipe((q for q in QS[:2]), system_prompt=s[:2]), "list of inputs"),
    (lambda pipe, s: pipe(chats(s[0], QS[:1])[0], system_prompt=s[1:2]), "list of inputs"),
    (lambda pipe, s: pipe(chats(s[0], QS[:2]), system_prompt=s[1:3]), "its own system message"),
    (lambda pipe, s: pipe(QS[:2], system_prompt=[s[0], 3]), "must be a string or None"),
    (lambda pipe, s: pipe({"not": "an input"}, system_prompt=s[0]), "not a dict"),
])
def test_bad_system_prompts_are_refused_by_name_and_the_pipeline_stays_usable(relay_pipe, prompts, stock_answers,
                                                                              call, match):
    with pytest.raises(ValueError, match=match):
        call(relay_pipe, prompts)
    assert relay_pipe(QS[:1], batch_size=1, **GEN) == stock_answers[1][:1]


def test_kept_prompts_the_batch_does_not_use_stay_within_the_budget(relay_pipe, prompts):
    relay_hf.clear_prefixes(relay_pipe.model)
    start = relay_state(relay_pipe.model).store.misses
    for system_prompt in (prompts[0], prompts[1], prompts[0]):  # the second batch does not use the first's prompt
        relay_pipe(QS[:2], system_prompt=system_prompt, batch_size=2, max_new_tokens=1, do_sample=False)
    assert relay_pipe.kept_system_prompts() == 2 and prefills(relay_pipe, start) == 2


# -- kept prompts never outlive what their KV depends on (a tiny random model: its weights may be changed) -----------
VOCAB_OF_SMOLLM2 = 49152


def _tiny_chat_model(seed=0, arch="llama", **overrides):
    """A tiny random model over SmolLM2's vocabulary (so its tokenizer and chat template serve it), attention dropout
    on (it acts in training mode only)."""
    config = dict(LlamaConfig=dict(attention_dropout=0.5), MistralConfig=dict(sliding_window=8))
    name = {"llama": "LlamaConfig", "mistral": "MistralConfig"}[arch]
    cfg = getattr(transformers, name)(vocab_size=VOCAB_OF_SMOLLM2, hidden_size=64, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=1024, pad_token_id=2, bos_token_id=1, eos_token_id=2,
                                      **{**config[name], **overrides})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _stock(model, tokenizer, system, questions, **gen):
    relay_hf.unpatch(model)  # a model a pipeline patched (it patches it back when it runs again)
    return transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)(
        chats(system, questions), batch_size=len(questions), **{**GEN, **gen})


def _edit_in_place(model):
    with torch.no_grad():
        for p in model.model.layers[0].self_attn.parameters():
            p.mul_(-1.0)


CHANGES = {
    "load_state_dict": lambda model: model.load_state_dict(_tiny_chat_model(seed=1).state_dict()),
    "an in-place weight update": _edit_in_place,
    "model.to(float64)": lambda model: model.to(torch.float64),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_kept_prompt_is_prefilled_again_after_the_model_changed(smollm2, system, change):
    _, tokenizer = smollm2
    model = _tiny_chat_model()
    with relay_hf.pipeline("text-generation", model=model, tokenizer=tokenizer, system_prompt=system) as pipe:
        pipe(QS[:2], batch_size=2, **GEN)
        CHANGES[change](model)
        got = pipe(QS[:2], batch_size=2, **GEN)
        assert model.relay_last_decision.used
        changed = _stock(model, tokenizer, system, QS[:2])
    assert got == changed


def test_a_call_in_training_mode_keeps_no_prefix(smollm2, system):
    _, tokenizer = smollm2
    model = _tiny_chat_model()
    with relay_hf.pipeline("text-generation", model=model, tokenizer=tokenizer, system_prompt=system) as pipe:
        model.train()
        pipe(QS[:2], batch_size=2, **GEN)
        assert pipe.kept_system_prompts() == 0 and not model.relay_last_decision.used
        model.eval()
        got = pipe(QS[:2], batch_size=2, **GEN)
        assert model.relay_last_decision.used
        expected = _stock(model, tokenizer, system, QS[:2])
    assert got == expected


def test_one_call_time_system_prompt_serves_a_dataset(smollm2, system):
    _, tokenizer = smollm2
    model = _tiny_chat_model()
    expected = _stock(model, tokenizer, system, QS[:3])
    with relay_hf.pipeline("text-generation", model=model, tokenizer=tokenizer) as pipe:
        got = list(pipe(_dataset("question", QS[:3]), system_prompt=system, batch_size=3, **GEN))
        assert model.relay_last_decision.used
        assert list(pipe((q for q in QS[:3]), system_prompt=system, batch_size=3, **GEN)) == expected
    assert got == expected
    with pytest.raises(ValueError, match="not a int"):
        pipe(7, system_prompt=system)


@pytest.mark.parametrize("gen", [dict(batch_size=1), dict(no_repeat_ngram_size=2), dict(repetition_penalty=1.3)],
                         ids=["one row", "no_repeat_ngram_size", "repetition_penalty"])
def test_a_sliding_window_model_past_its_window_answers_as_stock(smollm2, system, gen):
    """The system prompt is far longer than the window (8): calls that run stock must not trip on the window."""
    _, tokenizer = smollm2
    model = _tiny_chat_model(arch="mistral")
    batch = gen.pop("batch_size", 2)
    with relay_hf.pipeline("text-generation", model=model, tokenizer=tokenizer, system_prompt=system) as pipe:
        got = pipe(QS[:2], batch_size=batch, **GEN, **gen)
    relay_hf.unpatch(model)
    expected = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)(
        chats(system, QS[:2]), batch_size=batch, **GEN, **gen)
    assert got == expected
