"""``relay_hf.patch(model)`` / ``unpatch(model)``: batched ``generate`` that prefills a shared prefix once.

``patch`` switches the instance to the ``"relay"`` attention implementation for good (exactly the model's own
implementation whenever no relay prefix is involved; ``attention.py``), checks by a tiny forward that relay
reproduces the model (``probe.py``), and shadows that one instance's ``generate`` (``generate.py``). Which calls run
relay is decided in one place, ``policy.py``.
"""

from __future__ import annotations

import threading
import warnings

import torch

from . import attention
from ._compat import attn_implementation, cached_continuous_manager, can_set_attn_implementation
from .continuous import RelayContinuousBatching
from .generate import RelayFallbackWarning, RelayGenerate
from .loop_rules import DECODE_MODES
from .names import is_relay_name
from .probe import probe_reason
from .state import RelayState, attach_state, detach_state, relay_state
from .store import checked_budget

DEFAULT_MIN_PREFIX_LENGTH = 32
CPU_PREFIX_CACHE_BYTES = 256 * 2**20  # the prefix store's budget off CUDA: a few system prompts of a small model
_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


def unsupported_reason(model) -> str | None:
    """Why relay cannot be exact for this model by its configuration (ALiBi, chunked attention, exotic layers...),
    or ``None``. Logit caps, attention sinks and sliding windows are served (``kernels.AttentionOptions``). ``patch``
    also runs a probe forward (``probe.probe_reason``) for what a config cannot tell."""
    config = model.config
    text = config.get_text_config(decoder=True)
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    if getattr(text, "alibi", False) or getattr(text, "position_embedding_type", None) == "alibi":
        return "ALiBi position biases are not implemented by relay attention"
    if getattr(text, "attention_chunk_size", None) is not None:
        return "chunked attention is not implemented by relay attention"
    if not getattr(text, "is_causal", True):
        return "the model's attention is not causal"
    if not can_set_attn_implementation(model):
        return f"{type(model).__name__} does not route attention through transformers' AttentionInterface"
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not layer_types <= _SUPPORTED_LAYER_TYPES:
        return f"layer types {sorted(layer_types - _SUPPORTED_LAYER_TYPES)} are not supported by relay attention"
    return None


def _switch_to_relay(model) -> None:
    configs = attention.model_configs(model)
    stock = [(c, attn_implementation(c)) for c in configs]
    model.set_attn_implementation(attention.relay_name(attn_implementation(model.config)))
    for config, name in stock:  # a sub-config whose own implementation differs from the model's
        attention.set_stock_implementation(config, name)


def _switch_back(model, original: str) -> None:
    configs = attention.model_configs(model)
    if is_relay_name(attn_implementation(model.config)):  # a choice the user made after patch stays
        model.set_attn_implementation(original)
    for config in configs:
        attention.set_stock_implementation(config, None)


def _check_model(model, what: str) -> None:
    """``TypeError`` naming what ``what`` takes, for anything that is not a transformers model with ``generate``."""
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "config") and callable(getattr(model, "generate",
                                                                                                 None))):
        raise TypeError(f"relay_hf.{what} takes a transformers model with generate (e.g. from "
                        f"AutoModelForCausalLM.from_pretrained), got {type(model).__name__}")


def default_prefix_cache_bytes(model) -> int:
    """The prefix store's budget when ``patch`` is not given one: an eighth of the free memory of a CUDA model's
    device (a 4096-token prompt of a Llama-3-8B-shaped model in bf16 is 512 MiB), ``CPU_PREFIX_CACHE_BYTES``
    elsewhere."""
    device = next(model.parameters()).device if any(True for _ in model.parameters()) else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 8
    return CPU_PREFIX_CACHE_BYTES


def patch(model, *, min_prefix_length: int = DEFAULT_MIN_PREFIX_LENGTH, decode: str = "auto",
          prefix_cache_bytes: int | None = None):
    """Make batched ``model.generate`` use relay attention whenever its rows share a token prefix.

    Args:
        model: a transformers causal LM. Patched in place (this instance only) and returned.
        min_prefix_length: shortest common prefix (tokens) worth a separate prefill; shorter runs stock.
        decode: which loop decodes (``loop_rules.loop_choice_reason``). ``"auto"``: relay_hf's loop on CUDA, each step
            replayed as CUDA graphs; for fp16 / bf16 models the step's decoder layer is compiled by inductor first
            (one layer's graph serves every layer, batch bucket and prompt length; its artifacts are kept across
            processes, ``relay_hf.artifacts``), fp32 captures the eager step; transformers' loop elsewhere.
            ``"graph"``: relay_hf's loop on any device, the eager step captured as CUDA graphs on CUDA, eager ops
            elsewhere; ``"compile"``: relay_hf's loop with the forward compiled by inductor, any dtype, where
            transformers compiles a decode step: on CUDA, elsewhere only for a ``CompileConfig`` whose
            ``_compile_all_devices`` is set (without one the loop runs eager ops there, and warns);
            ``"eager"``: transformers' loop. A call that asks for a compiled decode (``cache_implementation="static"``,
            ``compile_config``) gets relay_hf's loop, compiled by the same rule, whatever the mode;
            ``disable_compile=True`` keeps the eager step. ``relay_last_decision.decode_step`` says which step ran
            (``"compiled"``, ``"cuda graph"``, ``"eager ops"``).
        prefix_cache_bytes: bytes of prefilled prefixes kept between calls (a system prompt prefilled by one
            ``generate`` call serves the next ones; least recently used out; ``relay_hf.clear_prefixes`` empties
            it); ``None``: ``default_prefix_cache_bytes``; ``0``: nothing kept.

    A model relay cannot serve exactly (ALiBi, chunked or linear attention, an attention module
    that does more than hand its KV to the attention function...) keeps its attention; a ``RelayFallbackWarning``
    says why and ``generate`` stays stock.

    Time: ``patch`` runs a probe forward, with relay attention computed by its PyTorch reference on every device
    (``kernels.reference_only``): no Triton kernel is compiled while patching; on CUDA the first call compiles the
    ones it needs (once per process and head size; Triton's disk cache shortens it in later processes). On a CPU the
    probe takes well under a second.
    """
    budget = _checked_arguments(model, min_prefix_length, decode, prefix_cache_bytes)
    state = relay_state(model)
    if state is not None:  # patched already: new settings
        state.min_prefix_length = min_prefix_length
        state.decode = decode
        if budget is not None:
            state.store.resize(budget)
        return model
    original = attn_implementation(model.config)
    reason = unsupported_reason(model)
    if reason is None:
        _switch_to_relay(model)
        try:
            reason = probe_reason(model)
        except BaseException:
            _switch_back(model, original)
            raise
        if reason is not None:
            _switch_back(model, original)
    if reason is not None:
        warnings.warn(f"relay_hf: {reason}; {type(model).__name__} keeps stock attention", RelayFallbackWarning,
                      stacklevel=2)
    if budget is None:
        budget = default_prefix_cache_bytes(model)
    attach_state(model, RelayState(original, min_prefix_length, reason, decode, budget))
    model.relay_last_decision = None
    model.generate = RelayGenerate(model)
    if reason is None:  # a declined model's continuous batching is stock's, untouched
        model.init_continuous_batching = RelayContinuousBatching(model)
    return model


def _checked_arguments(model, min_prefix_length, decode: str, prefix_cache_bytes) -> int | None:
    """``patch``'s arguments checked before anything changes (``TypeError`` / ``ValueError`` naming the bad one);
    returns the store budget asked for (``None``: none)."""
    _check_model(model, "patch")
    if not isinstance(min_prefix_length, int) or isinstance(min_prefix_length, bool) or min_prefix_length < 0:
        raise ValueError(f"min_prefix_length must be a non-negative int, got {min_prefix_length!r}")
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
    budget = checked_budget(prefix_cache_bytes) if prefix_cache_bytes is not None else None
    if hasattr(model, "_orig_mod"):  # torch.compile's wrapper: no generate of its own to patch
        raise ValueError("relay_hf.patch needs the model itself, not a torch.compile wrapper: patch the model, then "
                         "compile its forward if you like (or ask generate for a compiled decode with "
                         "cache_implementation='static')")
    return budget


def unpatch(model):
    """Undo ``patch``: the instance's own attention implementation and the class's ``generate`` come back.

    ``ValueError`` (nothing undone) while a continuous-batching manager runs relay attention. A manager that runs
    stock continuous batching may run on: the model runs its own implementation already (or transformers'
    continuous-batching form of it, which the manager undoes as it stops), and stays on it when the manager stops
    (``RelayContinuousBatching.release``)."""
    _check_model(model, "unpatch")
    if relay_state(model) is None:
        return model
    continuous = model.__dict__.get("init_continuous_batching")
    if isinstance(continuous, RelayContinuousBatching):
        continuous.release()  # raises while a relay manager runs; else no manager of ours switches the model again
    cached = cached_continuous_manager(model)
    if cached is not None and getattr(cached, "_relay_built", False):  # kept by a relay call: made for relay's name
        model.destroy_cached_continuous_batching_manager()
    state = detach_state(model)
    model.__dict__.pop("generate", None)
    model.__dict__.pop("relay_last_decision", None)
    model.__dict__.pop("relay_continuous_reason", None)
    model.__dict__.pop("relay_continuous_road", None)
    model.__dict__.pop("init_continuous_batching", None)
    if state.declined is None:
        _switch_back(model, state.original_attn)
    return model


def is_patched(model) -> bool:
    """Whether ``model`` is patched by ``relay_hf.patch`` (``False`` for anything that is not a model)."""
    return relay_state(model) is not None


# relay states patched by holders (pipelines) -> [state, holders alive on it]; the state is kept so its id stays unique.
# Re-entrant: a holder's finalizer (``release``) can run from garbage collection inside ``hold_patch`` itself
# (patching allocates), on the same thread, and must not wait for the lock that thread holds.
_HELD: dict[int, list] = {}
_HELD_LOCK = threading.RLock()


def hold_patch(model):
    """Patch ``model`` for a holder (a pipeline) unless its owner patched it. Returns the callable that lets go of it
    (the last holder to let go unpatches), or ``None`` when the patch is not the holders' to undo."""
    with _HELD_LOCK:
        if not is_patched(model):
            patch(model)
            ours = relay_state(model)
            _HELD[id(ours)] = [ours, 0]
        held = _HELD.get(id(relay_state(model)))
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
            if relay_state(model) is state:  # unpatched (or re-patched) by its owner meanwhile: theirs
                unpatch(model)

    return release


def clear_prefixes(model) -> None:
    """Drop every prefilled prefix ``model`` keeps between calls, pinned ones too (``ValueError`` for a model
    ``patch`` has not patched)."""
    _check_model(model, "clear_prefixes")
    if not is_patched(model):
        raise ValueError("relay_hf.clear_prefixes takes a model patched by relay_hf.patch")
    relay_state(model).store.clear()
