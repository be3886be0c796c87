"""A text-generation pipeline that serves many questions under one system prompt, prefilling it once.

    pipe = relay_hf.pipeline("text-generation", model=model, tokenizer=tokenizer, system_prompt="You are ...")
    pipe(["question 1", "question 2", ...], batch_size=8, max_new_tokens=64)

also reachable as ``transformers.pipeline("relay-text-generation", ..., system_prompt=...)``.

Inputs: user strings (each becomes ``[system, user]``), chats without a system message (the system prompt is put in
front), or chats with their own system message (left as they are). Outputs are what stock
``TextGenerationPipeline`` returns for the same conversations.

The shared prefix is the longest common token prefix of conversations rendered with the chat template (a template may
put per-turn tokens right after the system text). It is prefilled once into a ``RelayCache`` on first use and reused
by every call and batch until ``system_prompt`` changes. A batch whose rows do not all start with it (a chat carrying
another system message) runs without it: patched ``generate`` then finds its own shared prefix, or runs stock.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, TextGenerationPipeline
from transformers import pipeline as hf_pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from ._compat import cache_kwarg_name
from .cache import RelayCache
from .patch import is_patched, patch
from .prefix import common_prefix_length, first_mismatch, left_padding

TASK = "relay-text-generation"
# two user turns that differ from their first character, to find where the rendered conversations diverge
_PROBES = ("A", "7")


class RelayTextGenerationPipeline(TextGenerationPipeline):
    """``TextGenerationPipeline`` with a ``system_prompt`` whose KV is computed once and shared by every row."""

    def __init__(self, *args, system_prompt: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tokenizer.padding_side = "left"  # decoder-only batches must be left-padded
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if not is_patched(self.model):
            patch(self.model)
        self._system_prompt = system_prompt
        self._cache: RelayCache | None = None

    @property
    def system_prompt(self) -> str | None:
        return self._system_prompt

    @system_prompt.setter
    def system_prompt(self, value: str | None) -> None:
        if value != self._system_prompt:
            self._system_prompt, self._cache = value, None

    # -- inputs ----------------------------------------------------------------------------------------------------
    def _with_system(self, item):
        if self._system_prompt is None:
            return item
        system = {"role": "system", "content": self._system_prompt}
        if isinstance(item, str):
            return [system, {"role": "user", "content": item}]
        if isinstance(item, (list, tuple)) and item and isinstance(item[0], dict):
            return list(item) if item[0].get("role") == "system" else [system, *item]
        return item

    def __call__(self, text_inputs, **kwargs):
        if isinstance(text_inputs, str) or (isinstance(text_inputs, (list, tuple)) and text_inputs
                                            and isinstance(text_inputs[0], dict)):
            return super().__call__(self._with_system(text_inputs), **kwargs)
        if isinstance(text_inputs, (list, tuple)):
            return super().__call__([self._with_system(item) for item in text_inputs], **kwargs)
        return super().__call__(text_inputs, **kwargs)

    # -- the shared prefix -----------------------------------------------------------------------------------------
    def prefix_ids(self) -> torch.Tensor | None:
        """``[P]`` tokens every conversation under ``system_prompt`` starts with, or ``None``."""
        if self._system_prompt is None:
            return None
        rendered = [self.tokenizer.apply_chat_template(
            [{"role": "system", "content": self._system_prompt}, {"role": "user", "content": probe}],
            tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"] for probe in _PROBES]
        rows = [torch.as_tensor(r).flatten() for r in rendered]
        T = max(len(r) for r in rows)
        ids = torch.stack([torch.nn.functional.pad(r, (T - len(r), 0)) for r in rows])  # left-padded
        P = common_prefix_length(ids, torch.tensor([T - len(r) for r in rows]))
        return rows[0][:P] if P > 0 else None

    def prefix_cache(self) -> RelayCache | None:
        """The ``RelayCache`` of the system prompt, prefilled on first use."""
        if self._cache is None and (ids := self.prefix_ids()) is not None:
            self._cache = RelayCache.from_prefix(self.model, ids)
        return self._cache

    def _forward(self, model_inputs, **generate_kwargs):
        cache = self.prefix_cache()
        ids, mask = model_inputs["input_ids"], model_inputs.get("attention_mask")
        if cache is not None and ids.shape[1] > 0:
            n_pad = left_padding(mask if mask is not None else torch.ones_like(ids))
            if n_pad is not None and first_mismatch(ids, n_pad, cache.prefix_ids) is None:
                generate_kwargs[cache_kwarg_name(self.model)] = cache
        return super()._forward(model_inputs, **generate_kwargs)


def pipeline(task: str = "text-generation", model=None, tokenizer=None, *, system_prompt: str | None = None,
             **kwargs) -> RelayTextGenerationPipeline:
    """Build a ``RelayTextGenerationPipeline`` (``task`` is ``"text-generation"`` or ``"relay-text-generation"``).

    ``model`` must be a loaded causal LM instance (it is patched in place); everything else is passed to
    ``transformers.pipeline``.
    """
    if task not in ("text-generation", TASK):
        raise ValueError(f"relay_hf.pipeline serves text generation, not {task!r}")
    if model is None or isinstance(model, str):
        raise ValueError("pass a loaded model instance: relay_hf patches that instance")
    return hf_pipeline(TASK, model=model, tokenizer=tokenizer, system_prompt=system_prompt, **kwargs)


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=RelayTextGenerationPipeline, pt_model=AutoModelForCausalLM)
