"""A text-generation pipeline that serves many questions under one system prompt, prefilling it once.

    import relay_hf

    pipe = relay_hf.pipeline("text-generation", model="HuggingFaceTB/SmolLM2-135M-Instruct",
                             system_prompt="You are ...")
    pipe(["question 1", "question 2", ...], batch_size=8, max_new_tokens=64)

``relay_hf.pipeline`` takes what ``transformers.pipeline`` takes (a loaded model or a Hub id / local path, ``dtype``,
``device``, ``device_map``, ``model_kwargs`` such as ``{"gguf_file": ...}``, ...). The task is also registered with
transformers as ``"relay-text-generation"`` when ``relay_hf`` is imported, so after ``import relay_hf``
``transformers.pipeline("relay-text-generation", model=..., system_prompt=...)`` builds the same pipeline.

Inputs: whatever ``TextGenerationPipeline`` takes (one string or chat, lists of them, generators, ``KeyDataset`` or
any torch ``Dataset``). Every item gets the system prompt in preprocessing: a user string becomes
``[system, user]``, a chat without a system message gets it in front, a chat with its own system message is left as
it is. Outputs are what stock ``TextGenerationPipeline`` returns for those conversations.

The shared prefix is the longest common token prefix of conversations rendered with the chat template (a template may
put per-turn tokens right after the system text). It is prefilled once into a ``RelayCache`` on first use and reused
by every call and batch until ``system_prompt`` changes. A batch whose rows do not all start with it (a chat carrying
another system message) runs without it: patched ``generate`` then finds its own shared prefix, or runs stock.
"""

from __future__ import annotations

import copy
import threading
import weakref

import torch
from transformers import AutoModelForCausalLM, TextGenerationPipeline
from transformers import pipeline as hf_pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from ._compat import cache_kwarg_name, chat_messages, pipeline_chat
from .cache import RelayCache
from .patch import is_patched, patch, unpatch
from .policy import CACHE_NAMES, model_reason
from .prefix import common_prefix_length, first_mismatch, left_padding

TASK = "relay-text-generation"
# two user turns that differ from their first character, to find where the rendered conversations diverge
_PROBES = ("A", "7")


class RelayTextGenerationPipeline(TextGenerationPipeline):
    """``TextGenerationPipeline`` with a ``system_prompt`` whose KV is computed once and shared by every row.

    What it does to the objects you pass:

    * tokenizer: never changed. Batched generation needs left padding and a pad token; a tokenizer that pads on the
      right or has no pad token is copied (``pipe.tokenizer`` is then the copy: left padding, pad = eos).
    * model: patched with ``relay_hf.patch`` if it is not patched yet, for as long as the pipeline lives. The patch
      is undone by ``pipe.close()``, on leaving ``with relay_hf.pipeline(...) as pipe:``, or when the pipeline is
      garbage-collected, once no other pipeline built on the same model still uses it. A model you patched yourself
      stays patched. (A patched model's ``generate`` returns what stock returns; the patch changes the model's
      attention implementation name to ``"relay"``.) As with any pipeline, ``device=`` moves the model.

    The ``RelayCache`` of the system prompt is built lazily, once, under a lock (concurrent calls from several threads
    share one prefill), and never for a model relay cannot serve (``relay_hf.policy.model_reason``): such a model
    runs stock ``generate`` with the system prompt in every row.
    """

    def __init__(self, model, tokenizer=None, *args, system_prompt: str | None = None, **kwargs):
        super().__init__(model, _left_padding_tokenizer(tokenizer), *args, **kwargs)
        self._system_prompt = system_prompt
        self._cache: RelayCache | None = None
        self._lock = threading.Lock()  # guards _system_prompt / _cache: one prefill however many threads call
        release = _hold_patch(self.model)
        self._finalizer = weakref.finalize(self, release) if release is not None else None
        if self._finalizer is not None:
            self._finalizer.atexit = False  # at interpreter exit nothing needs restoring

    @property
    def system_prompt(self) -> str | None:
        return self._system_prompt

    @system_prompt.setter
    def system_prompt(self, value: str | None) -> None:
        with self._lock:
            if value != self._system_prompt:
                self._system_prompt, self._cache = value, None

    def close(self) -> None:
        """Drop the prefix cache and let go of the patch this pipeline applied (see the class docstring); once the
        patch is undone, calls run stock ``generate``."""
        with self._lock:
            self._cache = None
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> RelayTextGenerationPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inputs ----------------------------------------------------------------------------------------------------
    def _with_system(self, item):
        """``item`` as the conversation to render: a chat that starts with a system message (``system_prompt`` unless
        it has its own), or ``item`` as it is when there is no ``system_prompt`` or ``item`` is no text."""
        system_prompt = self._system_prompt
        if system_prompt is None:
            return item
        system = {"role": "system", "content": system_prompt}
        if isinstance(item, str):
            return pipeline_chat([system, {"role": "user", "content": item}])
        # a plain list of messages reaches here when the batch mixes strings and chats (transformers wraps only
        # all-chat batches as chats)
        messages = chat_messages(item)
        if messages is None:
            return item
        return pipeline_chat(messages if messages[0]["role"] == "system" else [system, *messages])

    def preprocess(self, prompt_text, *args, **kwargs):
        """Per item (lists, generators and datasets alike): the system prompt first, then stock preprocessing."""
        return super().preprocess(self._with_system(prompt_text), *args, **kwargs)

    # -- the shared prefix -----------------------------------------------------------------------------------------
    def prefix_ids(self) -> torch.Tensor | None:
        """``[P]`` int64 tokens every conversation under ``system_prompt`` starts with, or ``None``."""
        system_prompt = self._system_prompt
        if system_prompt is None:
            return None
        rendered = [self.tokenizer.apply_chat_template(
            [{"role": "system", "content": system_prompt}, {"role": "user", "content": probe}],
            tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"] for probe in _PROBES]
        rows = [torch.as_tensor(r).flatten() for r in rendered]
        T = max(len(r) for r in rows)
        ids = torch.stack([torch.nn.functional.pad(r, (T - len(r), 0)) for r in rows])  # left-padded
        P = common_prefix_length(ids, torch.tensor([T - len(r) for r in rows]))
        return rows[0][:P] if P > 0 else None

    def prefix_cache(self) -> RelayCache | None:
        """The ``RelayCache`` of the system prompt, prefilled on first use; ``None`` without a system prompt, or when
        relay cannot serve the model (then no cache is built at all)."""
        with self._lock:
            if self._cache is None and model_reason(self.model) is None:
                ids = self.prefix_ids()
                if ids is not None:
                    self._cache = RelayCache.from_prefix(self.model, ids)
            return self._cache

    def _forward(self, model_inputs, **generate_kwargs):
        ids, mask = model_inputs["input_ids"], model_inputs.get("attention_mask")
        if ids.shape[1] > 0 and not any(generate_kwargs.get(name) is not None for name in CACHE_NAMES):
            cache = self.prefix_cache()
            if cache is not None:
                n_pad = left_padding(mask if mask is not None else torch.ones_like(ids))
                if n_pad is not None and first_mismatch(ids, n_pad, cache.prefix_ids) is None:
                    generate_kwargs[cache_kwarg_name(self.model)] = cache
        return super()._forward(model_inputs, **generate_kwargs)


def _left_padding_tokenizer(tokenizer):
    """``tokenizer`` if it pads on the left with a pad token, else a copy that does (the caller's stays as it is)."""
    if tokenizer is None or (tokenizer.padding_side == "left" and tokenizer.pad_token is not None):
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side = "left"  # decoder-only batches must be left-padded
    if tokenizer.pad_token is None:  # what transformers suggests for batching without one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# relay states patched by pipelines -> [state, pipelines alive on it]; the state is kept so its id stays unique.
# Re-entrant: a pipeline's finalizer (``release``) can run from garbage collection inside ``_hold_patch`` itself
# (patching allocates), on the same thread, and must not wait for the lock that thread holds.
_HELD: dict[int, list] = {}
_HELD_LOCK = threading.RLock()


def _hold_patch(model):
    """Patch ``model`` for a pipeline unless its owner patched it. Returns the callable that lets go of it (the
    last pipeline to let go unpatches), or ``None`` when the patch is not the pipelines' to undo."""
    with _HELD_LOCK:
        if not is_patched(model):
            patch(model)
            _HELD[id(model._relay_state)] = [model._relay_state, 0]
        held = _HELD.get(id(model._relay_state))
        if held is None:
            return None
        held[1] += 1
        state = held[0]

    def release():
        with _HELD_LOCK:
            held[1] -= 1
            if held[1] > 0:
                return
            del _HELD[id(state)]
            if model.__dict__.get("_relay_state") is state:  # unpatched (or re-patched) by its owner meanwhile: theirs
                unpatch(model)

    return release


def pipeline(task: str | None = "text-generation", model=None, tokenizer=None, *, system_prompt: str | None = None,
             **kwargs) -> RelayTextGenerationPipeline:
    """``transformers.pipeline`` for ``"relay-text-generation"`` (``task`` may say ``"text-generation"``).

    Args:
        task: ``"text-generation"``, ``"relay-text-generation"`` or ``None``.
        model: a loaded causal LM (patched while the pipeline lives, see ``RelayTextGenerationPipeline``), a Hub id
            or a local path (loaded by transformers), or ``None`` for the default model of ``"text-generation"``.
        tokenizer: a tokenizer, an id / path, or ``None`` to load the model's.
        system_prompt: the system message every conversation starts with; ``None`` for none (plain pipeline).
        **kwargs: anything ``transformers.pipeline`` takes: ``dtype``, ``device``, ``device_map``, ``revision``,
            ``model_kwargs`` (e.g. ``{"gguf_file": "model.gguf"}``), ``trust_remote_code``, generation defaults...
    """
    if task not in (None, "text-generation", TASK):
        raise ValueError(f"relay_hf.pipeline serves text generation, not {task!r}")
    return hf_pipeline(TASK, model=model, tokenizer=tokenizer, system_prompt=system_prompt, **kwargs)


# the same defaults as stock text generation, so "relay-text-generation" drops in for "text-generation"
_STOCK_TASK = PIPELINE_REGISTRY.to_dict()["text-generation"]
PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=RelayTextGenerationPipeline, pt_model=AutoModelForCausalLM,
                                    default=_STOCK_TASK.get("default"), type=_STOCK_TASK.get("type", "text"))
