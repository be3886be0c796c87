"""Every relay-or-stock rule in one place: ``decide(model, call)`` returns one frozen ``Route`` per ``generate`` call.
Long because it is that one place: the rules read together, in the order ``decide`` asks them.

The rules, in the order they are checked:

1. the model: patched, not declined by ``patch``, still on the ``"relay"`` implementation (``model_reason``), and
   on CUDA relay's Triton kernel builds and agrees with the reference there (``kernel_check``);
2. the call: a ``RelayCache`` or no cache, 2D integer ids, no feature that reads the prompt's token order or needs
   per-position outputs (those run stock: relay reorders each row's pads behind the shared prefix), left padding;
3. the batch: shared prefixes that pay (``prefix.find_groups`` picks the system prompts, and blocks under them,
   that save the most KV reads; ``cost_reason``; numbers in docs/performance.md), or the prefixes of the caller's
   ``RelayCache`` (each row reads the longest it starts with), within the position range and the RoPE rules
   (``rope.py``);
4. the loop: relay_hf's decode loop (captured as CUDA graphs on CUDA; the default there, ``patch(model, decode=...)``
   chooses) where it reproduces stock token for token, else transformers' loop: on a static ``RelayCache`` when the
   call asks for one (``cache_implementation="static"``), else on a dynamic one (``loop_rules.py``).

The route only says what runs: what a call reads from the prefix store is taken when it runs (``kept.py``), under the
model's structure as read here once (``Route.depends``, ``state.walk``: the one walk of the model a call makes; a call
on relay_hf's loop whose prefix is all kept is routed under the model's latest walk and makes its own once its prefill
is launched: ``Route.deferred_walk``, ``confirm_walk``), and relay_hf's loop builds its ``sampling.Sampler`` from the
processors judged here. Stock routes carry ``expected``: ``False`` where the user would have gained from relay
(``generate`` then warns once per reason through the ``relay_hf`` logger); ``True`` for the ordinary cases (one row, a
short prefix, not patched).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import CompileConfig, GenerationConfig

from ._compat import (
    attn_implementation,
    decode_fast_path_available,
    kernels_available,
    masks_skip_paged_cache,
    resolve_generation_config,
)
from .cache import RelayCache
from .cache_check import check_cache
from .dependencies import Dependencies
from .flash import KERNEL_ID, check_reason
from .kernels.check import kernel_reason
from .loop_rules import decode_step, loop_choice_reason, loop_reason, static_shape
from .names import is_flash_name, is_paged_name, is_relay_name
from .prefix import Grouping, PrefixTree, common_prefix_length, find_groups, left_padding, split_at_pinned
from .rope import rope_reason
from .sampling import LoopProcessors, loop_processors
from .state import relay_state, walk
from .stats import head_shape, head_shapes
from .step import DEFAULT_DECODE
from .suffix_prefill import recorded_length

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
    prefilled; ``decode_step``: how relay_hf's loop runs each step (``loop_rules.DECODE_STEPS``; ``""`` off it), which
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
class Route:
    """One call's route, relay or stock, and what running it needs.

    Attributes:
        relay: relay serves the call; else stock ``generate`` runs it unchanged (a ``RelayCache`` argument removed).
        reason: ``"relay"`` or why not. ``expected``: a stock route the user would expect (no warning).
        rows: sequences decoded (batch x beams / return sequences). ``prefix_length``: shared tokens ``P``.
        static: a static (compileable) ``RelayCache``; ``fast_decode``: relay_hf's own decode loop decodes, compiled
            with ``compile_config`` (and captured as a CUDA graph on CUDA) where set (``loop_reason`` says why not).
        decode_step: how relay_hf's loop runs each step (``loop_rules.DECODE_STEPS``), ``""`` off it.
        new_tokens: tokens stock ``generate`` would make at most. ``static_capacity``: suffix positions of the
            static cache; ``static_rows``: its rows (on relay_hf's loop the batch rounded up to a capture size,
            ``DecodeConfig.bucket``); ``suffix_columns``: the layout's suffix columns at least (a recorded
            prefill's length, ``suffix_prefill.recorded_length``). ``ids`` / ``mask`` ``[B, T]``; ``n_pad`` ``[B]``
            left pads; ``user_cache``: the caller's ``RelayCache`` (never mutated); ``grouping``: what the rows
            share (the tree to prefill, or the caller's cache's, and each input row's path in it); ``gen``: the
            resolved config; ``processors``: stock's processors relay_hf's loop reproduces
            (``sampling.loop_processors``), from which the loop builds its sampler; ``depends``: what the prefixes
            it keeps depend on (``kept_dependencies``, ``None`` where the call keeps none); ``structure``: on
            relay_hf's loop, the model's structure as it is now (``dependencies.Dependencies.structure``), under
            which alone a static slot's recorded step and prefills are replayed (``state.StaticSlot.made_under``).
        deferred_walk: ``depends`` and ``structure`` are the model's latest walk (``RelayState.last_walk``), not one
            of the call's own: the call walks the model once its prefill is launched (``confirm_walk``) and is
            decided again where the model changed (``RouteChanged``). A call on relay_hf's loop whose every prefix
            segment is kept (a chat turn under a kept prompt): its first token does not wait for the walk
            (docs/performance.md, the chat turn).
        check_row: the kept prefix's check runs as row ``rows`` of the call's recorded prefill
            (``check_row.py``): relay_hf's loop on CUDA, every segment kept, a recorded length, a spare row
            (``DecodeConfig.check_row_bucket``, in ``static_rows``).
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
    suffix_columns: int = 0
    check_row: bool = False
    ids: torch.Tensor | None = field(default=None, repr=False)
    mask: torch.Tensor | None = field(default=None, repr=False)
    n_pad: torch.Tensor | None = field(default=None, repr=False)
    user_cache: RelayCache | None = field(default=None, repr=False)
    grouping: Grouping | None = field(default=None, repr=False)
    gen: GenerationConfig | None = field(default=None, repr=False)
    compile_config: CompileConfig | None = field(default=None, repr=False)
    processors: LoopProcessors | None = field(default=None, repr=False)
    depends: Dependencies | None = field(default=None, repr=False)
    structure: tuple | None = field(default=None, repr=False)
    deferred_walk: bool = False

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


class RouteChanged(Exception):
    """A route decided under the model's latest walk (``Route.deferred_walk``) that the call's own walk found out of
    date (``confirm_walk``): the model changed since. The call's work is thrown away, before anything of it was
    drawn, shown or counted, and the call is decided again."""


def confirm_walk(model, route: Route) -> None:
    """The walk a route decided under the model's latest walk (``Route.deferred_walk``) owes: raises
    ``RouteChanged`` where the model as it is now differs from what the route was decided under (its whole
    signature, the parameters' version counters included: kept prefixes depend on them). Nothing for other routes."""
    if route.deferred_walk and walk(model) != route.depends:
        raise RouteChanged("the model changed since its latest walk")


class RunStock(Exception):
    """Raised by the questions ``decide`` asks: run stock ``generate`` because of ``reason``. ``expected``: a case
    the user would expect to run stock (no warning)."""

    def __init__(self, reason: str, expected: bool = False):
        super().__init__(reason)
        self.expected = expected


def model_reason(model) -> str | None:
    """Why relay cannot serve ``model`` at all right now (not patched, declined by ``patch``, or switched to another
    attention implementation after it), or ``None``."""
    state = relay_state(model)
    if state is None:
        return NOT_PATCHED
    if state.declined is not None:
        return state.declined
    name = attn_implementation(model.config)
    if name == KERNEL_ID:  # a manager serves the model through relay's flash kernel, which stock forwards call too
        return "a continuous batching manager of this model runs relay's flash kernel; generate runs stock meanwhile"
    # a continuous-batching manager of this model runs under a name only continuous batching can call (5.17's
    # ``paged|`` names), or under relay's paged name, which newer versions let relay serve generate with
    if is_flash_name(name) or (is_paged_name(name) and not masks_skip_paged_cache()):
        raise ValueError("a continuous batching manager of this model is running, under the attention name "
                         f"{name!r} it needs; stop it before calling generate")
    if is_paged_name(name):
        return None
    if not is_relay_name(name):
        return f"the model's attention implementation was set to {name!r} after relay_hf.patch"
    return None


def kernel_check(model) -> str | None:
    """Why relay's Triton kernel cannot serve ``model`` on its GPU (``kernels.check``: ``patch``'s probe ran the
    reference), asked before each call that would run it; answered once per device, dtype and head shape."""
    if model.device.type != "cuda":
        return None
    shapes = sorted(head_shapes(model.config.get_text_config(decoder=True)))  # MLA's values: the reference serves
    return next(filter(None, (kernel_reason(model.device, model.dtype, *shape[:3]) for shape in shapes
                              if shape[2] == shape[3])), None)


def continuous_reason(model, cb_config) -> str | None:
    """Why a continuous-batching manager of ``model`` (``cb_config``: the ``ContinuousBatchingConfig`` asked for, or
    ``None``) must run stock continuous batching, or ``None``: relay serves its steps (``continuous_route``)."""
    return continuous_route(model, cb_config)[0]


def continuous_route(model, cb_config) -> tuple[str | None, str | None]:
    """``(why stock, why not the flash road)`` for a continuous-batching manager of ``model``.

    Relay serves on one of two roads. The flash road (``flash_reason`` is ``None``): transformers' own decode fast
    path runs relay's flash kernel (``flash.py``): block tables, CUDA graphs and compiled steps as stock has them.
    Else the host road: relay lays each step out on the host from the cache's read index (``paged.py``), so a step
    captured as a CUDA graph or compiled (which replays without the host) runs stock there. Models with
    sliding-window layers (transformers shares no blocks there) and training mode run stock on both."""
    why = model_reason(model)
    if why is None and model.training:
        why = TRAINING
    if why is not None:
        return why, None
    text = model.config.get_text_config(decoder=True)
    windowed = getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True)
    if windowed or set(getattr(text, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return "continuous batching shares no blocks of sliding-window layers", None
    not_flash = flash_reason(model, cb_config)
    if not_flash is None:
        return None, None
    graphs = getattr(cb_config, "use_cuda_graph", None)
    if graphs is True or (isinstance(graphs, tuple) and any(graphs)):
        return ("the continuous batching config asks for CUDA graphs, which replay without relay's per-step plan "
                f"(relay's flash kernel, which they could replay, is not used: {not_flash})"), not_flash
    if any(getattr(cb_config, name, None) for name in ("varlen_compile_config", "decode_compile_config",
                                                       "default_compile_level")):
        return ("the continuous batching config asks for a compiled step, which runs without relay's per-step plan "
                f"(relay's flash kernel is not used: {not_flash})"), not_flash
    return kernel_check(model), not_flash  # the host road runs relay's Triton kernel (the flash road its own)


def flash_reason(model, cb_config) -> str | None:
    """Why relay's flash kernel cannot serve ``model``'s continuous batching on transformers' decode fast path, or
    ``None``. That path exists for flash-compatible kernels on CUDA only."""
    if model.device.type != "cuda":
        return f"transformers takes its decode fast path on CUDA only (the model is on {model.device.type})"
    return flash_fit_reason(model, cb_config)


def flash_fit_reason(model, cb_config) -> str | None:
    """``flash_reason`` past the device: what the installed transformers offers, the model and the kernel's check."""
    if not decode_fast_path_available():
        return "the installed transformers has no decode fast path in continuous batching"
    if not kernels_available():
        return "the kernels package (at a version this transformers accepts) is not installed"
    if not getattr(model, "_supports_flash_attn", False):
        return f"{type(model).__name__} does not support flash attention implementations"
    if len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1:
        return "the model is split over several devices (hf_device_map)"
    if getattr(cb_config, "max_blocks_per_request", None) == 0:
        return "the continuous batching config turns the decode fast path off (max_blocks_per_request=0)"
    heads, kv_heads, head_dim, value_dim = head_shape(model.config.get_text_config(decoder=True))
    if head_dim > 256 or heads % kv_heads or model.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"relay's flash kernel serves head sizes up to 256 in fp16, bf16 or fp32 (head size {head_dim}, " \
               f"{model.dtype})"
    if value_dim != head_dim:
        return f"relay's flash kernel reads values of the keys' head size (keys {head_dim}, values {value_dim})"
    return check_reason(model.device, model.dtype, heads, kv_heads, head_dim)


def kept_dependencies(model) -> Dependencies | None:
    """``dependencies.kv_dependencies(model)`` (one walk of the model) when a call may read and keep prefixes in the
    model's prefix store now (``keeps_prefixes``), else ``None``."""
    return walk(model) if keeps_prefixes(model) else None


def keeps_prefixes(model) -> bool:
    """Whether a call may read and keep prefixes in the model's prefix store now: a budget, and no
    ``keep_reason``."""
    return relay_state(model).store.budget_bytes != 0 and keep_reason(model) is None


def keep_reason(model) -> str | None:
    """Why no prefix may be prefilled now and kept for later calls (a pipeline's system prompts), or ``None``: relay
    cannot serve the model (``model_reason``), or it is in training mode (its prefill would run dropout, and the
    KV kept would be a random draw, not the model's)."""
    return model_reason(model) or (TRAINING if model.training else None)


def runs_captured(model, fast: bool) -> bool:
    """Whether the call runs on relay_hf's loop as CUDA graphs (``fast``: on relay_hf's loop; the model on CUDA)."""
    return fast and model.device.type == "cuda"


def cost_reason(rows: int, prefix_length: int, device: torch.device, min_prefix_length: int,
                captured_loop: bool = False, shared_tokens: int | None = None) -> str | None:
    """``None`` when relay should serve this batch, else the reason it should not.

    ``prefix_length``: the shared prefix (with several, the shortest segment); ``shared_tokens``: rows x tokens read
    from shared prefixes (``rows * prefix_length`` when ``None``). A single row has nothing to share, except on
    relay_hf's captured loop (``captured_loop``, CUDA only), where the loop, not the kernel, decides: transformers'
    static loop is host-bound while the captured step replays back to back (benchmarks.generate, one row)."""
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


def resolve(model, call: dict) -> GenerationConfig:
    """The generation config stock ``generate`` would run this call with (one resolution per call)."""
    sig = inspect.signature(type(model).generate)
    params = {n for n, p in sig.parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
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


def kept_prefix(model, row: torch.Tensor) -> torch.Tensor | None:
    """The longest prefix the model's store keeps from position 0 that ``row`` (``[T]`` ids, no padding) starts with
    and that leaves it a token and is at least ``min_prefix_length`` long, or ``None``: a one-row call (a chat turn)
    under a system prompt an earlier call kept reads it instead of prefilling it again."""
    state = relay_state(model)
    store = state.store
    if not len(store) or keep_reason(model) is not None:  # (whether it was kept for the model as it is now, the
        return None                                        # prefill's store lookup checks)
    best = None
    for key in store.keys():  # store.PrefixKey
        n = key.tokens
        if key.start or not max(1, state.min_prefix_length) <= n < row.numel():
            continue
        if best is None or n > best.numel():
            ids = key.ids()
            if torch.equal(row[:n].to("cpu", torch.int64), ids):
                best = ids
    return best


def batch_grouping(model, ids: torch.Tensor, n_pad: torch.Tensor, rows: int, captured: bool) -> Grouping:
    """What this batch's rows share (``prefix.find_groups``), or raise ``RunStock`` with why relay does not pay. One
    input row shares nothing; on the captured loop it still runs relay with its prompt but the last token as the
    prefix."""
    state = relay_state(model)
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
        pinned = [key.ids() for key in state.store.pinned() if not key.start]
        if grouping is not None and pinned and keep_reason(model) is None:
            grouping = split_at_pinned(grouping, pinned, state.min_prefix_length)
    if grouping is None:
        P = common_prefix_length(ids, n_pad) if rows > 1 or captured else 0
        raise RunStock(cost_reason(rows, P, model.device, state.min_prefix_length, captured) or
                     f"no rows share min_prefix_length={state.min_prefix_length} tokens", expected=True)
    per = rows // B
    why = cost_reason(rows, min(grouping.tree.lengths), model.device, state.min_prefix_length, captured,
                     grouping.shared_tokens() * per)
    if why:
        raise RunStock(why, expected=True)
    return grouping


def user_cache(call: dict):
    return next((call[n] for n in CACHE_NAMES if call.get(n) is not None), None)


def decide(model, call: dict, before_walk: Callable[[Grouping, bool], bool] | None = None,
           defer_walk: bool = False) -> Route:
    """The route of one patched ``generate`` call (``call``: its arguments by name). Raises ``ValueError`` for input
    stock would accept but that cannot be right (a ``RelayCache`` that does not fit the model or the rows).
    ``before_walk(grouping, check_row)``: called once the call is known to run relay over ``grouping`` and read the
    prefix store, before the model is walked (the caller launches the kept segments' checks there, so the device runs
    them while the host walks; ``check_row``: the call runs a check row where every segment is kept, so no check need
    be launched); it answers whether every segment is kept and every check recorded as a CUDA graph could be launched
    (none reads a tensor no longer where it was). ``defer_walk``: such a call on relay_hf's loop is then routed under
    the model's latest walk, where the store's entries were built under it (``Route.deferred_walk``): the caller owes
    ``confirm_walk`` before anything of the call is drawn or shown."""
    try:
        return _decide(model, call, before_walk, defer_walk)
    except RunStock as why:
        return Route(False, str(why), expected=why.expected)


def _decide(model, call: dict, before_walk: Callable[[Grouping, bool], bool] | None,
            defer_walk: bool) -> Route:
    eligible(model, call)
    gen = resolve(model, call)
    served_config(gen, call)
    ids, mask, n_pad = input_rows(call, gen)
    B, T = ids.shape
    rows = B * max(gen.num_beams or 1, gen.num_return_sequences or 1)
    n_new = new_tokens(model, call, gen, T)
    if n_new < 1:
        raise RunStock("no new tokens to generate", expected=True)
    loop_why, processors = which_loop(model, gen, call, ids, mask, n_new)
    fast = loop_why is None
    captured = runs_captured(model, fast)
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
    keeps = cache is None and keeps_prefixes(model)
    own = max(T - int(n) - p for n, p in zip(n_pad.tolist(), prefix_lengths))  # the longest row's own tokens
    # a spare row for the kept prefix's check, where a recorded prefill can have one (``check_row.py``): its rows and
    # the prefill's length, found once (a recording failing meanwhile in another thread changes neither)
    spare = DEFAULT_DECODE.check_row_bucket(rows) if keeps and captured and grouping.single else None
    spare_length = None if spare is None else recorded_length(model, spare, own)
    kept_whole = keeps and before_walk is not None and before_walk(grouping, spare_length is not None)
    # the call's one walk of the model: what kept prefixes depend on, and the structure relay_hf's loop replays its
    # slot's recorded step and prefills under (``state.StaticSlot.made_under``); deferred where the loop confirms it
    # (``confirm_walk``) once the prefill is launched: the walk is a 32-layer model's 2-4 ms of host time
    last = relay_state(model).last_walk if defer_walk and kept_whole and fast else None
    latest = None if last is None else last.depends()
    if latest is not None and not relay_state(model).store.built_under(latest):  # the walk or the store is stale
        latest = None
    walked = latest if latest is not None else walk(model) if keeps or fast else None
    depends = walked if keeps else None
    static, compiled = static_shape(model, gen, cache, grouping, fast, walked)
    capacity = suffix = 0
    static_rows, check_row = DEFAULT_DECODE.bucket(rows) if fast else rows, False
    if static:  # rounded up so similar calls reuse one captured step
        suffix = own
        if spare_length is not None and kept_whole:
            static_rows, check_row, suffix = spare, True, spare_length
        elif captured and grouping.single:  # laid out at a recorded prefill's length
            suffix = recorded_length(model, static_rows, suffix) or suffix
        capacity = -(-(suffix + n_new) // STATIC_ROUNDING) * STATIC_ROUNDING
    return Route(True, "relay", rows=rows, prefix_length=P, static=static, fast_decode=fast,
                 loop_reason="relay_hf decode loop" if fast else loop_why,
                 decode_step=decode_step(model, gen, fast, compiled), new_tokens=n_new, static_capacity=capacity,
                 static_rows=static_rows, suffix_columns=suffix, check_row=check_row, ids=ids, mask=mask,
                 n_pad=n_pad, user_cache=cache, grouping=grouping, gen=gen, compile_config=compiled,
                 processors=processors, depends=depends, structure=walked.structure if fast else None,
                 deferred_walk=latest is not None)


def eligible(model, call: dict) -> None:
    """Can relay serve this model and these arguments at all? Raises ``RunStock`` if not: the model (patched, not
    declined, in eval mode), the cache (a ``RelayCache`` or none), the ids (2D integer, on the model's device), and no
    argument that relay does not serve."""
    why = model_reason(model)
    if why is not None:
        raise RunStock(why, expected=True)
    if model.training:  # dropout draws its random numbers in another order once the prefix is prefilled apart
        raise RunStock(TRAINING)
    if (why := kernel_check(model)) is not None:
        raise RunStock(why)
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
    """``(ids [B, T], mask [B, T], n_pad [B])``: the rows and their left padding (``n_pad`` int64 on the CPU, read
    back once: the call's layout is worked out from it on the host, so nothing after a kept check's launch waits for
    the device); raises ``RunStock`` for a mask relay cannot lay out (custom, right padding, pads without a mask)."""
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
               n_new: int) -> tuple[str | None, LoopProcessors | None]:
    """Which loop decodes: ``(None, processors)`` for relay_hf's loop (``sampling.loop_processors``), ``(why not,
    None)`` for transformers'. Raises ``RunStock`` where only stock is right (a repetition penalty off relay_hf's loop
    reads where the pads are)."""
    why = loop_choice_reason(model, gen) or loop_reason(model, gen, call, n_new)
    processors = None
    if why is None:
        processors = loop_processors(model, gen, ids, mask)
        if isinstance(processors, str):
            why, processors = f"{processors} runs on transformers' loop", None
    if gen.repetition_penalty not in (None, 1.0) and why is not None:
        raise RunStock(f"`repetition_penalty` off relay_hf's loop ({why}) depends on the prompt's token order; "
                       "relay_hf runs it on stock generate")
    return why, processors


