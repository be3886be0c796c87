"""The ``generate`` that ``relay_hf.patch`` installs on one model instance.

Per call: ``policy.decide`` plans relay or stock. Stock runs the class's own ``generate`` with the caller's arguments
(a ``RelayCache`` argument removed, so stock never sees a cache in a layout it cannot use). Relay:

1. prefills the shared prefix once at batch 1 into a ``RelayCache`` (or forks the caller's, which is never mutated),
2. permutes each row to ``[prefix | pads | suffix]`` (``prefix.py``) and runs stock ``generate`` on that, so only the
   suffixes are prefilled and every decode step reads the prefix once per batch; user processors, criteria and
   streamers see the stock layout,
3. or runs relay_hf's own decode loop on a static cache (``decode.py``; the default on CUDA),
4. hands back ``sequences`` in the stock layout, with the ``RelayCache`` as the returned cache.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import types

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.streamers import BaseStreamer

from ._compat import cache_kwarg_name
from .cache import RelayCache
from .decode import fast_generate
from .policy import CACHE_NAMES, Plan, RelayDecision, decide
from .prefix import inverse_permutation, relay_permutation, to_stock_layout
from .state import StaticSlot

logger = logging.getLogger("relay_hf")

_warned: set[str] = set()
_warned_lock = threading.Lock()


class RelayFallbackWarning(UserWarning):
    """A model that relay cannot serve exactly runs on stock attention instead."""


class _StockView:
    """Shows a user's stopping criterion the ids in stock layout."""

    def __init__(self, inner, inv: torch.Tensor):
        self.inner, self.inv = inner, inv

    def __call__(self, input_ids, scores, **kwargs):
        return self.inner(to_stock_layout(input_ids, self.inv), scores, **kwargs)


class _ProcessorView(_StockView):
    """The same for a logits processor: ``LogitsProcessorList`` inspects the signature, so exactly two arguments."""

    def __call__(self, input_ids, scores):
        return self.inner(to_stock_layout(input_ids, self.inv), scores)


class _StreamerView(BaseStreamer):
    """Forwards to the user's streamer, showing it the prompt in stock layout."""

    def __init__(self, inner, inv: torch.Tensor):
        self.inner, self.inv, self.first = inner, inv.cpu(), True

    def put(self, value):
        if self.first and value.dim() == 2 and value.shape[1] == self.inv.shape[1]:
            value = to_stock_layout(value, self.inv)
        self.first = False
        self.inner.put(value)

    def end(self):
        self.inner.end()


def _bind(model, args, kwargs) -> dict:
    """Flatten ``generate(*args, **kwargs)`` into ``{name: value}`` using the installed stock signature."""
    sig = inspect.signature(type(model).generate)
    bound = sig.bind_partial(model, *args, **kwargs).arguments
    bound.pop(next(iter(sig.parameters)))  # self
    for name, p in sig.parameters.items():
        if p.kind is p.VAR_KEYWORD:
            bound.update(bound.pop(name, {}))
    return bound


def _warn_fallback(plan: Plan) -> None:
    """Once per reason: a call that would have gained from relay runs stock."""
    key = re.sub(r"\d+", "N", plan.reason)  # one warning per kind of reason, whatever the sizes
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning("relay_hf: this call runs stock generate: %s", plan.reason)


def _wrap_user_hooks(call: dict, inv: torch.Tensor, plan: Plan) -> None:
    """Let user processors, criteria and streamers (and stop strings) see stock-layout ids."""
    if plan.gen.stop_strings is not None:  # its criterion reads the prompt's tail: built here, on the stock view
        stop = StopStringCriteria(tokenizer=call["tokenizer"], stop_strings=plan.gen.stop_strings)
        call["stopping_criteria"] = [*(call.get("stopping_criteria") or []), stop]
        call["stop_strings"] = None
    if call.get("logits_processor"):
        call["logits_processor"] = LogitsProcessorList(_ProcessorView(p, inv) for p in call["logits_processor"])
    if call.get("stopping_criteria"):
        call["stopping_criteria"] = StoppingCriteriaList(_StockView(c, inv) for c in call["stopping_criteria"])
    if call.get("streamer") is not None:
        call["streamer"] = _StreamerView(call["streamer"], inv)


def _static_slot(model, base: RelayCache, plan: Plan, pads: torch.Tensor) -> StaticSlot:
    """A static fork of ``base`` for this call (``pads [R]``: each row's left padding): an idle one of the model's
    refilled in place when its shapes fit (as transformers keeps its StaticCache, so captured graphs are not
    re-recorded), else a new one of ``plan.static_rows`` rows. relay_hf's loop takes a slot of up to twice its bucket's
    rows and suffix capacity (the extra rows copy row 0); transformers' loop needs the exact shapes."""
    cap, rows = plan.static_capacity, plan.static_rows
    fits = ((lambda c: c.can_refill(base, rows, cap, max_rows=2 * rows)) if plan.fast_decode else
            (lambda c: c.can_refill(base, rows, cap) and c.layers[0].max_suffix_length == cap))
    slot = model._relay_state.take_static(fits)
    if slot is None:
        slot = StaticSlot(base.fork(max_suffix_length=cap, suffix_padding=_extend(pads, rows)))
    else:
        slot.cache.refill(base, _extend(pads, slot.cache.layers[0].keys.shape[0]).to(base.prefix_device))
    return slot


def _extend(pads: torch.Tensor, rows: int) -> torch.Tensor:
    """``pads [R]`` for ``rows >= R`` rows: the extra rows copy row 0."""
    return torch.cat([pads, pads[:1].expand(rows - pads.shape[0])])


def _run_relay(model, stock, call: dict, plan: Plan):
    ids, mask, n_pad, P, T = plan.ids, plan.mask, plan.n_pad, plan.prefix_length, plan.ids.shape[1]
    perm = relay_permutation(n_pad, P, T)
    inv = inverse_permutation(perm)
    base = plan.user_cache
    if base is None:
        base = RelayCache.from_prefix(model, ids[0, int(n_pad[0]):int(n_pad[0]) + P])
    per_input = plan.rows // ids.shape[0]  # beams / return sequences
    pads = n_pad.to(torch.int32).repeat_interleave(per_input)  # [R]
    slot = _static_slot(model, base, plan, pads) if plan.static else None
    if slot is None:
        cache = base.fork(suffix_padding=pads)
        cache.reserve(T + plan.new_tokens - P)  # suffix buffers sized once: prompt after the prefix + new tokens
    else:
        cache = slot.cache
    relay_ids, relay_mask = ids.gather(1, perm), mask.gather(1, perm)  # [B, T] in relay layout
    try:
        if plan.fast_decode:
            streamer = call.get("streamer")
            stop = None
            if plan.gen.stop_strings is not None:  # stock's criterion; the loop shows it stock-layout ids
                stop = StopStringCriteria(tokenizer=call["tokenizer"], stop_strings=plan.gen.stop_strings)
            with torch.no_grad():
                out = fast_generate(model, relay_ids, relay_mask, ids, slot, plan.sampler,
                                    None if streamer is None else _StreamerView(streamer, inv), plan.compile_config,
                                    plan.new_tokens, rows_per_input=per_input, stop=stop)
            return to_stock_layout(out, inv)
        call = {k: v for k, v in call.items() if k not in ("inputs", "input_ids", *CACHE_NAMES)}
        if plan.gen.cache_implementation is not None:  # from the call, its config or the model's: ours is the cache
            call["cache_implementation"] = None
        call["attention_mask"] = relay_mask
        call[cache_kwarg_name(model)] = cache
        _wrap_user_hooks(call, inv, plan)
        out = stock(relay_ids, **call)
    finally:
        if slot is not None:
            model._relay_state.give_back_static(slot)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    sequences = to_stock_layout(sequences, inv)
    if isinstance(out, torch.Tensor):
        return sequences
    out.sequences = sequences
    return out


def relay_generate(model, *args, **kwargs):
    """The patched ``generate``: same arguments and outputs as stock, relay attention when rows share a prefix."""
    stock = types.MethodType(type(model).generate, model)
    call = _bind(model, args, kwargs)
    try:
        plan = decide(model, call)
    except ValueError as err:
        model.relay_last_decision = RelayDecision(False, f"invalid input: {err}")
        raise
    model.relay_last_decision = plan.decision()
    if not plan.relay:
        logger.debug("relay_hf: stock generate (%s)", plan.reason)
        if not plan.expected:
            _warn_fallback(plan)
        kwargs = {k: v for k, v in kwargs.items() if not (k in CACHE_NAMES and isinstance(v, RelayCache))}
        return stock(*args, **kwargs)
    logger.debug("relay_hf: relay generate, prefix %d tokens, %d rows", plan.prefix_length, plan.rows)
    try:
        return _run_relay(model, stock, call, plan)
    except BaseException as err:
        model.relay_last_decision = RelayDecision(False, f"relay run failed: {type(err).__name__}: {err}",
                                                  plan.prefix_length, plan.rows, plan.static)
        raise


class RelayGenerate:
    """The ``generate`` of one patched model instance. A callable object rather than a bound function, so that a
    pickled, ``torch.save``d or deep-copied patched model comes back patched."""

    def __init__(self, model):
        self.__self__ = model

    def __call__(self, *args, **kwargs):
        return relay_generate(self.__self__, *args, **kwargs)

    def __reduce__(self):
        return RelayGenerate, (self.__self__,)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(type(self.__self__).generate, self.__self__))
