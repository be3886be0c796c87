"""Which loop decodes a relay call and how its step runs: relay_hf's own loop (``decode.py``) or transformers', on a
static or a dynamic ``RelayCache``, its step compiled, captured as CUDA graphs or run as eager ops.

Rules ``policy.decide`` applies once it knows relay serves the call (``policy`` raises what must run stock): the loop
relay_hf's where it reproduces stock token for token (``loop_reason``) and the mode ``patch(model, decode=...)`` chose
wants it (``loop_choice_reason``); the cache static for relay_hf's loop and for a call that asks for one
(``static_shape``); the step compiled by transformers' own rule (``compile_config``), by default for fp16 / bf16 on
CUDA (``compiled_by_default``).
"""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import CompileConfig, GenerationConfig

from ._compat import compile_all_devices
from .cache import RelayCache
from .prefill import layer_windows, trim_window
from .prefix import Grouping
from .state import relay_state

DECODE_MODES = ("auto", "graph", "compile", "eager")
# how relay_hf's loop runs a decode step: its forward compiled by inductor (then replayed as CUDA graphs on CUDA), the
# eager forward captured and replayed as CUDA graphs, or the eager forward run as it is (off CUDA)
DECODE_STEPS = ("compiled", "cuda graph", "eager ops")
# generation-config fields (with their neutral values) relay_hf's loop does not serve; logits processors are judged
# one by one (``sampling.loop_processors``)
_LOOP_NEUTRAL = {
    "num_beams": (None, 1), "max_time": (None,), "return_dict_in_generate": (None, False),
    "output_scores": (None, False), "output_logits": (None, False), "synced_gpus": (None, False),
}
# generate() arguments that are not generation-config fields and that relay_hf's loop handles (or that must be empty)
_LOOP_ARGS = {"inputs", "input_ids", "attention_mask", "generation_config", "streamer", "logits_processor",
              "stopping_criteria", "use_model_defaults", "tokenizer", "cache", "past_key_values", "synced_gpus",
              "compile_config"}


def loop_reason(model, gen: GenerationConfig, call: dict, n_new: int) -> str | None:
    """Why relay_hf's decode loop cannot run this call (then transformers' loop runs it), or ``None``. Logits
    processors are judged by ``sampling.loop_processors``."""
    for key, neutral in _LOOP_NEUTRAL.items():
        if getattr(gen, key, None) not in neutral:
            return f"{key}={getattr(gen, key)!r} runs on transformers' loop"
    for key in ("logits_processor", "stopping_criteria"):
        if call.get(key):
            return f"a user `{key}` runs on transformers' loop"
    extra = sorted(k for k, v in call.items() if v is not None and k not in _LOOP_ARGS and not hasattr(gen, k))
    if extra:
        return f"model kwargs {extra} run on transformers' loop"
    if n_new < 1:
        return "no new tokens"
    params = inspect.signature(model.forward).parameters
    missing = [p for p in ("position_ids", "logits_to_keep") if p not in params]
    if missing and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return f"the model's forward takes no {missing[0]}"
    if getattr(model, "hf_quantizer", None) is not None and not model.hf_quantizer.is_compileable:
        return "a quantizer that cannot compile"
    if len(set(getattr(model, "hf_device_map", {"": 0}).values())) > 1:
        return "a model spread over several devices"
    return None


def loop_choice_reason(model, gen: GenerationConfig) -> str | None:
    """Why this call would not decode on relay_hf's loop even if it could, or ``None``: the loop runs by default on
    CUDA (``patch(model, decode="auto")``), anywhere with ``decode="graph"`` / ``"compile"``, and for a call that asks
    for a compiled decode the transformers way (``cache_implementation="static"`` or a ``compile_config``)."""
    mode = relay_state(model).decode
    if gen.cache_implementation == "static" or gen.compile_config is not None or mode in ("graph", "compile"):
        return None
    if mode == "eager":
        return "patch(model, decode='eager') decodes on transformers' loop"
    if model.device.type != "cuda":
        return "transformers' loop off CUDA (patch(model, decode='graph') runs relay_hf's loop here)"
    return None


def compile_config(model, gen: GenerationConfig) -> CompileConfig | None:
    """The ``CompileConfig`` transformers would compile the decode step with, or ``None`` where it would not."""
    if gen.disable_compile:
        return None
    config = gen.compile_config or CompileConfig()
    return config if model.device.type == "cuda" or compile_all_devices(config) else None


def static_shape(model, gen: GenerationConfig, cache: RelayCache | None, grouping: Grouping,
                 fast: bool, depends=None) -> tuple[bool, CompileConfig | None]:
    """``(static, compile_config)``: whether the call runs on a static ``RelayCache``, and the inductor config its
    decode step compiles with (``None``: eager, captured as CUDA graphs on CUDA). ``depends``: the call's
    ``dependencies.kv_dependencies``, if it took them (``prefill.layer_windows`` reads its walk)."""
    asked_static = gen.cache_implementation == "static" or gen.compile_config is not None
    # attention reads through PrefixGroups tables: several prefixes, or sliding-window layers that store only what
    # their window sees (each row's positions then come from the tables)
    if cache is not None:
        trimmed = any(lay.window is not None for lay in cache.layers)
    else:
        trimmed = any(trim_window(w, grouping.tree.lengths) is not None for w in layer_windows(model, depends))
    tables = not grouping.single or trimmed
    # a static RelayCache for relay_hf's loop, and for transformers' loop when the call asks for one (without tables:
    # transformers' compiled loop would bake one call's tables into its graphs)
    static = fast or (asked_static and (gen.num_beams or 1) == 1 and not tables)
    # with tables relay_hf's loop replays the captured eager step: the tables change per call in place, which an
    # inductor graph would have to guard on
    compiled = (compile_config(model, gen) if fast and not tables
                and (asked_static or relay_state(model).decode == "compile" or compiled_by_default(model))
                else None)
    return static, compiled


def decode_step(model, gen: GenerationConfig, fast: bool, compiled: CompileConfig | None) -> str:
    """How relay_hf's loop will run this call's steps (``DECODE_STEPS``; ``""`` off the loop). A model patched with
    ``decode="compile"`` whose step does not compile because of its device (transformers' rule, ``compile_config``:
    CUDA, or a ``CompileConfig`` with ``_compile_all_devices``) gets a warning saying what runs instead; a call that
    turns compiling off (``disable_compile=True``) or a batch that reads through work tables (``static_shape``) is
    documented to run the eager step and does not."""
    if not fast:
        return ""
    if compiled is not None:
        return "compiled"
    step = "cuda graph" if model.device.type == "cuda" else "eager ops"
    if relay_state(model).decode == "compile" and not gen.disable_compile and compile_config(model, gen) is None:
        device = model.device.type
        warnings.warn(f"relay_hf: decode='compile' compiles the decode step on CUDA only, as transformers compiles "
                      f"(a CompileConfig with _compile_all_devices=True compiles on {device} too): this call on "
                      f"{device} runs relay_hf's loop on eager ops (relay_last_decision.decode_step)", UserWarning,
                      stacklevel=6)
    return step


def compiled_by_default(model) -> bool:
    """Whether ``patch(model)``'s default (``decode="auto"``) compiles the loop's forward: on CUDA for fp16 / bf16
    models (one decoder layer compiled for all, ``regional.py``: a few seconds once, kept across processes). fp32
    keeps the captured eager step, which is token-identical to stock (inductor's fused reductions round
    differently)."""
    return (relay_state(model).decode == "auto" and model.device.type == "cuda"
            and model.dtype in (torch.float16, torch.bfloat16))
