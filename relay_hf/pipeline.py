"""A text-generation pipeline that serves many questions under system prompts, prefilling each once.

    import relay_hf

    pipe = relay_hf.pipeline("text-generation", model="HuggingFaceTB/SmolLM2-135M-Instruct",
                             system_prompt="You are ...")
    pipe(["question 1", "question 2", ...], batch_size=8, max_new_tokens=64)
    pipe(["question 3", "question 4"], system_prompt=["You are A ...", "You are B ..."])  # one per input

``relay_hf.pipeline`` takes what ``transformers.pipeline`` takes (a loaded model or a Hub id / local path, ``dtype``,
``device``, ``device_map``, ``model_kwargs`` such as ``{"gguf_file": ...}``, ...). The task is also registered with
transformers as ``"relay-text-generation"`` when ``relay_hf`` is imported, so after ``import relay_hf``
``transformers.pipeline("relay-text-generation", model=..., system_prompt=...)`` builds the same pipeline.

Inputs: whatever ``TextGenerationPipeline`` takes (one string or chat, lists of them, generators, ``KeyDataset`` or
any torch ``Dataset``). Every item gets a system prompt in preprocessing: a user string becomes ``[system, user]``, a
chat without a system message gets it in front, a chat with its own system message keeps it. The system prompt is
``system_prompt`` (set when the pipeline is built, or per call), or per input: a call's ``system_prompt=`` may be a
list as long as a list of inputs (``None`` entries: no system prompt). Outputs are what stock
``TextGenerationPipeline`` returns for those conversations.

Each system prompt's shared prefix is the longest common token prefix of conversations rendered under it with the
chat template (a template may put per-turn tokens right after the system text). It is prefilled once into a
``RelayCache`` the first time a batch uses it, and kept, least recently used first out, while the kept prefixes fit
in ``prefix_cache_bytes``; a batch under several system prompts gets one cache holding each of its prompts once
(``RelayCache.combine``). A batch with a row under no system prompt runs without them: patched ``generate`` then finds
what its rows share itself, or runs stock.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import types
import weakref

import torch
from transformers import AutoModelForCausalLM, TextGenerationPipeline
from transformers import pipeline as hf_pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from ._compat import cache_kwarg_name, chat_messages, pipeline_chat
from .cache import RelayCache
from .cache_check import cache_grouping, rows_matched
from .kept import kept_caches, prefix_store
from .patch import hold_patch
from .pinning import chat_prefix_ids
from .policy import CACHE_NAMES, keep_reason
from .prefix import Grouping, PrefixTree, left_padding
from .state import relay_state
from .store import PrefixKey, PrefixStore, checked_budget

TASK = "relay-text-generation"
# two user turns that differ from their first character, to find where the rendered conversations diverge
_SYSTEM = "relay_system_prompt"  # the key under which preprocessing hands a row's system prompt to _forward
_NO_SYSTEM = object()  # a call-time system_prompt that was not given


class RelayTextGenerationPipeline(TextGenerationPipeline):
    """``TextGenerationPipeline`` whose system prompts' KV is computed once and shared by every row under them.

    Args:
        system_prompt: the system message of every input that brings none (``None``: none).
        prefix_cache_bytes: sets the budget of the model's prefix store (``patch(model, prefix_cache_bytes=...)``),
            which keeps the system prompts between calls, least recently used dropped first; a batch's own prompts are
            kept while it runs, even past the budget. ``None``: the model's budget as it is.

    What it does to the objects you pass:

    * tokenizer: never changed. Batched generation needs left padding and a pad token; a tokenizer that pads on the
      right or has no pad token is copied (``pipe.tokenizer`` is then the copy: left padding, pad = eos).
    * model: patched with ``relay_hf.patch`` if it is not patched yet, for as long as the pipeline lives. The patch
      is undone by ``pipe.close()``, on leaving ``with relay_hf.pipeline(...) as pipe:``, or when the pipeline is
      garbage-collected, once no other pipeline built on the same model still uses it. A model you patched yourself
      stays patched. (A patched model's ``generate`` returns what stock returns; the patch changes the model's
      attention implementation name to ``"relay"``.) As with any pipeline, ``device=`` moves the model.

    The ``RelayCache`` of a system prompt is built lazily, once, under a lock (concurrent calls from several threads
    share one prefill), and never for a model relay cannot serve now (``relay_hf.policy.keep_reason``: not patched,
    declined, in training mode): such a model runs stock ``generate`` with the system prompt in every row. Kept
    prompts live in a ``relay_hf.store.PrefixStore`` keyed by their tokens and by what their KV depends on: after the
    weights change (a training step, ``load_state_dict``), ``model.to(...)``, a switch of training mode or adapters,
    the next call prefills again instead of reading KV of the model as it was.
    """

    def __init__(self, model, tokenizer=None, *args, system_prompt: str | None = None,
                 prefix_cache_bytes: int | None = None, **kwargs):
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError("a pipeline's system_prompt is one string (a list per input goes with the call)")
        if prefix_cache_bytes is not None:  # refused before the model is touched
            checked_budget(prefix_cache_bytes)
        super().__init__(model, _left_padding_tokenizer(tokenizer), *args, **kwargs)
        self._system_prompt = system_prompt
        self._lock = threading.RLock()
        release = hold_patch(self.model)
        if prefix_cache_bytes is not None and self._store is not None:
            self._store.resize(prefix_cache_bytes)
        self._finalizer = weakref.finalize(self, release) if release is not None else None
        if self._finalizer is not None:
            self._finalizer.atexit = False  # at interpreter exit nothing needs restoring

    @property
    def system_prompt(self) -> str | None:
        return self._system_prompt

    @system_prompt.setter
    def system_prompt(self, value: str | None) -> None:
        if value is not None and not isinstance(value, str):
            raise ValueError("a pipeline's system_prompt is one string (a list per input goes with the call)")
        self._system_prompt = value

    @property
    def _store(self) -> PrefixStore | None:
        """The model's prefix store (``patch(model, prefix_cache_bytes=...)``), which ``generate`` keeps its
        prefixes in too; ``None`` once the model is not patched."""
        state = relay_state(self.model)
        return None if state is None else state.store

    @property
    def prefix_cache_bytes(self) -> int:
        """Bytes of prefilled prefixes the model keeps between calls, this pipeline's and its ``generate``'s
        (validated, and the store trimmed, when set)."""
        return 0 if self._store is None else self._store.budget_bytes

    @prefix_cache_bytes.setter
    def prefix_cache_bytes(self, value: int) -> None:
        store = self._store
        if store is None:
            checked_budget(value)  # refused even with no store to take it
        else:
            store.resize(value)

    def close(self) -> None:
        """Drop the prefilled system prompts and let go of the patch this pipeline applied (see the class docstring);
        once the patch is undone, calls run stock ``generate``."""
        with self._lock:
            if self._store is not None and self._finalizer is not None:  # the patch is this pipeline's
                self._store.clear()
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> RelayTextGenerationPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inputs ----------------------------------------------------------------------------------------------------
    def __call__(self, text_inputs, *args, system_prompt=_NO_SYSTEM, **kwargs):
        """Stock's call; ``system_prompt``: one string for every input of this call, or a list as long as a list of
        inputs (one per input, ``None`` for none)."""
        if system_prompt is not _NO_SYSTEM:
            text_inputs = _with_call_prompt(text_inputs, system_prompt)
        return super().__call__(text_inputs, *args, **kwargs)

    def _with_system(self, item) -> tuple[object, str | None]:
        """``item`` as the conversation to render (a chat that starts with a system message, unless it has no
        system prompt, or ``item`` as it is when it is no text) and that system message's content."""
        system_prompt = self._system_prompt
        if isinstance(item, _Item):
            item, system_prompt = item.value, item.system_prompt
        messages = chat_messages(item)
        if messages is not None and messages[0]["role"] == "system":
            content = messages[0]["content"]
            return pipeline_chat(messages), content if isinstance(content, str) else None
        if system_prompt is None:
            return item, None
        system = {"role": "system", "content": system_prompt}
        if isinstance(item, str):
            return pipeline_chat([system, {"role": "user", "content": item}]), system_prompt
        # a plain list of messages reaches here when the batch mixes strings and chats (transformers wraps only
        # all-chat batches as chats)
        if messages is None:
            return item, None
        return pipeline_chat([system, *messages]), system_prompt

    def preprocess(self, prompt_text, *args, **kwargs):
        """Per item (lists, generators and datasets alike): the system prompt first, then stock preprocessing; the
        system prompt travels with the item to ``_forward``."""
        item, system_prompt = self._with_system(prompt_text)
        out = super().preprocess(item, *args, **kwargs)
        out[_SYSTEM] = system_prompt
        return out

    # -- the shared prefixes ---------------------------------------------------------------------------------------
    def prefix_ids(self, system_prompt: str | None = None) -> torch.Tensor | None:
        """``[P]`` int64 tokens every conversation under ``system_prompt`` (default: the pipeline's) starts with, or
        ``None``."""
        system_prompt = self._system_prompt if system_prompt is None else system_prompt
        if system_prompt is None:
            return None
        return chat_prefix_ids(self.tokenizer, system_prompt)

    def prefix_cache(self, system_prompt: str | None = None) -> RelayCache | None:
        """The ``RelayCache`` of ``system_prompt`` (default: the pipeline's), prefilled on first use and kept;
        ``None`` without a system prompt, or when relay cannot serve the model (then no cache is built at all)."""
        system_prompt = self._system_prompt if system_prompt is None else system_prompt
        return self._caches_for([system_prompt])[0][0] if system_prompt is not None else None

    def _caches_for(self, system_prompts) -> tuple[list[RelayCache | None], list[PrefixKey]]:
        """One ``RelayCache`` per system prompt (``_system_caches``) and their store keys."""
        with self._lock:
            return _system_caches(self.model, [self.prefix_ids(p) for p in system_prompts])

    def kept_system_prompts(self) -> int:
        """How many prefilled prefixes the model keeps now (this pipeline's system prompts, and what its
        ``generate`` keeps)."""
        return 0 if self._store is None else len(self._store)

    def _forward(self, model_inputs, **generate_kwargs):
        system_prompts = model_inputs.pop(_SYSTEM, None)
        if not isinstance(system_prompts, list):  # batch size 1: the item's own value
            system_prompts = [system_prompts]
        ids, mask = model_inputs["input_ids"], model_inputs.get("attention_mask")
        used, matched = [], contextlib.nullcontext()
        if (ids.shape[1] > 0 and None not in system_prompts
                and not any(generate_kwargs.get(name) is not None for name in CACHE_NAMES)):
            distinct = list(dict.fromkeys(system_prompts))
            caches, used = self._caches_for(distinct)
            if all(c is not None for c in caches):
                # one cache holding them all (a job whose batches mix the same few prompts packs them once)
                cache = caches[0] if len(caches) == 1 else packed_cache(self._store, used, caches)
                n_pad = left_padding(mask if mask is not None else torch.ones_like(ids))
                grouping = None if n_pad is None else _grouping(cache, ids, n_pad)
                if grouping is not None:  # generate takes this match of the rows instead of matching them again
                    generate_kwargs[cache_kwarg_name(self.model)] = cache
                    matched = rows_matched(cache, ids, n_pad, grouping)
        store = self._store
        # another thread's batch does not evict this one's prompts meanwhile
        held = contextlib.nullcontext() if store is None or not used else store.holding(used)
        with matched, held:
            return super()._forward(model_inputs, **generate_kwargs)


def _system_caches(model, prefixes: list) -> tuple[list[RelayCache | None], list[PrefixKey]]:
    """One ``RelayCache`` per prefix (``[P]`` ids, or ``None``: no prefix, no cache), from the model's prefix store
    (``kept.kept_caches``: taken where kept for the model as it is now, else prefilled and kept; the store trimmed
    after). ``None`` for every prefix when none may be kept now (``policy.keep_reason``). Also returns their store
    keys, for the call to hold while it runs."""
    if keep_reason(model) is not None:
        return [None for _ in prefixes], []
    store, depends = prefix_store(model)
    caches, keys = kept_caches(model, [PrefixTree.from_prefixes([ids]) for ids in prefixes if ids is not None], store,
                               depends)
    built = iter(caches)
    return [None if ids is None else next(built) for ids in prefixes], keys


def packed_cache(store: PrefixStore | None, keys: list[tuple], caches: list[RelayCache]) -> RelayCache:
    """The system prompts of one batch packed into one cache (``RelayCache.combine``), kept while its prompts are
    (``store.packed``): a job whose batches mix the same few prompts packs them once."""
    packed = None if store is None else store.packed(keys, lambda _: RelayCache.combine(caches))
    return RelayCache.combine(caches) if packed is None else packed


def _with_call_prompt(text_inputs, system_prompt):
    """``text_inputs`` in the same form (a list, one item, a dataset, a generator) with a call's ``system_prompt`` (one
    string or ``None`` for every input, or a list of them, one per input of a list) carried by each item (``_Item``);
    ``ValueError`` for a prompt that does not fit the inputs."""
    if isinstance(system_prompt, (list, tuple)):
        if not isinstance(text_inputs, (list, tuple)) or _is_chat(text_inputs):
            raise ValueError("a list of system prompts needs a list of inputs, one prompt per input")
        if len(system_prompt) != len(text_inputs):
            raise ValueError(f"{len(system_prompt)} system prompts for {len(text_inputs)} inputs")
        return [_Item(x, s, i) for i, (x, s) in enumerate(zip(text_inputs, system_prompt))]
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"system_prompt must be a string, a list of them or None, got "
                         f"{type(system_prompt).__name__}")
    if isinstance(text_inputs, (list, tuple)) and not _is_chat(text_inputs):
        return [_Item(x, system_prompt, i) for i, x in enumerate(text_inputs)]
    if isinstance(text_inputs, str) or _is_chat(text_inputs):
        return _Item(text_inputs, system_prompt, 0)
    if isinstance(text_inputs, torch.utils.data.Dataset) and hasattr(text_inputs, "__getitem__") and hasattr(
            text_inputs, "__len__"):  # a map-style dataset (KeyDataset...): stays a dataset, streamed lazily
        return _ItemDataset(text_inputs, system_prompt)
    if isinstance(text_inputs, (types.GeneratorType, torch.utils.data.IterableDataset)):
        return (_Item(x, system_prompt, i) for i, x in enumerate(text_inputs))
    raise ValueError(f"a call's system_prompt goes with a string, a chat, a list of them, a generator or a "
                     f"dataset, not a {type(text_inputs).__name__}")


class _ItemDataset(torch.utils.data.Dataset):
    """A map-style dataset whose items carry one system prompt (a call's ``system_prompt=`` over a dataset): still a
    dataset, so the pipeline streams it lazily, with its ``num_workers``."""

    def __init__(self, dataset, system_prompt: str | None):
        self.dataset, self.system_prompt = dataset, system_prompt

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return _Item(self.dataset[i], self.system_prompt, i)


class _Item:
    """An input with the system prompt its call gave it (a call's ``system_prompt=``), on its way to
    ``preprocess``."""

    __slots__ = ("value", "system_prompt", "index")

    def __init__(self, value, system_prompt: str | None, index: int):
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system prompt {index} must be a string or None, got {type(system_prompt).__name__}")
        messages = chat_messages(value)
        if (system_prompt is not None and messages and messages[0]["role"] == "system"
                and messages[0]["content"] != system_prompt):
            raise ValueError(f"input {index} is a chat with its own system message and was given another system "
                             "prompt")
        self.value, self.system_prompt, self.index = value, system_prompt, index


def _is_chat(value) -> bool:
    """A list of message dicts (one conversation), as opposed to a list of inputs."""
    return chat_messages(value) is not None


def _grouping(cache: RelayCache, ids: torch.Tensor, n_pad: torch.Tensor) -> Grouping | None:
    """Each row's path in ``cache``'s prefixes (``cache_check.cache_grouping``), or ``None`` when a row starts with
    none of them (with a token after it): the batch then runs without the cache."""
    try:
        return cache_grouping(cache, ids, n_pad)
    except (ValueError, AttributeError):
        return None


def _left_padding_tokenizer(tokenizer):
    """``tokenizer`` if it pads on the left with a pad token, else a copy that does (the caller's stays as it is)."""
    if tokenizer is None or (tokenizer.padding_side == "left" and tokenizer.pad_token is not None):
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side = "left"  # decoder-only batches must be left-padded
    if tokenizer.pad_token is None:  # what transformers suggests for batching without one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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
