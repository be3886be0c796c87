"""The decode step of relay_hf's loop on one static ``RelayCache``: the forward and the choice, each replayed as a
CUDA graph on CUDA (``DecodeStep``), and how the loop runs (``DecodeConfig``).

A step is two graph replays and nothing else:

* the forward (``_forward``): the model on the last tokens of ``rows`` rows, where ``rows`` is the batch rounded up to
  a capture size (``DecodeConfig.row_buckets``), so a new batch size reuses the graph of its bucket; the extra rows are
  copies of row 0 whose tokens are dropped. Eager ops captured as they are, or compiled by inductor first (the
  default for fp16 / bf16 on CUDA, ``loop_rules.compiled_by_default``; ``decode="compile"``; or a call that asks for a
  compiled decode the transformers way): one decoder layer compiled for all layers, buckets and prompt lengths
  (``regional.py``), its artifacts kept across processes (``artifacts.py``);
* the choice (``sampling.choose``): stock's own logits processors and draw for the real rows, as eager ops, captured
  too.

Each lives through named states (``graphs.py``): the forward ``Warming(left)`` eager steps, then ``Captured(graph)``,
or ``Eager(reason)`` (off CUDA, or the capture failed: warned once, never retried); the choice is ``Pending`` until
its forward replays.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass

import torch

from . import artifacts
from ._compat import cache_kwarg_name
from .graphs import Captured, Eager, Pending, Warming, capture_graph, on_side_stream
from .regional import decode_view, decoder_layers, region_function
from .sampling import Choice, Sampler, choose
from .state import relay_state

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
        prefill_lengths: suffix lengths (own tokens per row) a prefill under one prefix is recorded for as a CUDA
            graph (``suffix_prefill.py``); a shorter suffix is laid out at the next one, the extra columns masked as
            padding (at most a third of the tokens past 32, where their compute starts to count). Only up to
            ``prefill_tokens`` rows x length: beyond, the prefill's GPU time dwarfs its launches and a graph would
            only hold memory (``benchmarks/generate.py --only ttft``).
        compiled_prefill: record those prefills through the decode step's compiled decoder layer once the step runs
            compiled and captured (``DecodeStep.prefill_runner``): at 64 rows x 64 tokens the eager forward's
            elementwise kernels are a fifth of the prefill's device time, and inductor fuses them
            (docs/performance.md, the chat turn).
        check_row_rows: the most rows a call grows to for a spare row in which its prefill runs its kept prefix's
            check (``check_row.py``): a one-row turn runs at two, whose prefill and step read the weights once as
            one row's do; a full bucket keeps its size (at 64 rows the prefill is compute-bound, and the standalone
            check overlaps it).
    """

    chunk: int = 16
    row_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    row_step: int = 64
    capture_blas: str | None = "cublaslt"
    step_inductor_options: tuple[tuple[str, object], ...] = (("combo_kernels", True),)
    prefill_lengths: tuple[int, ...] = (16, 32, 48, 64, 96, 128, 192, 256)
    prefill_tokens: int = 4096
    compiled_prefill: bool = True
    check_row_rows: int = 2

    def prefill_length(self, rows: int, suffix: int) -> int | None:
        """The recorded suffix length that serves a prefill of ``suffix`` own tokens at ``rows`` rows (a bucket), or
        ``None``: that prefill runs as eager ops."""
        for length in self.prefill_lengths:
            if suffix <= length:
                return length if rows * length <= self.prefill_tokens else None
        return None

    def check_row_bucket(self, rows: int) -> int | None:
        """The rows a call of ``rows`` rows runs at to give its prefill a spare row for a check row: its bucket where
        that has one, else the next bucket while within ``check_row_rows``; ``None``: no spare row."""
        bucket = self.bucket(rows)
        if bucket > rows:
            return bucket
        grown = self.bucket(rows + 1)
        return grown if grown <= self.check_row_rows else None

    def bucket(self, rows: int) -> int:
        """The capture size that serves ``rows`` rows."""
        for size in self.row_buckets:
            if rows <= size:
                return size
        return -(-rows // self.row_step) * self.row_step


DEFAULT_DECODE = DecodeConfig()

WARM_UP_STEPS = 2  # eager steps before the forward is captured (compilation, autotuning, the allocator's first blocks)


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


def _capture(fn, what: str, device: torch.device) -> Captured | Eager:
    """``fn`` recorded as a CUDA graph on ``device`` and replayed once: ``Captured``. Nothing runs while recording, so
    when the capture fails the state is intact: ``Eager`` with the reason, after a warning (the caller does not try
    again)."""
    try:
        graph, _ = capture_graph(fn, device)
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
    choice follows its forward (``Choice``). Apart from that, a compiled forward (``compile_config``) that fails to
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
        self.fn, self.runner, self.artifacts, self.prefill_artifacts = _forward, model, None, None
        if compile_config is not None:
            kwargs = step_compile_kwargs(compile_config, device.type, decode.step_inductor_options)
            if layers is not None:  # one graph for every decoder layer, bucket and prompt length (regional.py)
                region = relay_state(model).region(
                    repr(kwargs), lambda: torch.compile(region_function(), dynamic=None, **kwargs))
                self.runner = decode_view(model, layers[0], cache, region)
                self.fn = _regional_forward
            else:
                self.fn = torch.compile(_forward, dynamic=False, **kwargs)
            if kwargs["backend"] == "inductor":  # what inductor compiles is kept across processes (artifacts.py)
                self.artifacts = artifacts.artifact_path(model, f"{'regional' if layers else 'whole'} {kwargs!r}")
                if layers is not None:  # a file of its own: written after the step's, once a prefill compiled
                    self.prefill_artifacts = artifacts.artifact_path(model, f"regional prefill {kwargs!r}")
                for path in (self.artifacts, self.prefill_artifacts):
                    if path is not None:
                        artifacts.load(path)
        self.state: Warming | Captured | Eager = (Warming(WARM_UP_STEPS) if device.type == "cuda" else
                                                  Eager("CUDA graphs need a CUDA device"))
        self.choice: Choice | None = None

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
        """How the step runs now, in ``loop_rules.DECODE_STEPS``' words: ``"compiled"``, ``"cuda graph"`` (the eager
        forward captured, or warming up to be) or ``"eager ops"`` (off CUDA, or its capture failed). A compile or
        capture that fails moves it down this list for good (each warns)."""
        return "compiled" if self.compiled else "cuda graph" if self.captures else "eager ops"

    @property
    def prefill_runner(self):
        """What the rows' own prefill on this step's cache is recorded through (``suffix_prefill.SuffixPrefill``):
        the step's compiled copy of the model (``regional.decode_view``) once the step runs compiled by regions and is
        captured, so the region compiled for this cache first and a slot's first call compiles no prefill; else
        ``None``: the model's eager forward, also for good once a compiled prefill failed on the model
        (``RelayState.prefill_uncompiled``)."""
        if (self.decode.compiled_prefill and self.fn is _regional_forward and self.state.__class__ is Captured
                and relay_state(self.model).prefill_uncompiled is None):
            return self.runner
        return None

    @property
    def compile_settings(self) -> str | None:
        """The compile settings the step was made for (``_step_key``; ``None``: not compiled)."""
        return self.key[1]

    def keep_prefill_compiled(self) -> None:
        """A prefill was recorded through ``prefill_runner``: what inductor compiled for it kept across processes
        (``artifacts.save``: once per process, so what the process compiles for prefills after that is not in the file;
        the step's own file was written before any prefill compiled)."""
        if self.prefill_artifacts is not None:
            artifacts.save(self.prefill_artifacts)

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The forward's CUDA graph once captured, else ``None`` (for inspection; ``state`` says why)."""
        return self.state.graph if self.state.__class__ is Captured else None

    def choice_for(self, R: int, capacity: int, vocab: int, sampler: Sampler) -> Choice:
        """The choice for this call's ``R`` real rows (``capacity`` tokens at most, ``vocab`` logits): the last one,
        captured graph and all, when its settings match, else a new one."""
        if self.choice is None or self.choice.key != (R, capacity, sampler.key):
            state = Eager(self.state.reason) if self.state.__class__ is Eager else Pending()
            self.choice = Choice(R, capacity, vocab, sampler, self.tok.device, state)
        return self.choice

    def __call__(self) -> None:
        """One decode step: the forward, then the choice for ``self.choice`` (the host never waits here on CUDA)."""
        state = self.state
        if state.__class__ is Captured:
            state.graph.replay()
        elif state.__class__ is Eager:
            self._run_eagerly(False, _WARN_IN_STEP)
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
                if self._run_eagerly(True, _WARN_BELOW_STEP):
                    self.state = Warming(state.left - 1)
                return

            def record():
                self.logits = self._run()

            self.state = _capture(record, "step", self.model.device)
            if self.state.__class__ is Eager:  # nothing ran: this step runs eagerly, and so does the choice
                self.logits = self._run()
                self.choice.state = Eager(self.state.reason)
            elif self.compiled and self.artifacts is not None:
                artifacts.save(self.artifacts)

    def _run_eagerly(self, warm_up: bool, stacklevel: int) -> bool:
        """The forward as eager ops, on a side stream for a warm-up step (``graphs.on_side_stream``). ``False`` when
        the compiled forward failed and the step ran uncompiled instead."""
        # a compiled region may fail at any layer, after the layers before it wrote this step's keys: their fill
        # positions are put back before the step runs again eagerly (else those layers would hold the token twice)
        marks = None if self.fn is _forward else self.cache.fill_marks()
        try:
            self.logits = on_side_stream(self._run, self.model.device) if warm_up else self._run()
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

    def _choose_uncaptured(self, choice: Choice) -> None:
        if choice.state.__class__ is Pending and self.state.__class__ is Captured:  # the logits buffer stays put
            choice.state = _capture(lambda: choose(self.logits[:choice.R], choice, self.tok), "choice",
                                    self.model.device)
            if choice.state.__class__ is Captured:  # its capture replayed it once
                return
        choose(self.logits[:choice.R], choice, self.tok)


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


def _step_key(rows: int, compile_config, decode: DecodeConfig) -> tuple:
    """What a step is made for: its rows, compile settings, loop settings and the kernel configuration in force (the
    captured launches, and the work tables a static cache of several prefixes lays out for the next call, follow
    it)."""
    from .kernels.config import active_config

    return rows, None if compile_config is None else repr(compile_config.to_dict()), decode, active_config()


def made_step(slot, rows: int, compile_config, decode: DecodeConfig) -> DecodeStep | None:
    """The slot's step if an earlier call made it for these settings, else ``None`` (nothing is made: a step is made
    after its cache's first prefill, which creates the buffers its compiled layer marks dynamic, ``regional.py``)."""
    step = slot.stepper
    return step if step is not None and step.key == _step_key(rows, compile_config, decode) else None


def step_for(model, slot, rows: int, compile_config, decode: DecodeConfig) -> DecodeStep:
    """The slot's step if it was made for these settings (``_step_key``), else a new one (announced: it captures or
    compiles)."""
    key = _step_key(rows, compile_config, decode)
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


