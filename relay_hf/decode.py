"""relay_hf's own decode loop over a static ``RelayCache``: greedy search or sampling, each step replayed as CUDA
graphs on CUDA, the host looking only every ``DecodeConfig.chunk`` steps.

Why: transformers' ``generate`` loop synchronises with the GPU after every token (``this_peer_finished``, the
streamer), so the GPU idles for part of every step while the host catches up (docs/performance.md, "What limits it";
measured by ``benchmarks/generate.py``). Here a step is two graph replays and nothing else:

* the forward (``_forward``): the model on the last tokens of ``rows`` rows, where ``rows`` is the batch rounded up to
  a capture size (``DecodeConfig.row_buckets``), so a new batch size reuses the graph of its bucket; the extra rows are
  copies of row 0 whose tokens are dropped. Eager ops captured as they are, or compiled by inductor first (the
  default for fp16 / bf16 on CUDA, ``policy.compiled_by_default``; ``decode="compile"``; or a call that asks for a
  compiled decode the transformers way): one decoder layer compiled for all layers, buckets and prompt lengths
  (``regional.py``), its artifacts kept across processes (``artifacts.py``);
* the choice (``_choose``): stock's own logits processors and draw for the real rows, as eager ops (so every score is
  what stock computes, bit for bit), captured too. The draw is ``torch.multinomial``'s own one-sample algorithm
  (``argmax(probs / Exp(1) noise)``) without its host-side value check, on the device generator, so a seeded call
  draws what stock draws.

The host keeps what a per-step loop would: EOS and stop strings per row (finished rows get ``pad``), the streamer
(tokens arrive one step at a time, a chunk at a time), and the generator's offset, rewound to where stock's would be
when the last chunk ran past the stop. ``loop_sampler`` says what the loop cannot reproduce; ``policy`` then sends
the call to transformers' loop.

The loop has gpt-fast's shape: ``_prefill`` (the rows' own tokens), then ``DecodeStep`` once per token, ``decode.chunk``
steps between host looks. A step's forward and choice each live through named states: ``Warming(left)`` eager steps,
then ``Captured(graph)``, or ``Eager(reason)`` (off CUDA, or the capture failed: warned once, never retried); the
choice is ``Pending`` until its forward replays.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from . import artifacts
from ._compat import cache_kwarg_name, logits_processors, optimized_for_decode
from .regional import decode_view, decoder_layers, region_function

logger = logging.getLogger("relay_hf")


@dataclass(frozen=True)
class DecodeConfig:
    """How relay_hf's loop runs (defaults in ``DEFAULT_DECODE``; pass another to ``fast_generate``).

    Attributes:
        chunk: decode steps between host looks on CUDA (all rows done?, stop strings, streamer puts). Off CUDA the
            host looks every step: it waits for each step there anyway.
        row_buckets: batch sizes the forward is captured for; a batch runs at the smallest bucket that holds it
            (beyond the last, a multiple of ``row_step``), so a new batch size costs no new capture or compile. Powers
            of two: a decode step reads the weights whatever the rows, so padded rows cost little (48 rows run as 64:
            docs/performance.md), and fewer buckets mean fewer kernel variants to build.
        row_step: rounding of batches beyond the last bucket.
        capture_blas: BLAS library preferred while the step warms up and is captured, for 16-bit models on CUDA
            (``None``: leave torch's choice). The step's GEMMs are skinny (a row per sequence), and cuBLASLt's
            kernels for them made the captured bf16 step faster on an H200 (measured with ``benchmarks/generate.py``).
            The process-wide preference is restored right after.
        step_inductor_options: inductor options for a compiled forward on CUDA, under the user's
            ``CompileConfig.options``. Combo kernels launch a layer's small independent kernels (norms, RoPE, cache
            writes) together, which shortened the compiled step (docs/performance.md, the ``relay_compiled`` rows;
            ``benchmarks/generate.py``). ``()``: inductor's defaults.
    """

    chunk: int = 16
    row_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    row_step: int = 64
    capture_blas: str | None = "cublaslt"
    step_inductor_options: tuple[tuple[str, object], ...] = (("combo_kernels", True),)

    def bucket(self, rows: int) -> int:
        """The capture size that serves ``rows`` rows."""
        for size in self.row_buckets:
            if rows <= size:
                return size
        return -(-rows // self.row_step) * self.row_step


DEFAULT_DECODE = DecodeConfig()

# stock's processors that read nothing but the scores and never wait for the device: the loop calls them as they are
_SCORE_ONLY = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
               "TypicalLogitsWarper", "EpsilonLogitsWarper", "LogitNormalization"}
# stock's processors the loop reproduces from its own device state (EOS ban while too short; repetition penalty)
_EOS_BAN = {"MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"}
_PENALTY = "RepetitionPenaltyLogitsProcessor"


@dataclass(frozen=True, eq=False)
class Sampler:
    """How the loop turns a step's logits into tokens, as stock's processors and token selection do.

    Attributes:
        sample: draw from the processed distribution (``do_sample``), else argmax.
        warpers: stock's own score-only processors for this call, in stock's order (they follow the penalty and the
            EOS ban in stock's list too).
        penalty: the repetition penalty, or ``None``. ``seen``: ``[B, V]`` bool, the prompt tokens stock's
            processor penalises (read off that processor itself, so its padding rule is stock's); generated tokens
            join per step.
        eos: ``None`` without EOS, else ``(ids [E] int64, columns [V] bool)`` on the model's device; ``min_k``:
            tokens before which EOS is banned (``min_new_tokens`` / ``min_length``); ``pad``: the finished rows'
            token.
        key: what a captured choice bakes in (the warpers' settings, the penalty, EOS ids, pad).
    """

    sample: bool
    warpers: tuple
    penalty: float | None
    seen: torch.Tensor | None
    eos: tuple | None
    min_k: int
    pad: int
    key: tuple


def _settings(processor) -> tuple:
    return type(processor).__name__, tuple(sorted((k, repr(v)) for k, v in vars(processor).items()))


def loop_sampler(model, gen: GenerationConfig, ids: torch.Tensor, mask: torch.Tensor) -> Sampler | str:
    """The ``Sampler`` for this call (``ids`` / ``mask`` ``[B, T]`` in stock layout), or why the loop cannot
    reproduce stock's processing: stock's own processor list is built and each entry must be one the loop runs."""
    head = getattr(model.get_output_embeddings(), "weight", None)
    if not isinstance(head, torch.Tensor):
        return "a model without an output embedding (its vocabulary size is unknown before a forward)"
    vocab = head.shape[0]  # the logits' last dimension
    warpers, penalty, seen = [], None, None
    for proc in logits_processors(model, gen, ids, mask):
        name = type(proc).__name__
        if not type(proc).__module__.startswith("transformers.") or name not in _SCORE_ONLY | _EOS_BAN | {_PENALTY}:
            return f"logits processor {name} (from `{_field_of(name)}`)"
        if name in _SCORE_ONLY:
            warpers.append(proc)
        elif warpers:  # the loop applies penalty and EOS ban before the warpers, as stock's list orders them
            return f"logits processor {name} after {type(warpers[-1]).__name__}"
        elif name == _PENALTY:
            if (gen.num_return_sequences or 1) > 1:
                return "repetition_penalty with num_return_sequences > 1"
            penalty = proc.penalty
            seen = proc(ids, torch.ones(ids.shape[0], vocab, device=ids.device)) != 1  # [B, V] what stock penalises
    eos = None
    if gen.eos_token_id is not None:
        eos_ids = torch.tensor(gen.eos_token_id, device=model.device).reshape(-1)
        # isin, as stock's processors and criterion match: an id outside the vocabulary never matches
        eos = eos_ids, torch.isin(torch.arange(vocab, device=model.device), eos_ids)
    # stock's _prepare_generated_length: min_new_tokens, when set, replaces min_length (as min_new_tokens + T)
    min_k = gen.min_new_tokens if gen.min_new_tokens is not None else max(0, (gen.min_length or 0) - ids.shape[1])
    pad = gen.pad_token_id if gen.pad_token_id is not None else int(eos[0][0]) if eos is not None else 0
    sample = bool(gen.do_sample)
    key = (sample, tuple(_settings(w) for w in warpers), penalty,
           None if eos is None else tuple(eos[0].tolist()), int(pad))
    return Sampler(sample, tuple(warpers), penalty, seen, eos, min_k, int(pad), key)


def _field_of(processor_name: str) -> str:
    """The generation-config field a processor comes from, for a message (best effort)."""
    known = {"SuppressTokensLogitsProcessor": "suppress_tokens", "SuppressTokensAtBeginLogitsProcessor":
             "begin_suppress_tokens", "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
             "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id", "InfNanRemoveLogitsProcessor":
             "remove_invalid_values", "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
             "EtaLogitsWarper": "eta_cutoff", "TopHLogitsWarper": "top_h"}
    return known.get(processor_name, "generation config")


# -- the decode step: a forward and a choice, each in one of these states --------------------------------------------
WARM_UP_STEPS = 2  # eager steps before the forward is captured (compilation, autotuning, the allocator's first blocks)


@dataclass(frozen=True, slots=True)
class Warming:
    """The forward before its capture (CUDA only): ``left`` more eager steps, each on a side stream as torch's capture
    recipe warms up; at ``left == 0`` the next step captures it (``Captured``, or ``Eager`` when that fails)."""

    left: int


@dataclass(frozen=True, slots=True)
class Pending:
    """The choice before its capture: it reads the logits buffer of a captured forward, so the first step whose forward
    replays captures it (``Captured``, or ``Eager`` when that fails); until then it runs as eager ops."""


@dataclass(frozen=True, slots=True)
class Captured:
    """Replayed as ``graph`` every step, on the buffers it was recorded with."""

    graph: torch.cuda.CUDAGraph


@dataclass(frozen=True, slots=True)
class Eager:
    """Run as eager ops every step, for good; ``reason`` says why (off CUDA, or its capture failed: warned once and
    never retried, so a failing capture costs one attempt, not one a step)."""

    reason: str


class _Choice:
    """The choice for ``R`` real rows: its per-row device state (kept with its step, refilled per call) and its
    ``state`` (``Pending`` -> ``Captured`` / ``Eager``; ``Eager`` from the start when its forward runs eagerly).

    ``sampler`` stays the one the choice was made (and captured) with: a captured graph reads its EOS tensors, and
    ``key`` says a later call's sampler has the same settings, so ``start`` copies only the per-call values in."""

    def __init__(self, R: int, capacity: int, vocab: int, sampler: Sampler, device, state: Pending | Eager):
        self.R, self.sampler, self.key, self.state = R, sampler, (R, capacity, sampler.key), state
        self.k = torch.zeros((), dtype=torch.long, device=device)  # tokens made so far
        self.min_k = torch.zeros((), dtype=torch.long, device=device)
        self.pad = torch.tensor(sampler.pad, device=device)
        self.unfinished = torch.ones(R, dtype=torch.bool, device=device)  # [R]
        self.tokens = torch.zeros(R, capacity, dtype=torch.long, device=device)  # [R, capacity] made tokens
        self.seen = None if sampler.penalty is None else torch.zeros(R, vocab, dtype=torch.bool, device=device)

    def start(self, sampler: Sampler, rows_per_input: int) -> None:
        """Reset for a call whose sampler has this one's key (``rows_per_input``: return sequences per input)."""
        self.k.zero_()
        self.min_k.fill_(sampler.min_k)
        self.unfinished.fill_(True)
        if self.seen is not None:
            self.seen.copy_(sampler.seen.repeat_interleave(rows_per_input, 0))


def _choose(logits: torch.Tensor, choice: _Choice, tok: torch.Tensor) -> None:
    """One token per real row from ``logits [R, V]``, exactly as stock's ``_sample`` step: fp32 scores, repetition
    penalty, EOS ban while too short, stock's warpers, then argmax or the draw; ``pad`` for finished rows. Writes
    ``choice.tokens[:, k]`` and ``tok [R, 1]``, updates ``unfinished`` / ``seen`` / ``k`` in place."""
    s = choice.sampler
    scores = logits.float()
    if s.penalty is not None:  # RepetitionPenaltyLogitsProcessor's arithmetic on the tokens it would gather
        scores = torch.where(choice.seen, torch.where(scores < 0, scores * s.penalty, scores / s.penalty), scores)
    if s.eos is not None:  # Min(New)LengthLogitsProcessor: -inf on EOS while fewer than min_k tokens are made
        scores = torch.where(s.eos[1] & (choice.k < choice.min_k), -float("inf"), scores)
    for warper in s.warpers:
        scores = warper(None, scores)
    if s.sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        nxt = torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)  # torch.multinomial(probs, 1)
    else:
        nxt = torch.argmax(scores, dim=-1)
    if s.eos is not None:
        nxt = torch.where(choice.unfinished, nxt, choice.pad)
        choice.unfinished.logical_and_(~torch.isin(nxt, s.eos[0]))
    choice.tokens.index_copy_(1, choice.k.view(1), nxt[:, None])
    tok[:choice.R].copy_(nxt[:, None])
    if choice.seen is not None:
        choice.seen.scatter_(1, nxt[:, None], True)
    choice.k.add_(1)


def _forward(model, name: str, cache, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The model on ``tok [Rb, 1]`` at ``pos [Rb, 1]`` (then advanced); returns the last logits ``[Rb, V]``."""
    logits = model(input_ids=tok, position_ids=pos, use_cache=True, logits_to_keep=1, **{name: cache}).logits
    pos.add_(1)
    return logits[:, -1, :]


def _regional_forward(model, name: str, cache, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``_forward`` on ``regional.decode_view``'s copy of the model (its decoder layers compiled). A function of its
    own so that ``DecodeStep.compiled`` (``fn is not _forward``) holds for a regional step too."""
    return _forward(model, name, cache, tok, pos)


# the step's warnings name fast_generate's caller: the stacklevel of one raised in a method that ``__call__`` calls
# (that method, __call__, fast_generate, its caller), and of one raised a level further down
_WARN_IN_STEP, _WARN_BELOW_STEP = 4, 5


def _capture(fn, what: str) -> Captured | Eager:
    """``fn`` recorded as a CUDA graph and replayed once: ``Captured``. Nothing runs while recording, so when the
    capture fails the state is intact: ``Eager`` with the reason, after a warning (the caller does not try again)."""
    try:
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's eager work on the model (a concurrent stock call, a prefill) neither
        # breaks this capture nor is refused while it runs
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except Exception as err:  # noqa: BLE001 - decode on without the graph rather than lose the call
        reason = f"capturing the decode {what} failed ({type(err).__name__}: {err})"
        warnings.warn(f"relay_hf: {reason}; running it without a CUDA graph", RuntimeWarning,
                      stacklevel=_WARN_BELOW_STEP)
        return Eager(reason)
    graph.replay()
    return Captured(graph)


class DecodeStep:
    """The decode step on one static cache, at ``Rb`` rows (a bucket): the forward on ``tok`` / ``pos`` ``[Rb, 1]``
    int64, then ``choice``, the call's real rows' token choice (writes ``tok``). Kept with its cache
    (``state.StaticSlot.stepper``), so the next call that refills that cache replays the same graphs.

    ``state`` is the forward's life. On CUDA: ``Warming(WARM_UP_STEPS)``, one eager step less each step, then the
    step after the last captures it: ``Captured(graph)``, or ``Eager(reason)``. Off CUDA: ``Eager`` throughout. The
    choice follows its forward (``_Choice``). Apart from that, a compiled forward (``compile_config``) that fails to
    compile runs uncompiled from then on, after a warning (``compiled`` turns false); the failed step does not count
    as a warm-up step. The compiled forward is the model's forward over ``regional.decode_view`` (its decoder layers
    through the model's one compiled region) where ``layers`` (``regional.decoder_layers``'s answer for the model)
    names them, else the whole forward compiled."""

    def __init__(self, model, cache, rows: int, compile_config, key: tuple, decode: DecodeConfig,
                 layers: tuple[tuple[str, ...], torch.nn.ModuleList] | None = None):
        device = model.device
        self.key, self.decode = key, decode
        self.model, self.cache, self.name = model, cache, cache_kwarg_name(model)
        self.tok = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [Rb, 1] graph inputs
        self.pos = torch.zeros_like(self.tok)
        self.logits: torch.Tensor | None = None  # [Rb, V] of the last forward (a captured forward's own buffer)
        self.fn, self.runner, self.artifacts = _forward, model, None
        if compile_config is not None:
            kwargs = step_compile_kwargs(compile_config, device.type, decode.step_inductor_options)
            if layers is not None:  # one graph for every decoder layer, bucket and prompt length (regional.py)
                region = model._relay_state.region(
                    repr(kwargs), lambda: torch.compile(region_function(), dynamic=None, **kwargs))
                self.runner = decode_view(model, layers[0], cache, region)
                self.fn = _regional_forward
            else:
                self.fn = torch.compile(_forward, dynamic=False, **kwargs)
            if kwargs["backend"] == "inductor":  # what inductor compiles is kept across processes (artifacts.py)
                self.artifacts = artifacts.artifact_path(model, f"{'regional' if layers else 'whole'} {kwargs!r}")
                if self.artifacts is not None:
                    artifacts.load(self.artifacts)
        self.state: Warming | Captured | Eager = (Warming(WARM_UP_STEPS) if device.type == "cuda" else
                                                  Eager("CUDA graphs need a CUDA device"))
        self.choice: _Choice | None = None

    def __deepcopy__(self, memo):  # a CUDA graph cannot be copied; a copied model captures its own step
        return None

    @property
    def captures(self) -> bool:
        """Whether the forward is, or is still to be, a CUDA graph (the host then looks every ``decode.chunk`` steps,
        not every step)."""
        return self.state.__class__ is not Eager

    @property
    def compiled(self) -> bool:
        """Whether the forward runs compiled (asked for, and compiling has not failed)."""
        return self.fn is not _forward

    @property
    def kind(self) -> str:
        """How the step runs now, in ``policy.DECODE_STEPS``' words: ``"compiled"``, ``"cuda graph"`` (the eager
        forward captured, or warming up to be) or ``"eager ops"`` (off CUDA, or its capture failed). A compile or
        capture that fails moves it down this list for good (each warns)."""
        return "compiled" if self.compiled else "cuda graph" if self.captures else "eager ops"

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The forward's CUDA graph once captured, else ``None`` (for inspection; ``state`` says why)."""
        return self.state.graph if self.state.__class__ is Captured else None

    def choice_for(self, R: int, capacity: int, vocab: int, sampler: Sampler) -> _Choice:
        """The choice for this call's ``R`` real rows (``capacity`` tokens at most, ``vocab`` logits): the last one,
        captured graph and all, when its settings match, else a new one."""
        if self.choice is None or self.choice.key != (R, capacity, sampler.key):
            state = Eager(self.state.reason) if self.state.__class__ is Eager else Pending()
            self.choice = _Choice(R, capacity, vocab, sampler, self.tok.device, state)
        return self.choice

    def __call__(self) -> None:
        """One decode step: the forward, then the choice for ``self.choice`` (the host never waits here on CUDA)."""
        state = self.state
        if state.__class__ is Captured:
            state.graph.replay()
        elif state.__class__ is Eager:
            self._run_eagerly(None, _WARN_IN_STEP)
        else:
            self._warm_up_or_capture(state)
        choice = self.choice
        if choice.state.__class__ is Captured:
            choice.state.graph.replay()
        else:
            self._choose_uncaptured(choice)

    def _warm_up_or_capture(self, state: Warming) -> None:
        with preferred_blas(self.decode.capture_blas, self.model.dtype):
            if state.left > 0:
                if self._run_eagerly(torch.cuda.Stream(), _WARN_BELOW_STEP):
                    self.state = Warming(state.left - 1)
                return

            def record():
                self.logits = self._run()

            self.state = _capture(record, "step")
            if self.state.__class__ is Eager:  # nothing ran: this step runs eagerly, and so does the choice
                self.logits = self._run()
                self.choice.state = Eager(self.state.reason)
            elif self.compiled and self.artifacts is not None:
                artifacts.save(self.artifacts)

    def _run_eagerly(self, side: torch.cuda.Stream | None, stacklevel: int) -> bool:
        """The forward as eager ops, on the ``side`` stream when given (a warm-up step). ``False`` when the compiled
        forward failed and the step ran uncompiled instead."""
        # a compiled region may fail at any layer, after the layers before it wrote this step's keys: their fill
        # positions are put back before the step runs again eagerly (else those layers would hold the token twice)
        marks = None if self.fn is _forward else self.cache.fill_marks()
        try:
            if side is None:
                self.logits = self._run()
            else:
                side.wait_stream(torch.cuda.current_stream())
                try:
                    with torch.cuda.stream(side):
                        self.logits = self._run()
                finally:
                    torch.cuda.current_stream().wait_stream(side)
            return True
        except Exception as err:  # noqa: BLE001 - a compile failure must not lose the user's call
            if marks is None:
                raise
            warnings.warn(f"relay_hf: compiling the decode step failed ({type(err).__name__}: {err}); decoding "
                          "eagerly", RuntimeWarning, stacklevel=stacklevel)
            self.cache.rewind(marks)
            self.fn, self.runner = _forward, self.model
            self.logits = self._run()
            return False

    def _run(self) -> torch.Tensor:
        return self.fn(self.runner, self.name, self.cache, self.tok, self.pos)

    def _choose_uncaptured(self, choice: _Choice) -> None:
        if choice.state.__class__ is Pending and self.state.__class__ is Captured:  # the logits buffer stays put
            choice.state = _capture(lambda: _choose(self.logits[:choice.R], choice, self.tok), "choice")
            if choice.state.__class__ is Captured:  # its capture replayed it once
                return
        _choose(self.logits[:choice.R], choice, self.tok)


@contextlib.contextmanager
def preferred_blas(library: str | None, dtype: torch.dtype | None):
    """``library`` (``DecodeConfig.capture_blas``) preferred inside the block for fp16/bf16 ``dtype`` (CUDA only),
    else nothing changes; the process-wide preference is restored on the way out."""
    pick = getattr(torch.backends.cuda, "preferred_blas_library", None)
    if library is None or pick is None or torch.version.hip or dtype not in (torch.float16, torch.bfloat16):
        yield
        return
    before = pick()
    try:
        pick(library)
    except RuntimeError:  # a build without it: nothing changed, nothing to restore
        before = None
    try:
        yield
    finally:
        if before is not None:
            pick(before)


def step_compile_kwargs(compile_config, device_type: str,
                        step_options: tuple = DEFAULT_DECODE.step_inductor_options) -> dict:
    """``torch.compile`` arguments for the decode step's forward from the user's ``CompileConfig``. The loop captures
    its own CUDA graph, so inductor's graph modes become their no-graph forms; on CUDA, inductor also gets
    ``step_options`` under the user's own options (``torch.compile`` takes a mode or options, so the mode's options
    are spelled out)."""
    mode = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}.get(compile_config.mode,
                                                                                      compile_config.mode)
    options = compile_config.options
    if compile_config.backend == "inductor" and device_type == "cuda" and step_options:
        from torch._inductor import list_mode_options, list_options

        known = set(list_options())  # an older torch without one of ours must still compile
        ours = {k: v for k, v in step_options if k in known}
        options = {**(list_mode_options(mode) if mode else {}), **ours, **(options or {})}
        mode = None
    return dict(fullgraph=compile_config.fullgraph, backend=compile_config.backend, mode=mode, options=options)


def _step_for(model, slot, rows: int, compile_config, decode: DecodeConfig) -> DecodeStep:
    """The slot's step if it was made for these settings, else a new one (announced: it captures or compiles). The
    kernel configuration in force is one of them: the captured launches, and the work tables a static cache of
    several prefixes lays out for the next call, follow it."""
    from .kernels.config import active_config

    compiled = None if compile_config is None else repr(compile_config.to_dict())
    key = rows, compiled, decode, active_config()
    if slot.stepper is not None and slot.stepper.key == key:
        return slot.stepper
    slot.stepper = None  # free the old graphs' pool first
    layers = None if compile_config is None else decoder_layers(model)
    if model.device.type == "cuda":
        how = "capturing"
        if compile_config is not None:
            how = ("compiling one decoder layer for all (kept in relay_hf.artifacts.cache_dir()) and capturing"
                   if layers is not None else "compiling it with inductor and capturing")
        logger.warning("relay_hf: one-time setup for %d rows x %d suffix positions: %s the decode step as CUDA graphs",
                       rows, slot.cache.layers[0].max_suffix_length, how)
    slot.stepper = DecodeStep(model, slot.cache, rows, compile_config, key, decode, layers)
    return slot.stepper


def _prefill(model, cache, ids: torch.Tensor, mask: torch.Tensor, rows: int):
    """The rows' own tokens after the cached prefix (``ids`` / ``mask`` ``[R, T]``, relay layout), at ``rows >= R``
    rows: the extra rows copy row 0. Returns the last logits ``[rows, V]``, and the last tokens and their next
    positions, ``[rows, 1]`` int64 each (the decode step's first inputs)."""
    fill = torch.zeros(rows - ids.shape[0], dtype=torch.long, device=ids.device)
    ids_b, mask_b = torch.cat([ids, ids[fill]]), torch.cat([mask, mask[fill]])
    pos = (mask_b.long().cumsum(-1) - 1).masked_fill(mask_b == 0, 0)  # stock's positions: pads get 0
    P = cache.prefix_length
    logits = model(input_ids=ids_b[:, P:], position_ids=pos[:, P:], use_cache=True, logits_to_keep=1,
                   **{cache_kwarg_name(model): cache}).logits[:, -1, :]
    return logits, ids_b[:, -1:], pos[:, -1:] + 1


class _Generator:
    """The device generator's offset before each draw, so the loop can leave it where stock's loop would (CUDA:
    the philox offset is host-side state, read and set without a sync)."""

    def __init__(self, device: torch.device, sample: bool):
        self.gen = None
        if sample and device.type == "cuda":
            self.gen = torch.cuda.default_generators[device.index if device.index is not None else
                                                     torch.cuda.current_device()]
        self.offsets: list[int] = []

    def mark(self) -> None:
        if self.gen is not None:
            self.offsets.append(self.gen.get_offset())

    def rewind(self, draws: int) -> None:
        """Undo the draws after the first ``draws``."""
        if self.gen is not None and draws < len(self.offsets):
            self.gen.set_offset(self.offsets[draws])


class _Finish:
    """Per-row stopping on the host, as stock's criteria decide it after each step: EOS, stop strings; a finished
    row's later tokens are ``pad``."""

    def __init__(self, prompt: torch.Tensor, sampler: Sampler, stop):
        self.prompt, self.sampler, self.stop = prompt, sampler, stop  # prompt [R, T] stock layout, on the CPU
        self.eos = None if sampler.eos is None else sampler.eos[0].cpu()  # [E] int64
        self.at = torch.full((prompt.shape[0],), -1, dtype=torch.long)  # step at which each row finished
        self.tokens = torch.empty(prompt.shape[0], 0, dtype=torch.long)  # [R, checked] after fixes

    def add(self, new: torch.Tensor) -> torch.Tensor:
        """Check the steps ``new [R, n]`` (on the CPU); returns the rows newly finished by a stop string."""
        by_stop = torch.zeros(new.shape[0], dtype=torch.bool)
        eos = self.eos
        for j in range(new.shape[1]):
            step = self.tokens.shape[1]
            done = self.at >= 0
            # stock pads a finished row only when EOS is one of its criteria; else stopped rows go on
            tok = new[:, j] if eos is None else torch.where(done, self.sampler.pad, new[:, j])
            self.tokens = torch.cat([self.tokens, tok[:, None]], 1)
            hit = torch.zeros_like(done)
            if eos is not None:
                hit |= torch.isin(tok, eos)
            if self.stop is not None:
                stopped = self.stop(torch.cat([self.prompt, self.tokens], 1), None).cpu()
                by_stop |= stopped & ~done & ~hit
                hit |= stopped
            self.at = torch.where(~done & hit, step, self.at)
        return by_stop

    def length(self) -> int:
        """Tokens stock keeps: through the step at which the last row finished, or all made so far."""
        return int(self.at.max()) + 1 if bool((self.at >= 0).all()) else self.tokens.shape[1]


def fast_generate(model, ids: torch.Tensor, mask: torch.Tensor, stock_ids: torch.Tensor, slot, sampler: Sampler,
                  streamer, compile_config, n_new: int, rows_per_input: int = 1, stop=None,
                  decode: DecodeConfig = DEFAULT_DECODE) -> torch.Tensor:
    """Generation on relay_hf's loop.

    Args:
        ids, mask: ``[B, T]`` in relay layout (shared prefix first, then each row's pads, then its own tokens).
        stock_ids: ``[B, T]`` the same rows in stock layout (what stop strings read).
        slot: a ``state.StaticSlot`` whose static ``RelayCache`` holds the prefix and has at least
            ``decode.bucket(R)`` rows, ``R = B * rows_per_input`` (``num_return_sequences``); the extra rows copy row
            0 and are dropped.
        sampler: from ``loop_sampler``. ``stop``: a stop-string criterion (stock's, on stock-layout ids) or ``None``.
        n_new: tokens to make at most.

    Prefills the rows' own tokens (the prefix is never recomputed), then decodes. Returns ``[R, T + n]`` int64
    sequences in relay layout, ``n`` as stock generate gives it (``n_new``, or fewer when every row has finished).
    """
    ids, mask = ids.repeat_interleave(rows_per_input, 0), mask.repeat_interleave(rows_per_input, 0)
    if streamer is not None:  # stock streams the prompt expanded to its return sequences
        streamer.put(ids.cpu())
    R = ids.shape[0]
    cache = slot.cache
    Rb = cache.layers[0].suffix_padding.shape[0]
    logits, last, pos = _prefill(model, cache, ids, mask, Rb)
    with optimized_for_decode(model):  # as stock's decode steps run (an MoE's experts: batched, capturable)
        step = _step_for(model, slot, Rb, compile_config, decode)
        choice = step.choice_for(R, cache.layers[0].max_suffix_length, logits.shape[-1], sampler)
        choice.start(sampler, rows_per_input)
        step.tok.copy_(last)
        step.pos.copy_(pos)
        rng = _Generator(ids.device, sampler.sample)
        rng.mark()
        _choose(logits[:R], choice, step.tok)
        made, sent = 1, 0
        chunk = decode.chunk if step.captures else 1
        finish = _Finish(stock_ids.repeat_interleave(rows_per_input, 0).cpu(), sampler, stop)
        while True:
            by_stop = finish.add(choice.tokens[:, finish.tokens.shape[1]:made].cpu())  # the host's one look
            if bool(by_stop.any()):
                choice.unfinished.masked_fill_(by_stop.to(ids.device), False)
            keep = finish.length()
            done = made >= n_new or keep < made or bool((finish.at >= 0).all())
            if streamer is not None:
                for j in range(sent, keep):
                    streamer.put(finish.tokens[:, j].clone())
                sent = keep
            if done:
                break
            for _ in range(min(chunk, n_new - made)):
                rng.mark()
                step()
                made += 1
    rng.rewind(keep)
    if streamer is not None:
        streamer.end()
    return torch.cat([ids, finish.tokens[:, :keep].to(ids.device)], 1)
