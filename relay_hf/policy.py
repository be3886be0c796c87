"""Every relay-or-stock rule in one place: ``decide(model, call)`` returns one frozen ``Plan`` per ``generate`` call.

The rules, in the order they are checked:

1. the model: patched, not declined by ``patch``, still on the ``"relay"`` implementation (``model_reason``);
2. the call: a ``RelayCache`` or no cache, 2D integer ids, no feature that reads the prompt's token order or needs
   per-position outputs (those run stock: relay reorders each row's pads behind the shared prefix), left padding;
3. the batch: shared prefixes that pay (``prefix.find_groups`` picks the system prompts, and blocks under them,
   that save the most KV reads; ``relay_pays``; numbers in docs/performance.md), or the prefixes of the caller's
   ``RelayCache`` (each row reads the longest it starts with), within the position range;
4. the loop: relay_hf's decode loop (captured as CUDA graphs on CUDA; the default there, ``patch(model, decode=...)``
   chooses) where it reproduces stock token for token (``loop_reason``), else transformers' loop: on a static
   ``RelayCache`` when the call asks for one (``cache_implementation="static"``), else on a dynamic one.

Stock plans carry ``expected``: ``False`` where the user would have gained from relay (``generate`` then warns once
per reason through the ``relay_hf`` logger); ``True`` for the ordinary cases (one row, a short prefix, not patched).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field

import torch
from transformers import CompileConfig, GenerationConfig

from ._compat import (
    attn_implementation,
    cache_recomputed_past,
    compile_all_devices,
    masks_skip_paged_cache,
    resolve_generation_config,
)
from .cache import RelayCache
from .decode import DEFAULT_DECODE, Sampler, loop_sampler
from .names import is_paged_name, is_relay_name
from .prefill import layer_windows, trim_window
from .prefix import Grouping, PrefixTree, common_prefix_length, find_groups, left_padding
from .store import kv_dependencies

# rows * prefix tokens below which the CUDA relay kernel is not measured to beat SDPA over the expanded prefix
# (B=8, S=512: 1.31x; docs/performance.md, kernel table)
CUDA_MIN_SHARED_TOKENS = 4096
CACHE_NAMES = ("cache", "past_key_values")
STATIC_ROUNDING = 256  # static suffix buffers are sized in multiples of this, so similar calls reuse one captured step
# generate() arguments relay does not serve
_STOCK_KWARGS = ("inputs_embeds", "position_ids", "assistant_model", "prefix_allowed_tokens_fn", "custom_generate",
                 "negative_prompt_ids", "negative_prompt_attention_mask", "decoder_input_ids", "assistant_tokenizer",
                 "target_tokenizer")
# generation-config fields (with the values that switch them off) whose processors read the prompt's ids beyond its
# length and last tokens, whose outputs have per-position shapes, or that run another decoding method
_STOCK_FIELDS = {
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,),
    "sequence_bias": (None,), "watermarking_config": (None,), "guidance_scale": (None, 1.0),
    "output_attentions": (None, False), "output_hidden_states": (None, False), "token_healing": (None, False),
    "prefill_chunk_size": (None,), "dola_layers": (None,), "penalty_alpha": (None,),
    "prompt_lookup_num_tokens": (None,), "assistant_early_exit": (None,), "num_beam_groups": (None, 1),
    "use_mtp": (None, False), "speculation_type": (None,),
    "diversity_penalty": (None, 0.0), "constraints": (None,), "force_words_ids": (None,),
}
# generation-config fields (with their neutral values) relay_hf's loop does not serve; logits processors are judged
# one by one (``decode.loop_sampler``)
_LOOP_NEUTRAL = {
    "num_beams": (None, 1), "max_time": (None,), "return_dict_in_generate": (None, False),
    "output_scores": (None, False), "output_logits": (None, False), "synced_gpus": (None, False),
}
# generate() arguments that are not generation-config fields and that relay_hf's loop handles (or that must be empty)
_LOOP_ARGS = {"inputs", "input_ids", "attention_mask", "generation_config", "streamer", "logits_processor",
              "stopping_criteria", "use_model_defaults", "tokenizer", "cache", "past_key_values", "synced_gpus",
              "compile_config"}
DECODE_MODES = ("auto", "graph", "compile", "eager")
# how relay_hf's loop runs a decode step: its forward compiled by inductor (then replayed as CUDA graphs on CUDA), the
# eager forward captured and replayed as CUDA graphs, or the eager forward run as it is (off CUDA)
DECODE_STEPS = ("compiled", "cuda graph", "eager ops")
TRAINING = "the model is in training mode (call model.eval())"
NOT_PATCHED = "the model is not patched (relay_hf.patch)"


@dataclass
class RelayDecision:
    """What the last patched ``generate`` call did. ``used``: relay attention served it; ``reason``: why not;
    ``prefix_length``: shared tokens (the longest a row reads); ``rows``: sequences decoded; ``groups``: per shared
    segment ``(level, rows, tokens)`` (level 0: a system prompt; level 1: a block some of its rows share);
    ``static``: it ran on a static (compileable) ``RelayCache``; ``fast_decode``: relay_hf's own decode loop (CUDA
    graphs per step on CUDA, no host sync per token) ran it, else transformers' loop did (``loop_reason`` says
    why); ``prefix_kept``: shared tokens taken from the model's prefix store (kept from an earlier call) instead of
    prefilled; ``decode_step``: how relay_hf's loop runs each step (``DECODE_STEPS``; ``""`` off that loop), which
    is what ``patch(model, decode=...)`` asked for only where the device allows it (``decode="compile"`` compiles
    on CUDA, or for a ``CompileConfig`` with ``_compile_all_devices``; elsewhere the loop runs eager ops)."""

    used: bool
    reason: str
    prefix_length: int = 0
    rows: int = 0
    static: bool = False
    fast_decode: bool = False
    loop_reason: str = ""
    groups: tuple[tuple[int, int, int], ...] = ()
    prefix_kept: int = 0
    decode_step: str = ""


@dataclass(frozen=True, eq=False)
class Plan:
    """One call's decision and what running it needs.

    Attributes:
        relay: relay serves the call; else stock ``generate`` runs it unchanged (a ``RelayCache`` argument removed).
        reason: ``"relay"`` or why not. ``expected``: a stock plan the user would expect (no warning).
        rows: sequences decoded (batch x beams / return sequences). ``prefix_length``: shared tokens ``P``.
        static: a static (compileable) ``RelayCache``; ``fast_decode``: relay_hf's own decode loop decodes,
            compiled with ``compile_config`` (and captured as a CUDA graph on CUDA) where that is set
            (``loop_reason`` says why not).
        decode_step: how relay_hf's loop runs each step (``DECODE_STEPS``), ``""`` off it.
        new_tokens: tokens stock ``generate`` would make at most. ``static_capacity``: suffix positions of the
            static cache; ``static_rows``: its rows (on relay_hf's loop the batch rounded up to a capture size,
            ``DecodeConfig.bucket``). ``ids`` / ``mask`` ``[B, T]``; ``n_pad`` ``[B]``
            left pads; ``user_cache``: the caller's ``RelayCache`` (never mutated); ``grouping``: what the rows
            share (the tree to prefill, or the caller's cache's, and each input row's path in it); ``gen``: the
            resolved config; ``sampler``: how relay_hf's loop picks tokens (``decode.loop_sampler``).
    """

    relay: bool
    reason: str
    expected: bool = True
    rows: int = 0
    prefix_length: int = 0
    static: bool = False
    fast_decode: bool = False
    loop_reason: str = ""
    decode_step: str = ""
    new_tokens: int = 0
    static_capacity: int = 0
    static_rows: int = 0
    ids: torch.Tensor | None = field(default=None, repr=False)
    mask: torch.Tensor | None = field(default=None, repr=False)
    n_pad: torch.Tensor | None = field(default=None, repr=False)
    user_cache: RelayCache | None = field(default=None, repr=False)
    grouping: Grouping | None = field(default=None, repr=False)
    gen: GenerationConfig | None = field(default=None, repr=False)
    compile_config: CompileConfig | None = field(default=None, repr=False)
    sampler: Sampler | None = field(default=None, repr=False)

    @property
    def grouped(self) -> bool:
        """Rows read different prefixes (several segments, or rows without one): the grouped kernels."""
        return self.grouping is not None and not self.grouping.single

    def decision(self) -> RelayDecision:
        groups = ()
        if self.grouping is not None:
            per = self.rows // len(self.grouping.paths)
            tree = self.grouping.tree
            readers = [sum(j in p for p in self.grouping.paths) * per for j in range(len(tree.ids))]
            groups = tuple((len(tree.path(j)) - 1, readers[j], tree.lengths[j]) for j in range(len(tree.ids))
                           if readers[j])
        return RelayDecision(self.relay, self.reason, self.prefix_length, self.rows, self.static, self.fast_decode,
                             self.loop_reason, groups, decode_step=self.decode_step)


class RunStock(Exception):
    """Raised by the questions ``decide`` asks: run stock ``generate`` because of ``reason``. ``expected``: a case
    the user would expect to run stock (no warning)."""

    def __init__(self, reason: str, expected: bool = False):
        super().__init__(reason)
        self.expected = expected


def model_reason(model) -> str | None:
    """Why relay cannot serve ``model`` at all right now (not patched, declined by ``patch``, or switched to another
    attention implementation after it), or ``None``."""
    state = model.__dict__.get("_relay_state")
    if state is None:
        return NOT_PATCHED
    if state.declined is not None:
        return state.declined
    name = attn_implementation(model.config)
    if is_paged_name(name):  # a continuous-batching manager of this model runs
        if not masks_skip_paged_cache():
            raise ValueError("a continuous batching manager of this model is running, under the attention name "
                             f"{name!r} it needs; stop it before calling generate")
        return None
    if not is_relay_name(name):
        return f"the model's attention implementation was set to {name!r} after relay_hf.patch"
    return None


def prefix_store(model):
    """``(store, depends)``: the model's prefix store and what its entries must have been built under, when this call
    may read and keep prefixes there; ``(None, None)`` when it may not (``keep_reason``) or keeps nothing (budget 0)."""
    store = model._relay_state.store
    if store.budget_bytes == 0 or keep_reason(model) is not None:
        return None, None
    return store, kv_dependencies(model)


def continuous_reason(model, cb_config) -> str | None:
    """Why a continuous-batching manager of ``model`` (``generate_batch``, ``init_continuous_batching``, a server)
    must run stock continuous batching, or ``None``: relay serves its steps (``paged.py``). ``cb_config``: the
    ``ContinuousBatchingConfig`` asked for, or ``None``.

    Relay plans each step on the host from the cache's read index, so a step captured as a CUDA graph or compiled
    (which replays without the host) runs stock; so do models with sliding-window layers (transformers shares no
    blocks there) and training mode."""
    why = model_reason(model)
    if why is not None:
        return why
    if model.training:
        return TRAINING
    text = model.config.get_text_config(decoder=True)
    windowed = getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True)
    if windowed or set(getattr(text, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return "continuous batching shares no blocks of sliding-window layers"
    graphs = getattr(cb_config, "use_cuda_graph", None)
    if graphs is True or (isinstance(graphs, tuple) and any(graphs)):
        return "the continuous batching config asks for CUDA graphs, which replay without relay's per-step plan"
    if any(getattr(cb_config, name, None) for name in ("varlen_compile_config", "decode_compile_config",
                                                       "default_compile_level")):
        return "the continuous batching config asks for a compiled step, which runs without relay's per-step plan"
    return None


def keep_reason(model) -> str | None:
    """Why no prefix may be prefilled now and kept for later calls (a pipeline's system prompts), or ``None``: relay
    cannot serve the model (``model_reason``), or it is in training mode (its prefill would run dropout, and the
    KV kept would be a random draw, not the model's)."""
    why = model_reason(model)
    if why is None and model.training:
        why = TRAINING
    return why


def relay_pays(rows: int, prefix_length: int, device: torch.device, min_prefix_length: int,
               captured_loop: bool = False, shared_tokens: int | None = None) -> str | None:
    """``None`` when relay should serve this batch, else the reason it should not.

    ``prefix_length``: the shared prefix (with several, the shortest segment); ``shared_tokens``: rows x tokens read
    from shared prefixes (``rows * prefix_length`` when ``None``). A single row has nothing to share, except on
    relay_hf's captured loop (``captured_loop``, CUDA only), where the loop, not the kernel, decides: transformers'
    static loop is host-bound while the captured step replays back to back (one-row rows in docs/performance.md)."""
    captured_loop = captured_loop and device.type == "cuda"
    shared = rows * prefix_length if shared_tokens is None else shared_tokens
    if rows < 2 and not captured_loop:
        return "a single row has nothing to share"
    if prefix_length < max(1, min_prefix_length):
        return f"common prefix of {prefix_length} tokens is below min_prefix_length={max(1, min_prefix_length)}"
    if device.type == "cuda" and not captured_loop and shared < CUDA_MIN_SHARED_TOKENS:
        return (f"{shared} shared tokens (rows x prefix) < {CUDA_MIN_SHARED_TOKENS}: SDPA is faster on this GPU "
                "(relay_hf.policy)")
    return None


@dataclass(frozen=True)
class RopeLimit:
    """A length past which a forward's longest position changes what the model computes at every position of it:
    its rotary embedding's frequencies (dynamic NTK rescales them to the longest position past
    ``max_position_embeddings``; longrope takes its long factors in a forward longer than
    ``original_max_position_embeddings``), or its ``generate`` recomputing the whole sequence in one forward (Phi-3's).
    Stock prefills the whole prompt in one forward; relay prefills each shared prefix alone, at its own length, so past
    this point relay's prefix KV would not be stock's.

    Attributes:
        positions: a call whose prompt columns plus new tokens are at most this many runs every forward on fewer
            positions, where the frequencies are the RoPE's base ones for relay's forwards and stock's alike (dynamic
            NTK resets to them there after an earlier, longer call).
        what: the change, for ``relay_last_decision.reason``.
        beyond: whether relay is exact too when every shared prefix is longer than ``positions``: longrope's choice
            depends on nothing but the forward's length, so each of relay's forwards then takes the long factors, as
            stock's prompt does, and a cache already past the point is never recomputed. Dynamic NTK's frequencies
            follow the longest position of each forward (and what earlier forwards grew them to): never.
    """

    positions: int
    what: str
    beyond: bool


def rope_limits(model) -> list[RopeLimit]:
    """The points past which ``model``'s forwards change with their length (``RopeLimit``): a dynamic NTK or longrope
    RoPE (``rope_parameters``, per layer type where the config has several; ``rope_scaling`` where a config still
    calls it so), and a ``prepare_inputs_for_generation`` that recomputes the sequence (``_compat``)."""
    text = model.config.get_text_config(decoder=True)
    max_pos = getattr(text, "max_position_embeddings", None)
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        params = {}
    flat = "rope_type" in params or "type" in params  # else one dict per layer type
    sets = [params] if flat else [p for p in params.values() if isinstance(p, dict)]
    limits = []
    for rope in sets:
        kind = str(rope.get("rope_type", rope.get("type", "default")))
        if "dynamic" in kind and isinstance(max_pos, int):  # transformers' own test: any type that says "dynamic"
            limits.append(RopeLimit(max_pos, f"dynamic NTK RoPE (rope_type={kind!r}) rescales its frequencies in a "
                                             f"forward longer than max_position_embeddings={max_pos}", False))
        elif kind == "longrope":
            original = (rope.get("original_max_position_embeddings")
                        or getattr(text, "original_max_position_embeddings", None) or max_pos)
            if isinstance(original, int):
                limits.append(RopeLimit(original, "longrope RoPE takes its long factors in a forward longer than "
                                                  f"original_max_position_embeddings={original}", True))
    recomputed = cache_recomputed_past(model)
    if recomputed is not None:
        limits.append(RopeLimit(recomputed, f"{type(model).__name__}.generate recomputes the whole sequence once it is "
                                            f"longer than original_max_position_embeddings={recomputed}", True))
    return limits


def rope_reason(model, grouping: Grouping, T: int, n_pad: torch.Tensor, n_new: int) -> str | None:
    """Why this call must run stock because of ``rope_limits``, or ``None``. ``T``: prompt columns; ``n_pad`` ``[B]``
    left pads; ``n_new``: new tokens at most. The call reaches the longer of the stock prompt and relay's layout
    (whose columns can outnumber it under several prefixes; Phi-3's recompute counts columns) plus its new tokens:
    relay serves it when that stays within a limit, or, past a limit that allows it, when every shared prefix is
    longer than the limit (then every forward is past it, relay's as stock's)."""
    limits = rope_limits(model)
    if not limits:
        return None
    lengths = grouping.prefix_lengths()
    columns = max(lengths) + max(T - n - p for n, p in zip(n_pad.tolist(), lengths))
    reach = max(T, columns) + n_new
    roots = [n for n, parent in zip(grouping.tree.lengths, grouping.tree.parents) if parent < 0]
    for limit in limits:
        if reach > limit.positions and not (limit.beyond and min(roots) > limit.positions):
            return (f"the call can reach {reach} positions (prompt + new tokens) and the model's {limit.what}: relay "
                    "prefills the shared prefix alone, at its own length, so its KV would not be stock's")
    return None


def _generate_params(model) -> set[str]:
    sig = inspect.signature(type(model).generate)
    return {n for n, p in sig.parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def resolve(model, call: dict) -> GenerationConfig:
    """The generation config stock ``generate`` would run this call with (one resolution per call)."""
    params = _generate_params(model)
    kwargs = {k: v for k, v in call.items() if k not in params}
    return resolve_generation_config(model, call.get("generation_config"), kwargs)[0]


def new_tokens(model, call: dict, gen: GenerationConfig, T: int) -> int:
    """How many tokens stock ``generate`` makes at most for ``T`` prompt columns (its ``_prepare_generated_length``):
    ``max_new_tokens``, else ``max_length - T``, where an unset ``max_length`` means 20 new tokens capped at the
    model's ``max_position_embeddings``."""
    if gen.max_new_tokens is not None:
        return gen.max_new_tokens
    passed = call.get("generation_config")
    default = (call.get("max_length") is None and (passed is None or passed.max_length is None)
               and model.generation_config.max_length is None)
    if default:
        max_length = gen.max_length + T
        max_pos = getattr(model.config, "max_position_embeddings", None)
        return (min(max_length, max_pos) if max_pos is not None else max_length) - T
    return gen.max_length - T


def loop_reason(model, gen: GenerationConfig, call: dict, n_new: int) -> str | None:
    """Why relay_hf's decode loop cannot run this call (then transformers' loop runs it), or ``None``. Logits
    processors are judged by ``decode.loop_sampler``."""
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


def loop_wanted(model, gen: GenerationConfig) -> str | None:
    """Why this call would not decode on relay_hf's loop even if it could, or ``None``: the loop runs by default on
    CUDA (``patch(model, decode="auto")``), anywhere with ``decode="graph"`` / ``"compile"``, and for a call that asks
    for a compiled decode the transformers way (``cache_implementation="static"`` or a ``compile_config``)."""
    mode = model._relay_state.decode
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


def check_cache(model, cache: RelayCache, ids: torch.Tensor, n_pad: torch.Tensor) -> Grouping:
    """Each row's path in ``cache``'s prefixes; raise ``ValueError`` naming what makes ``cache`` unusable for these
    rows on this model (a row that starts with none of its prefixes: which row, and where it differs)."""
    # a cache a call returned (a fork: its prefixes, and suffixes the new call lays out again) serves as well as the
    # one it was forked from
    if cache.tree is None or cache.layers[0].prefix_keys is None:
        raise ValueError("RelayCache holds no prefix; build it with RelayCache.from_prefix(model, prefix_ids)")
    if cache.config is not model.config:
        raise ValueError("RelayCache was built for another model (its config is not this model's): build one with "
                         "RelayCache.from_prefix(model, prefix_ids) for this model")
    text = model.config.get_text_config(decoder=True)
    if len(cache.layers) != text.num_hidden_layers:
        raise ValueError(f"RelayCache has {len(cache.layers)} layers, the model has {text.num_hidden_layers}")
    k = cache.layers[0].prefix_keys
    if k.dtype != model.dtype:
        raise ValueError(f"RelayCache prefix dtype is {k.dtype} but the model runs in {model.dtype}")
    if k.device != model.device:
        raise ValueError(f"RelayCache prefix is on {k.device} but the model is on {model.device}")
    # the cache a grouped call returned (a fork with groups) continues all of that call's rows, those that read no
    # prefix too; a cache the user built refuses a row under none of its prefixes (a tokenization slip, most likely)
    allow_none = cache.groups is not None
    return Grouping(cache.tree, tuple(cache.tree.match(ids, n_pad, allow_none)))


def kept_prefix(model, row: torch.Tensor) -> torch.Tensor | None:
    """The longest prefix the model's store keeps from position 0 that ``row`` (``[T]`` ids, no padding) starts with
    and that leaves it a token and is at least ``min_prefix_length`` long, or ``None``: a one-row call (a chat turn)
    under a system prompt an earlier call kept reads it instead of prefilling it again."""
    store = model._relay_state.store
    if not len(store) or keep_reason(model) is not None:  # (whether it was kept for the model as it is now, the
        return None                                        # prefill's store lookup checks)
    best = None
    for start, key in store.keys():
        n = len(key) // 8  # int64 ids
        if start or not max(1, model._relay_state.min_prefix_length) <= n < row.numel():
            continue
        if best is None or n > best.numel():
            ids = torch.frombuffer(bytearray(key), dtype=torch.int64)
            if torch.equal(row[:n].cpu(), ids):
                best = ids
    return best


def batch_grouping(model, ids: torch.Tensor, n_pad: torch.Tensor, rows: int, captured: bool) -> Grouping:
    """What this batch's rows share (``prefix.find_groups``), or raise ``RunStock`` with why relay does not pay. One
    input row shares nothing; on the captured loop it still runs relay with its prompt but the last token as the
    prefix."""
    state = model._relay_state
    B = ids.shape[0]
    kept = kept_prefix(model, ids[0, int(n_pad[0]):]) if B == 1 else None
    if kept is not None:  # a chat turn under a kept system prompt: only the rest is prefilled
        return Grouping(PrefixTree((kept,), (-1,)), ((0,),))
    if B == 1:
        P = int(ids.shape[1] - n_pad[0]) - 1 if captured or rows > 1 else 0
        grouping = None if P < 1 else Grouping(PrefixTree((ids[0, int(n_pad[0]):int(n_pad[0]) + P].cpu(),), (-1,)),
                                                ((0,),))
    else:
        grouping = find_groups(ids, n_pad, state.min_prefix_length)
    if grouping is None:
        P = common_prefix_length(ids, n_pad) if rows > 1 or captured else 0
        raise RunStock(relay_pays(rows, P, model.device, state.min_prefix_length, captured) or
                     f"no rows share min_prefix_length={state.min_prefix_length} tokens", expected=True)
    per = rows // B
    why = relay_pays(rows, min(grouping.tree.lengths), model.device, state.min_prefix_length, captured,
                     grouping.shared_tokens() * per)
    if why:
        raise RunStock(why, expected=True)
    return grouping


def user_cache(call: dict):
    return next((call[n] for n in CACHE_NAMES if call.get(n) is not None), None)


def decide(model, call: dict) -> Plan:
    """The plan for one patched ``generate`` call (``call``: its arguments by name). Raises ``ValueError`` for input
    stock would accept but that cannot be right (a ``RelayCache`` that does not fit the model or the rows)."""
    try:
        return _decide(model, call)
    except RunStock as why:
        return Plan(False, str(why), expected=why.expected)


def _decide(model, call: dict) -> Plan:
    eligible(model, call)
    gen = resolve(model, call)
    served_config(gen, call)
    ids, mask, n_pad = input_rows(call, gen)
    B, T = ids.shape
    rows = B * max(gen.num_beams or 1, gen.num_return_sequences or 1)
    n_new = new_tokens(model, call, gen, T)
    if n_new < 1:
        raise RunStock("no new tokens to generate", expected=True)
    loop_why, sampler = which_loop(model, gen, call, ids, mask, n_new)
    fast = loop_why is None
    captured = fast and model.device.type == "cuda"  # relay_hf's loop as CUDA graphs
    cache = user_cache(call)
    grouping = check_cache(model, cache, ids, n_pad) if cache is not None else batch_grouping(model, ids, n_pad, rows,
                                                                                           captured)
    prefix_lengths = grouping.prefix_lengths()
    P = max(prefix_lengths)
    max_pos = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if max_pos is not None and P > max_pos:
        raise RunStock(f"shared prefix of {P} tokens is longer than max_position_embeddings ({max_pos})",
                       expected=True)
    why = rope_reason(model, grouping, T, n_pad, n_new)
    if why is not None:
        raise RunStock(why)
    static, compiled = static_shape(model, gen, cache, grouping, fast)
    capacity = 0
    if static:  # rounded up so similar calls reuse one captured step
        suffix = max(T - int(n) - p for n, p in zip(n_pad.tolist(), prefix_lengths))
        capacity = -(-(suffix + n_new) // STATIC_ROUNDING) * STATIC_ROUNDING
    return Plan(True, "relay", rows=rows, prefix_length=P, static=static, fast_decode=fast,
                loop_reason="relay_hf decode loop" if fast else loop_why,
                decode_step=decode_step(model, gen, fast, compiled), new_tokens=n_new, static_capacity=capacity,
                static_rows=DEFAULT_DECODE.bucket(rows) if fast else rows, ids=ids, mask=mask, n_pad=n_pad,
                user_cache=cache, grouping=grouping, gen=gen, compile_config=compiled, sampler=sampler)


def eligible(model, call: dict) -> None:
    """Can relay serve this model and these arguments at all? Raises ``RunStock`` if not: the model (patched, not
    declined, in eval mode), the cache (a ``RelayCache`` or none), the ids (2D integer, on the model's device), and no
    argument that relay does not serve."""
    why = model_reason(model)
    if why is not None:
        raise RunStock(why, expected=True)
    if model.training:  # dropout draws its random numbers in another order once the prefix is prefilled apart
        raise RunStock(TRAINING)
    cache = user_cache(call)
    if cache is not None and not isinstance(cache, RelayCache):
        raise RunStock(f"a {type(cache).__name__} was passed as the cache", expected=True)
    ids = call.get("inputs", call.get("input_ids"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.shape[1] == 0:
        raise RunStock("relay needs 2D integer input_ids", expected=True)
    if ids.device != model.device:
        raise RunStock(f"input_ids on {ids.device}, the model on {model.device}", expected=True)
    for key in _STOCK_KWARGS:
        if call.get(key) is not None:
            raise RunStock(f"`{key}` is not supported by the relay path")
    for key in ("logits_processor", "stopping_criteria"):
        builtin = [type(p).__name__ for p in call.get(key) or () if type(p).__module__.startswith("transformers.")]
        if builtin:  # generate replaces its own processor of the same type by the user's, in place
            raise RunStock(f"`{key}` holds transformers' own {builtin[0]}, which generate merges with its own by "
                           "type")


def served_config(gen: GenerationConfig, call: dict) -> None:
    """Does the resolved generation config ask only for what relay serves? Raises ``RunStock`` naming the first
    field that reads the prompt's token order or positions, or a cache relay does not build."""
    for key, off in _STOCK_FIELDS.items():
        if getattr(gen, key, None) not in off:
            raise RunStock(f"`{key}` depends on the prompt's token order or positions; relay_hf runs it on stock "
                           "generate")
    if gen.stop_strings is not None and call.get("tokenizer") is None:
        raise RunStock("`stop_strings` without a tokenizer", expected=True)  # stock raises its own error
    if gen.use_cache is False:
        raise RunStock("use_cache=False")
    if gen.cache_implementation not in (None, "static"):
        raise RunStock(f"cache_implementation={gen.cache_implementation!r} is not supported by the relay path")


def input_rows(call: dict, gen: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [B, T], mask [B, T], n_pad [B])``: the rows and their left padding; raises ``RunStock`` for a mask
    relay cannot lay out (custom, right padding, pads without a mask)."""
    ids = call.get("inputs", call.get("input_ids"))
    mask = call.get("attention_mask")
    if mask is None:
        if gen.pad_token_id is not None and bool((ids == gen.pad_token_id).any()):
            raise RunStock("no attention_mask for a batch that contains pad tokens")
        mask = torch.ones_like(ids)
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        raise RunStock("a custom attention_mask (not a [B, T] padding mask)")
    n_pad = left_padding(mask)
    if n_pad is None:
        raise RunStock("rows are not left-padded")
    return ids, mask, n_pad


def which_loop(model, gen: GenerationConfig, call: dict, ids: torch.Tensor, mask: torch.Tensor,
               n_new: int) -> tuple[str | None, Sampler | None]:
    """Which loop decodes: ``(None, sampler)`` for relay_hf's loop, ``(why not, None)`` for transformers'. Raises
    ``RunStock`` where only stock is right (a repetition penalty off relay_hf's loop reads where the pads are)."""
    why = loop_wanted(model, gen) or loop_reason(model, gen, call, n_new)
    sampler = None
    if why is None:
        sampler = loop_sampler(model, gen, ids, mask)
        if isinstance(sampler, str):
            why, sampler = f"{sampler} runs on transformers' loop", None
    if gen.repetition_penalty not in (None, 1.0) and why is not None:
        raise RunStock(f"`repetition_penalty` off relay_hf's loop ({why}) depends on the prompt's token order; "
                       "relay_hf runs it on stock generate")
    return why, sampler


def static_shape(model, gen: GenerationConfig, cache: RelayCache | None, grouping: Grouping,
                 fast: bool) -> tuple[bool, CompileConfig | None]:
    """``(static, compile_config)``: whether the call runs on a static ``RelayCache``, and the inductor config its
    decode step compiles with (``None``: eager, captured as CUDA graphs on CUDA)."""
    asked_static = gen.cache_implementation == "static" or gen.compile_config is not None
    # attention reads through PrefixGroups tables: several prefixes, or sliding-window layers that store only what
    # their window sees (each row's positions then come from the tables)
    if cache is not None:
        trimmed = any(lay.window is not None for lay in cache.layers)
    else:
        trimmed = any(trim_window(w, grouping.tree.lengths) is not None for w in layer_windows(model))
    tables = not grouping.single or trimmed
    # a static RelayCache for relay_hf's loop, and for transformers' loop when the call asks for one (without tables:
    # transformers' compiled loop would bake one call's tables into its graphs)
    static = fast or (asked_static and (gen.num_beams or 1) == 1 and not tables)
    # with tables relay_hf's loop replays the captured eager step: the tables change per call in place, which an
    # inductor graph would have to guard on
    compiled = (compile_config(model, gen) if fast and not tables
                and (asked_static or model._relay_state.decode == "compile" or compiled_by_default(model))
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
    if model._relay_state.decode == "compile" and not gen.disable_compile and compile_config(model, gen) is None:
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
    return (model._relay_state.decode == "auto" and model.device.type == "cuda"
            and model.dtype in (torch.float16, torch.bfloat16))
