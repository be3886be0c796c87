"""The ``generate`` that ``relay_hf.patch`` installs on one model instance (see ``patch.py`` for the overview)."""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import types
import warnings
from dataclasses import dataclass

import torch
from transformers import CompileConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ._compat import cache_kwarg_name
from .cache import ATTN_NAME, STATIC_ATTN_NAME, RelayCache
from .decode import fast_generate, fast_reason
from .dispatch import relay_pays
from .prefix import (
    common_prefix_length,
    first_mismatch,
    inverse_permutation,
    left_padding,
    relay_permutation,
    to_stock_layout,
)

logger = logging.getLogger("relay_hf")

# generate features whose result depends on the order of the prompt tokens (the relay layout moves pads behind the
# prefix) or whose outputs have per-position shapes: these calls run on stock generate.
_ORDER_SENSITIVE = ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "sequence_bias",
                    "output_attentions", "output_hidden_states", "watermarking_config", "token_healing",
                    "prefill_chunk_size", "dola_layers", "penalty_alpha",
                    "prompt_lookup_num_tokens", "assistant_early_exit")
_STOCK_KWARGS = ("inputs_embeds", "position_ids", "assistant_model", "prefix_allowed_tokens_fn", "custom_generate",
                 "negative_prompt_ids", "decoder_input_ids")
_CACHE_NAMES = ("cache", "past_key_values")
STATIC_ROUNDING = 256  # static suffix buffers are sized in multiples of this, so similar calls reuse one compiled graph


class _Stock(Exception):
    """Raised inside planning to send a call to stock generate; the message is the reason."""


class RelayFallbackWarning(UserWarning):
    """A model (or a call) that relay cannot serve exactly runs on stock attention instead."""


@dataclass
class RelayDecision:
    """What the last patched ``generate`` call did. ``used``: relay attention served it; ``reason``: why not;
    ``static``: it ran on a static (compileable) ``RelayCache``; ``fast_decode``: relay_hf's own decode loop (one CUDA
    graph per step, no host sync per token) ran it, else transformers' loop did (``loop_reason`` says why)."""

    used: bool
    reason: str
    prefix_length: int = 0
    rows: int = 0
    static: bool = False
    fast_decode: bool = False
    loop_reason: str = ""


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


def _resolved_config(model, call: dict):
    gen = copy.deepcopy(call.get("generation_config") or model.generation_config)
    for key, value in call.items():
        if hasattr(gen, key) and key != "generation_config":
            setattr(gen, key, value)
    return gen


def _check_user_cache(model, cache: RelayCache, ids: torch.Tensor, n_pad: torch.Tensor) -> None:
    """Raise ``ValueError`` naming what makes ``cache`` unusable for these rows on this model."""
    text = model.config.get_text_config(decoder=True)
    if cache.prefix_length == 0 or cache.prefix_ids is None:
        raise ValueError("RelayCache holds no prefix; build it with RelayCache.from_prefix(model, prefix_ids)")
    if len(cache.layers) != text.num_hidden_layers:
        raise ValueError(f"RelayCache has {len(cache.layers)} layers, the model has {text.num_hidden_layers}")
    k = cache.layers[0].prefix_keys
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if k.shape[1] != text.num_key_value_heads or k.shape[-1] != head_dim:
        raise ValueError(f"RelayCache prefix has {k.shape[1]} kv heads of dim {k.shape[-1]}, the model expects "
                         f"{text.num_key_value_heads} of dim {head_dim}")
    if k.device != model.device:
        raise ValueError(f"RelayCache prefix is on {k.device} but the model is on {model.device}")
    if k.dtype != model.dtype:
        raise ValueError(f"RelayCache prefix dtype is {k.dtype} but the model runs in {model.dtype}")
    bad = first_mismatch(ids, n_pad, cache.prefix_ids)
    if bad is not None:
        row, pos = bad
        what = "has no token after it" if pos >= cache.prefix_length else f"differs at prefix position {pos}"
        raise ValueError(f"RelayCache prefix ({cache.prefix_length} tokens) does not match the input: row {row} {what}")


def _plan(model, call: dict) -> dict:
    """Decide relay vs stock for one call. Raises ``_Stock(reason)`` for stock, ``ValueError`` for bad input."""
    state = model._relay_state
    user_cache = next((call[n] for n in _CACHE_NAMES if call.get(n) is not None), None)
    if user_cache is not None and not isinstance(user_cache, RelayCache):
        raise _Stock(f"a {type(user_cache).__name__} was passed as the cache")
    if user_cache is None and state.unsupported:
        raise _Stock(state.unsupported)
    ids = call.get("inputs", call.get("input_ids"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
        raise _Stock("relay needs 2D integer input_ids")
    for key in _STOCK_KWARGS:
        if call.get(key) is not None:
            raise _Stock(f"`{key}` is not supported by the relay path")
    gen = _resolved_config(model, call)
    for key in _ORDER_SENSITIVE:
        if getattr(gen, key, None) not in (None, False, 0):
            raise _Stock(f"`{key}` is not supported by the relay path")
    if gen.use_cache is False:
        raise _Stock("use_cache=False")
    if gen.cache_implementation not in (None, "static"):
        raise _Stock(f"cache_implementation={gen.cache_implementation!r} is not supported by the relay path")
    # the transformers way to ask for a compiled decode (static cache / compile_config) gets a static RelayCache
    static = (gen.cache_implementation == "static" or gen.compile_config is not None) and (gen.num_beams or 1) == 1
    mask = call.get("attention_mask")
    if mask is None:
        if gen.pad_token_id is not None and bool((ids == gen.pad_token_id).any()):
            raise _Stock("no attention_mask for a batch that contains pad tokens")
        mask = torch.ones_like(ids)
    n_pad = left_padding(mask)
    if n_pad is None:
        raise _Stock("rows are not left-padded")
    B, T = ids.shape
    rows = B * max(gen.num_beams or 1, gen.num_return_sequences or 1)
    if user_cache is not None:
        _check_user_cache(model, user_cache, ids, n_pad)
        P = user_cache.prefix_length
    else:
        captured = static and _compile_config(model, gen) is not None and fast_reason(model, gen, call, T) is None
        P = common_prefix_length(ids, n_pad) if rows > 1 or captured else 0
        why = relay_pays(rows, P, model.device, state.min_prefix_length, captured_loop=captured)
        if why:
            raise _Stock(why)
    window = _sliding_window(model.config)
    total = T + (gen.max_new_tokens if gen.max_new_tokens is not None else max(gen.max_length - T, 0))
    if window is not None and total > window:
        if user_cache is not None and user_cache.relay_active:
            raise ValueError(f"sequence of up to {total} tokens exceeds the sliding window ({window}): the window "
                             "would drop prefix tokens, which relay attention cannot do exactly")
        warnings.warn(f"relay_hf: up to {total} tokens exceed the sliding window ({window}); this call runs stock "
                      "attention", RelayFallbackWarning, stacklevel=3)
        raise _Stock(f"sequence length {total} exceeds the sliding window {window}")
    return dict(ids=ids, mask=mask, n_pad=n_pad, P=P, T=T, total=total, rows=rows, user_cache=user_cache,
                static=static)


def _sliding_window(config) -> int | None:
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return getattr(text, "sliding_window", None)


def _wrap_user_hooks(call: dict, inv: torch.Tensor) -> None:
    """Let user processors, criteria and streamers see stock-layout ids (built-in ones only look at the tail)."""
    if call.get("logits_processor"):
        call["logits_processor"] = LogitsProcessorList(_ProcessorView(p, inv) for p in call["logits_processor"])
    if call.get("stopping_criteria"):
        call["stopping_criteria"] = StoppingCriteriaList(_StockView(c, inv) for c in call["stopping_criteria"])
    if call.get("streamer") is not None:
        call["streamer"] = _StreamerView(call["streamer"], inv)


def _run_relay(model, stock, call: dict, plan: dict):
    ids, mask, n_pad, P, T = plan["ids"], plan["mask"], plan["n_pad"], plan["P"], plan["T"]
    perm = relay_permutation(n_pad, P, T)
    inv = inverse_permutation(perm)
    cache = plan["user_cache"]
    if cache is None:
        cache = RelayCache.from_prefix(model, ids[0, int(n_pad[0]):int(n_pad[0]) + P])
    static = plan["static"] and cache.relay_active
    if static:
        cache = _static_cache(model, cache, plan)
    else:
        cache = cache.fork()
        cache.reserve(plan["total"] - P)  # suffix buffers sized once: prompt after the prefix + max new tokens
    call = {k: v for k, v in call.items() if k not in ("inputs", "input_ids", "cache_implementation", *_CACHE_NAMES)}
    if getattr(call.get("generation_config"), "cache_implementation", None) is not None:
        call["generation_config"] = copy.deepcopy(call["generation_config"])
        call["generation_config"].cache_implementation = None  # the RelayCache we pass is the cache
    call["attention_mask"] = mask.gather(1, perm)
    call[cache_kwarg_name(model)] = cache
    _wrap_user_hooks(call, inv)
    if static:
        gen = _resolved_config(model, call)
        why = fast_reason(model, gen, call, plan["T"])
        model.relay_last_decision.loop_reason = why or "relay_hf decode loop"
        if why is None:
            model.relay_last_decision.fast_decode = True
            with _attention(model, STATIC_ATTN_NAME), torch.no_grad():
                out = fast_generate(model, ids.gather(1, perm), call["attention_mask"], cache, gen,
                                    call.get("streamer"), _compile_config(model, gen))
            return to_stock_layout(out, inv)
    out = _stock_generate(model, stock, ids.gather(1, perm), call, static=static)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    sequences = to_stock_layout(sequences, inv)
    if isinstance(out, torch.Tensor):
        return sequences
    out.sequences = sequences
    return out


def _static_cache(model, base: RelayCache, plan: dict) -> RelayCache:
    """A static fork of ``base`` for this call. The last one is kept on the model and refilled when the next call
    has the same shapes (as transformers keeps its StaticCache), so compiled CUDA graphs are not re-recorded."""
    cap = -(-(plan["total"] - plan["P"]) // STATIC_ROUNDING) * STATIC_ROUNDING
    pads = plan["n_pad"].to(torch.int32).repeat_interleave(plan["rows"] // plan["ids"].shape[0])
    pooled = model._relay_state.static_cache
    if pooled is not None and pooled.can_refill(base, plan["rows"], cap):
        pooled.refill(base, pads.to(base.prefix_device))
        return pooled
    model._relay_state.static_cache = model._relay_state.stepper = None  # free the old buffers (and graph) first
    model._relay_state.static_cache = base.fork(max_suffix_length=cap, suffix_padding=pads)
    return model._relay_state.static_cache


def _compile_config(model, gen):
    """The ``CompileConfig`` transformers would compile the decode step with, or ``None`` where it would not."""
    if gen.disable_compile:
        return None
    config = gen.compile_config or CompileConfig()
    return config if model.device.type == "cuda" or config._compile_all_devices else None


@contextlib.contextmanager
def _attention(model, name: str):
    """Run under attention implementation ``name``, then give the model its ``"relay"`` implementation back."""
    if model.config._attn_implementation == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(ATTN_NAME)


def _stock_generate(model, stock, ids: torch.Tensor, call: dict, static: bool):
    """Stock ``generate`` on the relay layout; a static cache runs under ``"relay_static"`` (no mask function, so the
    compiled decode step builds no mask)."""
    with _attention(model, STATIC_ATTN_NAME if static else ATTN_NAME):
        return stock(ids, **call)


def relay_generate(model, *args, **kwargs):
    """The patched ``generate``: same arguments and outputs as stock, relay attention when rows share a prefix."""
    stock = types.MethodType(type(model).generate, model)
    call = _bind(model, args, kwargs)
    try:
        plan = _plan(model, call)
    except _Stock as why:
        model.relay_last_decision = RelayDecision(False, str(why))
        logger.debug("relay_hf: stock generate (%s)", why)
        # exactly stock: the model's own attention (a static cache would otherwise get relay's mask objects)
        if model._relay_state.unsupported is not None:  # patch kept the model's own attention
            return stock(*args, **kwargs)
        with _attention(model, model._relay_state.original_attn):
            return stock(*args, **kwargs)
    used = plan["user_cache"].relay_active if plan["user_cache"] is not None else True
    model.relay_last_decision = RelayDecision(used, "relay" if used else "RelayCache on stock attention",
                                              plan["P"], plan["rows"], plan["static"] and used)
    logger.debug("relay_hf: relay generate, prefix %d tokens, %d rows", plan["P"], plan["rows"])
    return _run_relay(model, stock, call, plan)


