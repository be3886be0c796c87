"""The rows' own tokens (their suffixes) prefilled after a kept prefix, replayed as a CUDA graph per suffix length
(``SuffixPrefill``), kept with the static cache it writes (``state.StaticSlot.prefill``).

Why: a chat turn under a kept system prompt prefills a few dozen own tokens. Run as eager ops that is some thirty
launches per layer, so the host, not the GPU, sets the time to the first token (``benchmarks/generate.py --only
ttft``, docs/performance.md). Replayed, the same forward costs its GPU time.

How: ``policy`` lays such a call out at a suffix length of ``DecodeConfig.prefill_lengths`` (``recorded_length``; the
extra columns are left padding, masked like any pad, so the result is exact), so a few graphs per slot serve every
turn. A length's first prefill runs eagerly on a side stream (its plans made, its kernels built, the allocator's
blocks in place: torch's capture recipe) and gives the call its logits; the graph is recorded after it (recording
runs nothing) and replayed from the next call on. The graphs of one slot share one memory pool: each replay's logits
are read before anything else replays. Once the slot's decode step runs compiled and captured, a length is recorded
again through the step's compiled decoder layer (``DecodeConfig.compiled_prefill``): its norms, rotary embeddings and
activations fused, not some thirty elementwise kernels a layer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .freshness import addresses, allocated
from .graphs import Eager, capture_graph, on_side_stream
from .state import relay_state
from .stats import attention_windows
from .step import DEFAULT_DECODE, DecodeConfig


def recorded_length(model, rows: int, suffix: int, decode: DecodeConfig = DEFAULT_DECODE) -> int | None:
    """The length a prefill of ``suffix`` own tokens at ``rows`` rows is laid out at and recorded for (CUDA, one
    prefix: the caller's to check), or ``None``: it runs as eager ops at its own length. ``None`` also for a one-token
    suffix (a one-row call's own prefix leaves one: its slot serves that prompt's length only, so nothing would
    replay), for a model with sliding-window layers (their trimmed prefixes are read through work tables pinned for
    the decode step's shape) and once a recording failed on the model (``RelayState.prefill_eager``)."""
    if suffix < 2 or relay_state(model).prefill_eager is not None or any(attention_windows(model)):
        return None
    return decode.prefill_length(rows, suffix)


def prefill_logits(model, name: str, cache, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The model on ``ids`` / ``pos`` ``[Rb, L]`` int64 after the cache's prefix (``name``: the forward's cache
    argument); the last logits ``[Rb, V]``. As eager ops, or what a ``SuffixPrefill`` records."""
    return model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **{name: cache}).logits[:, -1, :]


@dataclass(frozen=True, eq=False)
class _Graph:
    """One length's recorded prefill: its inputs ``ids`` / ``pos`` ``[Rb, L]`` int64 and its output ``logits``
    ``[Rb, V]``, the buffers every replay reads and writes. Compared by identity, weakly referable: a kept check's
    reference row is kept per graph (``check_row.CheckRow.keep``)."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    pos: torch.Tensor
    logits: torch.Tensor


class SuffixPrefill:
    """Suffix prefills on one static cache, by (shape, kernel configuration, compile settings or ``None``): ``_Graph``
    once recorded, ``Eager`` when recording failed, absent before the first run. A failure (warned once) ends recording
    on the model (``RelayState.stop_recording_prefills``): what failed at one length (an MoE's data-dependent routing)
    fails at every other, and its calls are no longer laid out wider.

    Recorded through the decode step's compiled copy of the model where the call's ``step`` has one
    (``DecodeStep.prefill_runner``): a length's first run there compiles the decoder layer for the prefill's shape
    (kept across processes: ``DecodeStep.keep_prefill_compiled``), and the graph recorded after it replaces that
    length's eager one. Compiling or recording that fails (warned once) puts back the cache positions it wrote and
    records the eager forward, on this model from then on (``RelayState.stop_compiling_prefills``)."""

    def __init__(self, name: str):
        self.name = name  # the forward's cache argument (``_compat.cache_kwarg_name``)
        self.graphs: dict[tuple, _Graph | Eager] = {}
        self.pool = None  # the memory pool the graphs share
        # (weakref, where) of each parameter and buffer the graphs read, taken at the first recording
        # (``freshness.addresses``; ``None``: not locatable); ``()`` before it
        self.reads: tuple | None = ()

    def allocated(self) -> bool:
        """Whether every parameter and buffer its graphs read is still allocated where it was when they were recorded
        (``freshness.allocated``; ``False`` where they could not be located). All of one slot's graphs are recorded
        under one structure (``StaticSlot.made_under``), so on the same tensors at the same addresses."""
        return self.reads is not None and allocated(self.reads)

    def __deepcopy__(self, memo):  # a CUDA graph cannot be copied; a copied model records its own
        return None

    def __call__(self, model, cache, ids: torch.Tensor, pos: torch.Tensor, step=None) -> torch.Tensor:
        """The last logits ``[Rb, V]`` of ``ids`` / ``pos`` ``[Rb, L]`` prefilled into ``cache`` (CUDA, its suffix
        empty). ``step``: the ``step.DecodeStep`` on ``cache`` an earlier call made, or ``None``. A replay's logits
        are the graph's own buffer: read them before the next prefill of this length."""
        runner = None if step is None else step.prefill_runner
        key = self._key(ids, step, runner)
        entry = self.graphs.get(key)
        if entry is None and runner is not None:
            logits = self._first_compiled(model, runner, cache, ids, pos, key, step)
            if logits is not None:
                return logits
            key = (*key[:-1], None)  # (it failed: the eager forward's graph of this length)
            entry = self.graphs.get(key)
        if entry is None:
            return self._first(model, cache, ids, pos, key)
        if entry.__class__ is Eager:
            return prefill_logits(model, self.name, cache, ids, pos)
        entry.ids.copy_(ids)
        entry.pos.copy_(pos)
        entry.graph.replay()
        return entry.logits

    def replays(self, ids: torch.Tensor, step=None) -> _Graph | None:
        """The recorded graph a prefill of ``ids`` through ``step`` (as ``__call__`` takes them) replays, or ``None``
        where it runs otherwise (its first run at this shape, eager ops)."""
        entry = self.graphs.get(self._key(ids, step, None if step is None else step.prefill_runner))
        return entry if entry.__class__ is _Graph else None

    @staticmethod
    def _key(ids: torch.Tensor, step, runner) -> tuple:
        """Where a prefill of ``ids`` is recorded: its shape, and the kernel configuration in force and the compile
        settings its launches ran under (``None``: the eager forward's graph)."""
        from .kernels.config import active_config

        return ids.shape, active_config(), None if runner is None else step.compile_settings

    def _first_compiled(self, model, runner, cache, ids: torch.Tensor, pos: torch.Tensor, key: tuple,
                        step) -> torch.Tensor | None:
        """A length's first prefill through ``runner``, recorded; ``None`` when compiling or recording it failed: then
        warned, the positions its run wrote put back, and the model's prefills recorded eagerly from now on. An
        out-of-memory error is the call's, not the compile's: raised."""
        marks = cache.fill_marks()
        try:
            logits = self._record(model, runner, cache, ids.clone(), pos.clone(), key)
        except Exception as err:  # noqa: BLE001 - record the eager forward rather than lose the call
            cause = err.err if isinstance(err, _Unrecorded) else err
            cache.rewind(marks)  # (the layers its run reached wrote their positions)
            if isinstance(cause, torch.OutOfMemoryError):  # running or recording: the call's, not the compile's
                raise cause from None
            reason = f"compiling the suffix prefill failed ({type(cause).__name__}: {cause})"
            # stacklevel: fast_generate's caller, as the decode step's warnings
            warnings.warn(f"relay_hf: {reason}; recording it uncompiled", RuntimeWarning, stacklevel=5)
            relay_state(model).stop_compiling_prefills(reason)
            self.graphs = {k: v for k, v in self.graphs.items() if k[-1] is None}  # never replayed again
            return None
        step.keep_prefill_compiled()
        return logits

    def _first(self, model, cache, ids: torch.Tensor, pos: torch.Tensor, key: tuple) -> torch.Tensor:
        """A length's first prefill through the model's eager forward, recorded (``Eager`` where recording fails:
        warned, and the model's prefills run as eager ops from now on)."""
        try:
            return self._record(model, model, cache, ids.clone(), pos.clone(), key)
        except _Unrecorded as failed:
            reason = f"capturing the suffix prefill failed ({type(failed.err).__name__}: {failed.err})"
            warnings.warn(f"relay_hf: {reason}; prefilling without a CUDA graph", RuntimeWarning, stacklevel=5)
            self.graphs[key] = Eager(reason)
            relay_state(model).stop_recording_prefills(reason)
            return failed.logits

    def _record(self, model, runner, cache, ids: torch.Tensor, pos: torch.Tensor, key: tuple) -> torch.Tensor:
        """``ids`` / ``pos`` (the graph's inputs) run once through ``runner`` on a side stream (this call's logits, and
        the capture recipe's warm-up), then recorded (recording runs nothing: the cache stays as filled). Raises what
        the run raised; ``_Unrecorded`` when only the recording failed."""

        def run():
            return prefill_logits(runner, self.name, cache, ids, pos)

        logits = on_side_stream(run, model.device)
        try:
            graph, out = capture_graph(run, model.device, pool=self.pool)
        except Exception as err:  # noqa: BLE001 - the caller decides what a failed recording means
            raise _Unrecorded(err, logits) from err
        self.pool = graph.pool()
        if self.reads == ():
            self.reads = addresses(model)
        self.graphs[key] = _Graph(graph, ids, pos, out)
        # one graph per length: the other road's (the eager one once compiled, a compiled one no step will hand a
        # runner for again) is not replayed again, and its memory goes back to the pool
        for other in [k for k in self.graphs if k[:-1] == key[:-1] and k != key]:
            del self.graphs[other]
        return logits


class _Unrecorded(Exception):
    """A prefill that ran (``logits``, its result) but whose recording raised ``err``."""

    def __init__(self, err: Exception, logits: torch.Tensor):
        super().__init__(str(err))
        self.err, self.logits = err, logits
