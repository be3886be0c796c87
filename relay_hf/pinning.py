"""``relay_hf.pin`` / ``relay_hf.unpin``: a system prompt's KV kept in a patched model's prefix store whatever
least-recently-used eviction would drop.

A service under a few long system prompts wants them never prefilled again, however many other prompts pass through
the store. A pinned prompt is an ordinary kept prefix (``store.PrefixStore``) the store never evicts for its budget:
its bytes count against ``prefix_cache_bytes``, and it goes only by ``unpin``, ``clear_prefixes`` or a change of the
model that makes it stale (then the next call that reads it prefills it again, pinned as before). Every road that
reads kept prefixes reads it: a one-row chat turn that starts with it, a batch whose rows start with it
(``prefix.split_at_pinned``), the pipeline's ``system_prompt`` (a text prompt is tokenized as the pipeline does:
``chat_prefix_ids``).
"""

from __future__ import annotations

import torch

from .cache import RelayCache
from .kept import prefix_store
from .patch import is_patched
from .policy import keep_reason
from .prefill import segment_key
from .prefix import PrefixTree
from .state import relay_state

_PROBES = ("A", "7")  # two user turns a chat template renders after the system prompt: their common part is its own


def chat_prefix_ids(tokenizer, system_prompt: str) -> torch.Tensor | None:
    """``[P]`` int64 tokens every chat under ``system_prompt`` starts with (the tokenizer's chat template): the part
    of the rendered chat (the system message, then a user turn) that does not depend on the user turn; ``None`` when
    there is none. What the pipeline's ``system_prompt`` prefills."""
    rendered = [torch.as_tensor(tokenizer.apply_chat_template(
        [{"role": "system", "content": system_prompt}, {"role": "user", "content": probe}],
        tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]).flatten() for probe in _PROBES]
    n = min(len(r) for r in rendered)
    differs = (rendered[0][:n] != rendered[1][:n]).nonzero()
    P = int(differs[0]) if differs.numel() else n
    return rendered[0][:P].to(torch.int64) if P > 0 else None


def prompt_ids(prompt, tokenizer=None) -> torch.Tensor:
    """A prompt as ``[P]`` int64 token ids on the CPU: a text with its ``tokenizer`` (with a chat template,
    ``chat_prefix_ids``: as the pipeline's ``system_prompt``; without one, the text's tokens as the tokenizer encodes
    it), or ids (a list, a ``[P]`` or ``[1, P]`` integer tensor). ``ValueError`` naming what is wrong."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt is pinned with its tokenizer: relay_hf.pin(model, text, tokenizer=...)")
        if getattr(tokenizer, "chat_template", None) is None:
            ids = torch.as_tensor(tokenizer(prompt)["input_ids"], dtype=torch.int64).flatten()
        else:
            ids = chat_prefix_ids(tokenizer, prompt)
    else:
        ids = torch.as_tensor(prompt)
        if ids.numel() == 0:
            raise ValueError("the prompt to pin has no tokens")
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"a prompt to pin is a text or [P] integer token ids, got a {ids.dtype} tensor of shape "
                             f"{tuple(ids.shape)}")
        ids = ids.to("cpu", torch.int64)
    if ids is None or ids.numel() == 0:
        raise ValueError("the prompt to pin has no tokens")
    return ids


def _store_of(model, what: str):
    if not is_patched(model):
        raise ValueError(f"relay_hf.{what} takes a model patched by relay_hf.patch")
    return relay_state(model).store


def pin(model, prompt, tokenizer=None) -> int:
    """Keep ``prompt``'s KV in ``model``'s prefix store until ``unpin`` (or ``clear_prefixes``), prefilling it now
    unless it is kept already. Returns the prompt's tokens.

    Args:
        model: a model patched by ``relay_hf.patch`` with a prefix store (``prefix_cache_bytes`` not 0).
        prompt: a text (with ``tokenizer``: the tokens every chat under it starts with, as the pipeline's
            ``system_prompt``), or token ids (``[P]`` list or tensor): what later rows start with.

    Raises ``ValueError`` when the model is not patched, keeps no prefixes (``prefix_cache_bytes=0``, training mode,
    ...), the prompt is empty or longer than the model's positions, or the pinned prompts would not fit
    ``prefix_cache_bytes``.
    """
    _store_of(model, "pin")
    ids = prompt_ids(prompt, tokenizer)
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and ids.numel() >= limit:
        raise ValueError(f"the prompt to pin has {ids.numel()} tokens; the model has {limit} positions")
    store, depends = prefix_store(model)  # (None, None) when nothing may be kept now
    if store is None:
        raise ValueError(f"relay_hf.pin keeps KV in the model's prefix store, which keeps nothing now: "
                         f"{keep_reason(model) or 'relay_hf.patch(model, prefix_cache_bytes=0)'}")
    tree = PrefixTree((ids,), (-1,))
    key = segment_key(tree, 0)
    with torch.no_grad(), store.holding([key]):
        RelayCache.from_tree(model, tree, store, depends)
        store.pin(key)
    return ids.numel()


def unpin(model, prompt, tokenizer=None) -> bool:
    """Let ``prompt`` (as ``pin`` took it) be evicted again, least recently used first; whether it was pinned."""
    store = _store_of(model, "unpin")
    ids = prompt_ids(prompt, tokenizer)
    return store.unpin(segment_key(PrefixTree((ids,), (-1,)), 0))


def pinned_prompts(model) -> list[torch.Tensor]:
    """The token ids of ``model``'s pinned prompts (``[P]`` int64 each), as ``pin`` keyed them."""
    return [key.ids() for key in _store_of(model, "pinned_prompts").pinned() if not key.start]


__all__ = ["chat_prefix_ids", "pin", "pinned_prompts", "prompt_ids", "unpin"]
