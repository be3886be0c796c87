"""Relay inside transformers' continuous batching: the glue between a patched model and its managers.

``patch`` shadows the instance's ``init_continuous_batching`` (which ``generate_batch``, the context manager and
``transformers serve`` all call) with ``RelayContinuousBatching``: it asks ``policy.continuous_route`` whether relay
serves and on which road, or, where relay cannot serve, switches the model to its own implementation: stock
continuous batching, unchanged. The decision is kept as ``model.relay_continuous_reason`` (why stock, or ``None``)
and ``model.relay_continuous_road`` (``"flash"``, or ``"host: <why not flash>"``). The last of its managers to stop
switches the model back to relay, unless ``unpatch`` let go of the model meanwhile.

* The flash road (CUDA, a transformers with the decode fast path): the model runs relay's flash kernel
  (``flash.py``) under its kernel id, and transformers' own steps, block tables and CUDA graphs call it; the kernel
  finds the shared pages in the block table on the device.
* The host road: the model runs the name continuous batching accepts for relay (``_compat.paged_attention_name``);
  per step, a forward pre-hook (``lay_out_step``) lays the step out on the host from the cache's read index
  (``paged.paged_step``: each shared run of blocks read once) and hands it to every layer as the keyword
  ``relay_step``; ``relay_paged_attention_forward`` runs it.
"""

from __future__ import annotations

import copy
import inspect
import threading
import weakref

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ._compat import (
    attn_implementation,
    is_paged_cache,
    masks_skip_paged_cache,
    paged_attention_name,
    paged_update,
    set_config_attn,
)
from .attention import (
    model_configs,
    module_options,
    relay_attention_forward,
    relay_mask,
    relay_name,
    set_stock_implementation,
    stock_implementation,
)
from .flash import KERNEL_ID, begin_step, forget_steps, offer_kernel, read_totals
from .names import PAGED_NAMES, is_flash_name, is_paged_name, is_relay_name
from .paged import paged_relay_attention, paged_step
from .policy import continuous_route
from .state import relay_state
from .stats import full_layer_kv_bytes


def relay_paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                  value: torch.Tensor, attention_mask, dropout: float = 0.0,
                                  scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """``AttentionInterface`` entry under the continuous-batching names.

    Args:
        query: ``[1, H_q, T, D]`` the step's packed queries.
        key, value: ``[1, H_kv, N, D]``: the KV the paged cache gathered through the step's read index (or, in
            transformers 5.17, this step's new KV, which this function writes and gathers itself through ``cache``).
        kwargs: ``relay_step`` (``paged.PagedStep``) from ``lay_out_step``; without it (a forward outside continuous
            batching) this is ``relay_attention_forward``.

    Returns:
        ``([1, T, H_q, D_v], None)``.
    """
    step = kwargs.get("relay_step")
    if step is None:
        return relay_attention_forward(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                                       **kwargs)
    if dropout:
        raise ValueError("relay attention does not implement attention dropout; call model.eval()")
    cache = kwargs.get("cache")
    if is_paged_cache(cache):
        key, value = paged_update(cache, module, key, value, kwargs)
    # no window: continuous_reason runs sliding-window models stock (their blocks are not shared)
    out = paged_relay_attention(query, key, value, step, module_options(module, scaling, None, kwargs))
    return out, None


def lay_out_step(model, args, kwargs):
    """Forward pre-hook of a patched model: on a continuous-batching step under relay's name, lay the step out,
    rewrite the read index the cache gathers through, and pass the layout to the layers (``relay_step``)."""
    read = kwargs.get("read_index")
    if read is None or "relay_step" in kwargs or not is_paged_name(attn_implementation(model.config)):
        return None
    if len(read) != 1:
        raise ValueError(f"relay's continuous batching serves one attention type, this step reads {len(read)}")
    cu_q = kwargs["cu_seq_lens_q"].tolist()
    cu_k = kwargs["cu_seq_lens_k"]
    cu_k = (next(iter(cu_k.values())) if isinstance(cu_k, dict) else cu_k).tolist()
    state = relay_state(model)
    step = paged_step(read[0], cu_q[:len(cu_k)], cu_k, max(1, state.min_prefix_length), read[0].device)
    if step.shared_tokens:  # full-attention layers' bytes per token, taken when the manager started
        token_bytes = model.__dict__["init_continuous_batching"].kv_token_bytes
        state.counters.add(relay_steps=1, relay_rows=step.decode.rows,
                           kv_bytes_not_reread=step.shared_tokens * token_bytes)
    kwargs = dict(kwargs, relay_step=step)
    if step.read_index is not None:
        kwargs["read_index"] = [step.read_index]
    return args, kwargs


def _without_graphs(cb_config):
    """A copy of the caller's ``ContinuousBatchingConfig`` (or a default one) with CUDA graphs off: relay lays each
    step out on the host (``policy.continuous_reason`` runs stock where the caller asked for graphs)."""
    from transformers import ContinuousBatchingConfig

    cb_config = ContinuousBatchingConfig() if cb_config is None else copy.copy(cb_config)
    cb_config.use_cuda_graph = False
    return cb_config


def _config_of(model, generation_config, cb_config):
    """The ``ContinuousBatchingConfig`` the manager will run with, found as stock finds it: the argument, else one the
    generation config carries (deprecated by transformers, still honoured), else ``None`` (the defaults)."""
    if cb_config is not None:
        return cb_config
    from transformers import ContinuousBatchingConfig

    carried = getattr(generation_config if generation_config is not None else model.generation_config,
                      "continuous_batching_config", None)
    return carried if isinstance(carried, ContinuousBatchingConfig) else None


class RelayContinuousBatching:
    """The ``init_continuous_batching`` of one patched model instance (a callable object, as ``RelayGenerate``).

    Relay serves (``policy.continuous_reason``): the model runs the continuous-batching relay name while relay's
    managers live (``live`` counts them), CUDA graphs off in a copy of the caller's config (relay lays every step out on
    the host). Otherwise the model runs its own implementation while the manager lives (``stock_live`` counts those):
    stock continuous batching, unchanged. The last of them to stop switches the model back to relay, unless
    ``unpatch`` has let go of the model meanwhile (``release``): then the model stays as ``unpatch`` left it, stock.
    ``model.relay_last_decision`` is not touched (a manager serves many calls); ``relay_hf.stats`` counts its steps.
    """

    def __init__(self, model):
        self.__self__ = model
        self._hook = None  # registered by the first manager relay serves (an unpickled model has no hooks yet)
        self._step_hook = None  # the flash road's: each forward tells the kernel a step begins
        self.live = 0  # managers running under the relay name now
        self.stock_live = 0  # managers running stock continuous batching, the model switched to its own attention
        # one token's KV bytes over the full-attention layers (stats.full_layer_kv_bytes), taken as a relay manager
        # starts (a walk over the modules: not per step)
        self.kv_token_bytes = 0
        self._relay = None  # the relay name the model goes back to
        self._released = False  # unpatch let go of the model: nothing here switches it again
        self._lock = threading.Lock()  # the counts, the switches and the release, one at a time

    def remove_hook(self) -> None:
        for name in ("_hook", "_step_hook"):
            hook = getattr(self, name)
            if hook is not None:
                hook.remove()
                setattr(self, name, None)

    def release(self) -> None:
        """``unpatch``'s side: ``ValueError`` while a manager runs under relay's name (its cache and steps need relay
        attention); else the hook goes and from now on nothing here switches the model (a stock manager that stops
        later leaves it as ``unpatch`` left it; a new call is stock's own ``init_continuous_batching``)."""
        with self._lock:
            if self.live:
                raise ValueError("a continuous batching manager of this model runs relay attention: stop it before "
                                 "relay_hf.unpatch")
            self._released = True
            self.remove_hook()

    def __call__(self, generation_config=None, continuous_batching_config=None, *args, **kwargs):
        model = self.__self__
        init = type(model).init_continuous_batching
        cb_config = _config_of(model, generation_config, continuous_batching_config)
        with self._lock:
            current = attn_implementation(model.config)
            ours = is_relay_name(current) or is_paged_name(current) or is_flash_name(current)
            # released, or switched away by the user (not by a stock manager of ours that still runs)
            if self._released or not (ours or self.stock_live):
                return init(model, generation_config, continuous_batching_config, *args, **kwargs)
            if is_relay_name(current):
                self._relay = current
            if is_paged_name(current) or is_flash_name(current):  # a relay manager runs: this one takes its road
                why, flash = None, is_flash_name(current)
            elif not ours:  # a stock manager of ours runs: the model is on its own attention already
                why, flash = model.relay_continuous_reason, False
            else:
                why, not_flash = continuous_route(model, cb_config)
                flash = why is None and not_flash is None
                if flash and not self.live:
                    why = _select_kernel(model)
                model.relay_continuous_road = None if why else ("flash" if flash else f"host: {not_flash}")
            model.relay_continuous_reason = why
            if why is None:
                continuous_batching_config = self._start_relay(flash, cb_config, continuous_batching_config)
            else:
                if ours:
                    model.set_attn_implementation(stock_implementation(model.config))
                self.stock_live += 1
                relay_state(model).counters.add(stock_calls=1)
        try:
            manager = init(model, generation_config, continuous_batching_config, *args, **kwargs)
        except BaseException:
            self._stopped(why is None)
            raise
        manager._relay_built = why is None  # its cache and mask choice were made for relay's name
        _after_stop(manager, lambda: self._stopped(why is None))
        return manager

    def _start_relay(self, flash: bool, cb_config, asked):
        """Count a relay manager in; returns the config it starts with. The flash road's goes as given (CUDA graphs
        as stock would have them; ``_select_kernel`` switched the model). On the host road the first manager switches
        the model to the paged name, and each gets a copy with graphs off (relay lays each step out on the host)."""
        model = self.__self__
        if not flash and self._hook is None:
            self._hook = model.register_forward_pre_hook(lay_out_step, with_kwargs=True)
        self.kv_token_bytes = full_layer_kv_bytes(model)
        if not self.live and flash:  # the kernel counts on the device: stats follow its tally from here
            _follow_kernel(model, self.kv_token_bytes)
        if flash and self._step_hook is None:
            self._step_hook = model.register_forward_pre_hook(begin_step)
        if not self.live and not flash:  # (the flash road's switch is _select_kernel's)
            for config in model_configs(model):
                stock = stock_implementation(config)
                set_config_attn(config, paged_attention_name())
                set_stock_implementation(config, stock)  # what a forward outside the manager runs
        self.live += 1
        return asked if flash else _without_graphs(cb_config)

    def _stopped(self, relay: bool) -> None:
        """A manager stopped (or failed to start): the model goes back to relay once none of ours runs, unless
        ``unpatch`` let go of it."""
        with self._lock:
            if relay:
                self.live -= 1
            else:
                self.stock_live -= 1
            if self._released or self.live or self.stock_live:
                return
            model = self.__self__
            if self._step_hook is not None:  # the last flash-road manager stopped: its caches and graphs are gone
                relay_state(model).counters.settle(KERNEL_ID)
                self._step_hook.remove()
                self._step_hook = None
                forget_steps()
            model.set_attn_implementation(self._relay or relay_name(relay_state(model).original_attn))

    def __reduce__(self):  # the hook travels with the model's own state: a copy gets a new one
        return RelayContinuousBatching, (self.__self__,)


def _follow_kernel(model, token_bytes: int) -> None:
    """``relay_hf.stats(model)`` adds what the flash kernel counts on the model's device from now on (until the last
    manager stops): its steps, rows and shared tokens not read again, in KV bytes over the full-attention layers."""
    device = model.device
    since = read_totals(device)

    def read() -> dict:
        steps, rows, tokens = (now - then for now, then in zip(read_totals(device), since))
        return {"relay_steps": steps, "relay_rows": rows, "kv_bytes_not_reread": tokens * token_bytes}

    relay_state(model).counters.follow(KERNEL_ID, read)


def _select_kernel(model) -> str | None:
    """Switch ``model`` to relay's flash kernel (offered to transformers under its id first), or say why
    transformers did not take it: the manager then runs stock continuous batching."""
    try:
        offer_kernel()
        model.set_attn_implementation(KERNEL_ID)
    except Exception as error:  # the kernels package or transformers refused it here
        return f"transformers did not take relay's flash kernel: {type(error).__name__}: {str(error)[:200]}"
    return None


def _after_stop(manager, after) -> None:
    """Run ``after`` once when ``manager`` stops (its ``stop`` wrapped on the instance, once; a persistent manager
    reused by a later ``init_continuous_batching`` is counted again, ``after`` replaced).

    Nothing here holds the manager strongly: a reference from its own attribute would be a cycle, and a manager only
    the cyclic collector frees keeps its paged cache (most of the GPU's free memory) after
    ``destroy_cached_continuous_batching_manager``, so the next manager could not allocate its own. The pending call
    lives in a one-item list the wrapper holds (it points to the model, never to the manager), so a ``stop`` called
    after its manager is gone (a bound ``stop`` kept, the manager dropped) still counts it out."""
    pending = vars(manager).get("_relay_after_stop")
    if pending is not None:  # wrapped already: this start's call replaces the last one's
        pending[0] = after
        return
    pending = [after]
    manager._relay_after_stop = pending
    own = vars(manager).get("stop")  # another wrapper set on the instance, else the class's, bound at the call
    ref = weakref.ref(manager)

    def stop_then_restore(*args, **kwargs):
        this = ref()
        try:
            if own is not None:
                return own(*args, **kwargs)
            if this is not None:  # gone: its thread (which holds it) ended, nothing is left to stop
                return _class_attribute(this, "stop")(*args, **kwargs)
        finally:
            _run_pending(pending)

    manager.stop = stop_then_restore


def _run_pending(pending: list) -> None:
    call, pending[0] = pending[0], None
    if call is not None:
        call()


def _class_attribute(instance, name: str):
    """``instance.name`` as attribute lookup finds it on the class (the instance's own attribute aside): a function
    bound to ``instance``, a static or class method as such, any other object (a mock) as it is."""
    raw = inspect.getattr_static(type(instance), name)
    get = getattr(type(raw), "__get__", None)
    return raw if get is None else get(raw, instance, type(instance))


def register() -> None:
    """The continuous-batching names' attention function; and, where transformers builds no mask for a paged cache
    whatever the name (newer versions), relay's mask function too, so a ``generate`` call while a manager runs gets
    the masks it would get under ``"relay"``."""
    for name in PAGED_NAMES:
        AttentionInterface.register(name, relay_paged_attention_forward)
        if masks_skip_paged_cache():
            AttentionMaskInterface.register(name, relay_mask)


register()
