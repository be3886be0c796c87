"""The ``generate`` that ``relay_hf.patch`` installs on one model instance.

Per call: ``policy.decide`` routes it to relay or stock. Stock runs the class's own ``generate`` with the caller's
arguments (a ``RelayCache`` argument removed, so stock never sees a cache in a layout it cannot use). Relay:

1. prefills each shared prefix once at batch 1 into a ``RelayCache``, or takes it from the model's prefix store
   (``kept.py``; on relay_hf's loop a kept segment's check is read, and the model walked, only once the call's own
   prefill is launched: a call whose check failed runs again as one read at once would, and one whose model changed
   since its latest walk is decided again: ``_run_kept``), or forks the caller's cache (never mutated),
2. lays each row out as ``[its prefix | masked | its suffix]`` (``prefix.RowLayout``) and runs stock ``generate`` on
   that, so only the suffixes are prefilled and every decode step reads each prefix once per batch; user processors,
   criteria and streamers see the stock layout,
3. or runs relay_hf's own decode loop on a static cache (``decode.py``; the default on CUDA),
4. hands back ``sequences`` in the stock layout, with the ``RelayCache`` as the returned cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import re
import threading
import types

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.streamers import BaseStreamer

from ._compat import cache_kwarg_name, output_cache
from .cache import RelayCache
from .check_row import CheckRow
from .decode import fast_generate
from .kept import count_kept, join_checks, kept_caches, launch_checks, tree_keys
from .policy import CACHE_NAMES, NOT_PATCHED, RelayDecision, Route, RouteChanged, confirm_walk, decide
from .prefix import RowLayout, relay_layout
from .sampling import loop_sampler
from .state import StaticSlot, relay_state
from .stats import attention_windows, decode_bytes_not_reread, layer_kv_bytes
from .store import StaleKept

logger = logging.getLogger("relay_hf")

_warned: set[str] = set()
_warned_lock = threading.Lock()


class RelayFallbackWarning(UserWarning):
    """A model that relay cannot serve exactly runs on stock attention instead."""


class _StockView:
    """Shows a user's stopping criterion the ids in stock layout."""

    def __init__(self, inner, layout: RowLayout):
        self.inner, self.layout = inner, layout

    def __call__(self, input_ids, scores, **kwargs):
        return self.inner(self.layout.to_stock(input_ids), scores, **kwargs)


class _ProcessorView(_StockView):
    """The same for a logits processor: ``LogitsProcessorList`` inspects the signature, so exactly two arguments."""

    def __call__(self, input_ids, scores):
        return self.inner(self.layout.to_stock(input_ids), scores)


class _StreamerView(BaseStreamer):
    """Forwards to the user's streamer, showing it the prompt in stock layout."""

    def __init__(self, inner, layout: RowLayout):
        self.inner, self.layout, self.first = inner, layout, True

    def put(self, value):
        if self.first and value.dim() == 2 and value.shape[1] == self.layout.columns:
            value = self.layout.to_stock(value)
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


def _warn_fallback(route: Route) -> None:
    """Once per reason: a call that would have gained from relay runs stock."""
    key = re.sub(r"\d+", "N", route.reason)  # one warning per kind of reason, whatever the sizes
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning("relay_hf: this call runs stock generate: %s", route.reason)


def _stop_strings(call: dict, route: Route) -> StopStringCriteria | None:
    """Stock's criterion for the call's stop strings, or ``None``. It reads the prompt's tail, so relay builds it
    itself and shows it stock-layout ids (both loops)."""
    if route.gen.stop_strings is None:
        return None
    return StopStringCriteria(tokenizer=call["tokenizer"], stop_strings=route.gen.stop_strings)


def _wrap_user_hooks(call: dict, layout: RowLayout, route: Route) -> None:
    """Let user processors, criteria and streamers (and stop strings) see stock-layout ids."""
    stop = _stop_strings(call, route)
    if stop is not None:
        call["stopping_criteria"] = [*(call.get("stopping_criteria") or []), stop]
        call["stop_strings"] = None
    if call.get("logits_processor"):
        call["logits_processor"] = LogitsProcessorList(_ProcessorView(p, layout) for p in call["logits_processor"])
    if call.get("stopping_criteria"):
        call["stopping_criteria"] = StoppingCriteriaList(_StockView(c, layout) for c in call["stopping_criteria"])
    if call.get("streamer") is not None:
        call["streamer"] = _StreamerView(call["streamer"], layout)


def _lengths_for_layout(call: dict, layout: RowLayout, route: Route) -> None:
    """The relay layout can have more columns than the stock prompt (several prefixes of different lengths): the
    call's total lengths (``max_length``, ``min_length``), which transformers' loop counts from the prompt's columns,
    are restated for it."""
    extra = layout.columns - route.ids.shape[1]
    if not extra:
        return
    call.pop("max_length", None)
    call["max_new_tokens"] = route.new_tokens
    if route.gen.min_new_tokens is None and (route.gen.min_length or 0) > 0:
        call["min_length"] = route.gen.min_length + extra


def _static_slot(model, base: RelayCache, route: Route, pads: torch.Tensor, paths) -> StaticSlot:
    """A static fork of ``base`` for this call (``pads [R]``: each row's left padding; ``paths``: the segments each
    row reads, or ``None`` for one prefix): an idle one of the model's refilled in place when its shapes fit (as
    transformers keeps its StaticCache, so captured graphs are not re-recorded), else a new one of
    ``route.static_rows`` rows. relay_hf's loop takes a slot of up to twice its bucket's rows and suffix capacity (the
    extra rows copy row 0); transformers' loop needs the exact shapes."""
    cap, rows = route.static_capacity, route.static_rows
    fits = ((lambda c: c.can_refill(base, rows, cap, max_rows=2 * rows, paths=paths)) if route.fast_decode else
            (lambda c: c.can_refill(base, rows, cap, paths=paths) and c.layers[0].max_suffix_length == cap))
    state = relay_state(model)
    slot = state.take_static(fits)
    if slot is None:
        slot = StaticSlot(base.fork(max_suffix_length=cap, suffix_padding=_extend(pads, rows),
                                    paths=_extend(paths, rows)), structure=route.structure)
    else:
        if route.deferred_walk and not slot.replayable(route.structure):  # walked before its prefill replays
            try:
                confirm_walk(model, route)
            except RouteChanged:
                state.give_back_static(slot)
                raise
        if route.fast_decode:  # its step and prefills replayed only under the structure they were made under
            slot.made_under(route.structure)
        held = slot.cache.layers[0].keys.shape[0]
        slot.cache.refill(base, _extend(pads, held).to(base.prefix_device), _extend(paths, held))
    return slot


def _extend(rows_values, rows: int):
    """Per-row values (``[R]`` tensor or list; ``None`` stays ``None``) for ``rows >= R`` rows: the extra rows copy
    row 0."""
    if rows_values is None:
        return None
    if isinstance(rows_values, torch.Tensor):
        return torch.cat([rows_values, rows_values[:1].expand(rows - rows_values.shape[0])])
    return list(rows_values) + [rows_values[0]] * (rows - len(rows_values))


def _run_relay(model, stock, call: dict, route: Route, launched: dict):
    grouping = route.grouping
    layout = relay_layout(route.ids, route.mask, route.n_pad, grouping.prefix_lengths(), route.suffix_columns)
    sampler = loop_sampler(model, route.gen, route.ids, route.processors) if route.fast_decode else None
    if route.user_cache is not None:
        return _run_relay_on(model, stock, call, route, layout, route.user_cache, 0, sampler)
    # each shared segment prefilled once, at batch 1, or taken from the model's prefix store (route.depends: the
    # model's structure, read by policy.decide); held while the call runs (no other call evicts them meanwhile), the
    # store back within its budget when it ends
    store = None if route.depends is None else relay_state(model).store
    with contextlib.nullcontext() if store is None else store.holding(tree_keys(grouping.tree)):
        if store is not None and route.fast_decode:
            try:
                return _run_kept(model, stock, call, route, layout, store, sampler, launched)
            except StaleKept:  # what it computed is thrown away; run again as a failed check runs: prefilled
                logger.debug("relay_hf: a kept prefix failed its check after the call took it; running it again")
                launched = {}  # their verdict is known: failed
                route = dataclasses.replace(route, deferred_walk=False)  # (its walk confirmed: ``_run_kept``)
        (base,), _ = kept_caches(model, [grouping.tree], store, route.depends, launched=launched)
        return _run_relay_on(model, stock, call, route, layout, base, base.kept_tokens, sampler)


def _run_kept(model, stock, call: dict, route: Route, layout, store, sampler, launched: dict):
    """The call on relay_hf's loop, its kept segments' checks read only once its own prefill is launched (the
    device runs the check, then the prefill; the host waits once, before the first token is chosen or shown), and
    the model walked then where the route was decided under its latest walk (``policy.confirm_walk``).
    ``StaleKept`` when a check failed: its entry is dropped, the call's work (the pooled static cache's buffers) is
    left to be overwritten, and nothing reached the caller, its counters or its streamer; ``RouteChanged`` the same
    way when the walk found the model changed (the checks' verdicts are then not read: ``PrefixStore.abandon``)."""
    pending, walked = [], []
    # the checks' head run in a spare row of the call's prefill, where the route has one (``check_row.py``)
    row = CheckRow(model, store, route.prefix_length) if route.check_row else None

    def confirm():
        if not walked:
            try:
                confirm_walk(model, route)
            except RouteChanged:
                store.abandon(pending)
                raise
            walked.append(True)

    def settle():
        confirm()  # the walk first: host work while the device runs the check and the prefill
        store.settle(pending)

    try:
        (base,), _ = kept_caches(model, [route.grouping.tree], store, route.depends, pending, launched, row)
        out = _run_relay_on(model, stock, call, route, layout, base, base.kept_tokens, sampler, settle, row)
        settle()  # (read by the loop already)
    except RouteChanged:  # (found by the walk, or by the slot before anything was launched)
        store.abandon(pending)
        raise
    except StaleKept:
        confirm()  # a route decided under a stale walk is decided again, not only prefilled again
        raise
    except Exception:
        settle()  # the failure may be the change's (RouteChanged) or a stale segment's (StaleKept): run again
        raise
    count_kept(model, [base])
    return out


def _run_relay_on(model, stock, call: dict, route: Route, layout, base: RelayCache, kept: int, sampler=None,
                  verify=None, check_row: CheckRow | None = None):
    """The relay call on ``base``, the prefix cache (``kept``: its tokens taken from the store). Returns the output,
    ``kept`` and, on relay_hf's loop, how its step ran in the end (``DecodeStep.kind``), else ``None``. ``sampler``:
    relay_hf's loop's (``sampling.loop_sampler``); ``verify``: what the loop calls before anything of the call is
    shown or drawn (``decode.fast_generate``); ``check_row``: what the prefill runs in row ``R`` (``Route.check_row``:
    the slot has a spare row)."""
    per_input = route.rows // route.ids.shape[0]  # beams / return sequences
    pads = layout.suffix_padding.to(torch.int32).repeat_interleave(per_input)  # [R]
    if check_row is not None:  # [R + 1]
        pads = torch.cat([pads, pads.new_full((1,), check_row.pads(layout.columns - layout.prefix_columns))])
    paths = [p for p in route.grouping.paths for _ in range(per_input)] if route.grouped else None
    slot = _static_slot(model, base, route, pads, paths) if route.static else None
    if slot is None:
        cache = base.fork(suffix_padding=pads, paths=paths)
        # suffix buffers sized once: prompt after the prefix + new tokens
        cache.reserve(layout.columns - layout.prefix_columns + route.new_tokens)
    else:
        cache = slot.cache
    recorded = slot.recordings() if slot is not None and route.fast_decode else None
    out = None
    try:
        if route.fast_decode:
            streamer = call.get("streamer")
            stop = _stop_strings(call, route)
            with torch.no_grad():
                out = fast_generate(model, layout.ids, layout.mask, route.ids, slot, sampler,
                                    None if streamer is None else _StreamerView(streamer, layout),
                                    route.compile_config, route.new_tokens, rows_per_input=per_input, stop=stop,
                                    verify=verify, check_row=check_row)
            step_kind = slot.stepper.kind  # after the call: a compile or capture that failed moved it down
            return layout.to_stock(out), kept, step_kind
        call = {k: v for k, v in call.items() if k not in ("inputs", "input_ids", *CACHE_NAMES)}
        if route.gen.cache_implementation is not None:  # from the call, its config or the model's: ours is the cache
            call["cache_implementation"] = None
        call["attention_mask"] = layout.mask
        call[cache_kwarg_name(model)] = cache
        _lengths_for_layout(call, layout, route)
        _wrap_user_hooks(call, layout, route)
        out = stock(layout.ids, **call)
    finally:
        # a slot whose cache the output hands the caller (return_dict_in_generate) is the caller's now: pooled, a
        # later call would refill the buffers under the caller's continuation
        if slot is not None and (out is None or output_cache(out) is not slot.cache):
            if recorded is not None:
                slot.confirm(recorded, model)
            relay_state(model).give_back_static(slot)
    if isinstance(out, torch.Tensor):
        return layout.to_stock(out), kept, None
    out.sequences = layout.to_stock(out.sequences)
    return out, kept, None


def relay_generate(model, *args, **kwargs):
    """The patched ``generate``: same arguments and outputs as stock, relay attention when rows share a prefix."""
    launched, started = {}, []  # kept segments' checks, run on the device while the host walks the model
    try:
        out = _generate(model, args, kwargs, launched, started)
    except BaseException:
        if started:  # (a broken device's error from the join would hide the call's own)
            with contextlib.suppress(Exception):
                join_checks(model)
        raise
    if started:  # a call that did not read them (a stock route) leaves none running past it
        join_checks(model)
    return out


def _generate(model, args: tuple, kwargs: dict, launched: dict, started: list):
    stock = types.MethodType(type(model).generate, model)
    call = _bind(model, args, kwargs)

    def before_walk(grouping, check_row: bool) -> bool:
        started.append(True)  # (before the launches: one that raises part way is joined too)
        checks, whole = launch_checks(model, grouping.tree, check_row)
        launched.update(checks)
        return whole

    try:
        return _run(model, stock, call, args, kwargs, before_walk, launched, defer_walk=True)
    except RouteChanged as err:  # decided under the model's latest walk, which the call's own walk contradicted
        logger.debug("relay_hf: the model changed since its latest walk (%s); deciding the call again", err)
    return _run(model, stock, call, args, kwargs, None, {}, defer_walk=False)


def _run(model, stock, call: dict, args: tuple, kwargs: dict, before_walk, launched: dict, defer_walk: bool):
    """The call decided (``policy.decide``) and run on its route."""
    try:
        route = decide(model, call, before_walk, defer_walk)
    except ValueError as err:
        model.relay_last_decision = RelayDecision(False, f"invalid input: {err}")
        raise
    decision = route.decision()  # this call's own (the model's attribute is the last call's, of any thread)
    model.relay_last_decision = decision
    if not route.relay:
        logger.debug("relay_hf: stock generate (%s)", route.reason)
        if not route.expected:
            _warn_fallback(route)
        kwargs = {k: v for k, v in kwargs.items() if not (k in CACHE_NAMES and isinstance(v, RelayCache))}
        if route.reason != NOT_PATCHED:
            relay_state(model).counters.add(stock_calls=1)
        return stock(*args, **kwargs)
    logger.debug("relay_hf: relay generate, prefix %d tokens, %d rows, groups %s", route.prefix_length, route.rows,
                 decision.groups)
    try:
        out, kept, step = _run_relay(model, stock, call, route, launched)
    except RouteChanged:
        raise
    except BaseException as err:
        model.relay_last_decision = RelayDecision(False, f"relay run failed: {type(err).__name__}: {err}",
                                                  route.prefix_length, route.rows, route.static,
                                                  groups=decision.groups)
        raise
    model.relay_last_decision = dataclasses.replace(decision, prefix_kept=kept,
                                                    decode_step=step if step is not None else decision.decode_step)
    _count(model, route, out)
    return out


def _count(model, route: Route, out) -> None:
    """``relay_hf.stats`` of a relay call, from the call's own ``route`` (never the model's ``relay_last_decision``,
    which a concurrent call may have replaced): its decode steps (one per new token after the first) and the prefix KV
    bytes they did not read again (``stats.decode_bytes_not_reread``: per layer, what stock reads of each shared
    segment per row, under the layer's window, less what relay reads once). A store hit is counted where the prefix
    is taken (``kept.kept_caches``)."""
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    steps = max(0, sequences.shape[1] - route.ids.shape[1] - 1)  # the first token comes from the prefill
    segments = []
    if route.grouping is not None:
        tree, paths = route.grouping.tree, route.grouping.paths
        per_input = route.rows // len(paths)  # beams / return sequences: rows of one input read what it reads
        firsts = (route.ids.shape[1] - route.n_pad.cpu()).tolist()  # each input's prompt length: its first query
        starts = tree.starts()
        for j, tokens in enumerate(tree.lengths):
            readers = [first for first, path in zip(firsts, paths) if j in path for _ in range(per_input)]
            segments.append((starts[j] + tokens, tokens, readers))
    if not any(len(readers) > 1 for _, _, readers in segments):  # one reader each (a chat turn under a kept prompt)
        steps = 0
    saved = 0
    if steps:
        layers = list(zip(attention_windows(model), layer_kv_bytes(model, route.depends)))
        saved = decode_bytes_not_reread(segments, steps, layers)
    relay_state(model).counters.add(relay_steps=steps, relay_rows=steps * route.rows, kv_bytes_not_reread=saved)


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
