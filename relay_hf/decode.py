"""relay_hf's own greedy decode loop over a static ``RelayCache``: one decode step (forward, argmax, EOS bookkeeping)
is compiled and captured as ONE CUDA graph, and the steps are replayed back to back with no host sync.

Why: transformers' ``generate`` loop synchronises with the GPU after every token (``this_peer_finished``, the
streamer) and its compiled call re-checks every cache tensor before each CUDA-graph replay, so on an H200 the GPU
idles ~3 ms of a ~9 ms Llama-3-8B step (docs/performance.md). Here the host only looks every
``DecodeConfig.chunk`` steps.

The loop serves exactly what it can reproduce token for token: greedy search with no logits processors and no
stopping criteria besides ``max_new_tokens`` / ``max_length`` and EOS, output as a plain ``LongTensor``
(``policy.loop_reason`` says why anything else goes to transformers' own loop, which then runs on the same static
cache).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from ._compat import cache_kwarg_name


@dataclass(frozen=True)
class DecodeConfig:
    """How relay_hf's loop runs (defaults in ``DEFAULT_DECODE``; pass another to ``fast_generate``).

    Attributes:
        chunk: decode steps between host looks (EOS: all rows done?; streamer puts).
        capture_blas: BLAS library preferred while the step warms up and is captured, for 16-bit models on CUDA
            (``None``: leave torch's choice). The step's GEMMs are skinny (a row per sequence); on an H200 (bf16,
            Llama-3-8B, 64 rows, S = 4096) cuBLASLt's kernels made the captured step 6.17 vs 6.34 ms
            (docs/performance.md). The process-wide preference is restored right after.
        step_inductor_options: inductor options for the compiled step on CUDA, under the user's
            ``CompileConfig.options``. Combo kernels launch a layer's ~9 small independent kernels together:
            6.14 -> 5.92-5.98 ms a step at S = 4096, B = 64 (docs/performance.md). They move a few roundings (bf16
            greedy tokens differ at near ties; fp32 token identity holds: tests/test_smollm2.py). ``()``: inductor's
            defaults.
    """

    chunk: int = 16
    capture_blas: str | None = "cublaslt"
    step_inductor_options: tuple[tuple[str, object], ...] = (("combo_kernels", True),)


DEFAULT_DECODE = DecodeConfig()


def _greedy(logits: torch.Tensor, k: torch.Tensor, eos) -> torch.Tensor:
    """Stock's greedy choice from ``logits [R, V]``: fp32 argmax, EOS banned while ``k`` (0-d int64, tokens made so
    far) is below ``min_k`` (``min_new_tokens`` / ``min_length``, as stock's processors do). ``eos``: ``None`` or
    ``(ids [E] int64, min_k 0-d int64, columns [V] bool)``."""
    scores = logits.float()
    if eos is not None:
        scores = scores.masked_fill(eos[2] & (k < eos[1]), float("-inf"))
    return scores.argmax(-1)


def _choose(logits: torch.Tensor, k: torch.Tensor, unfinished: torch.Tensor, eos, pad) -> torch.Tensor:
    """Stock's next tokens ``[R]`` from ``logits [R, V]``: ``_greedy``, then ``pad`` for rows already finished, and
    ``unfinished [R]`` bool updated in place for rows that just made EOS."""
    nxt = _greedy(logits, k, eos)
    if eos is not None:
        nxt = torch.where(unfinished, nxt, pad)
        unfinished.logical_and_(~torch.isin(nxt, eos[0]))
    return nxt


def _decode_step(model, name: str, cache, tok, pos, k, unfinished, eos, pad) -> None:
    """One greedy step in place: ``tok [R, 1]`` int64 (in: last token, out: next), ``pos [R, 1]`` int64 its
    position, ``k`` 0-d int64 tokens made so far, ``unfinished [R]`` bool, ``eos`` as in ``_greedy``, ``pad`` 0-d
    int64; exactly stock's bookkeeping."""
    logits = model(input_ids=tok, position_ids=pos, use_cache=True, logits_to_keep=1, **{name: cache}).logits
    tok.copy_(_choose(logits[:, -1, :], k, unfinished, eos, pad)[:, None])
    pos.add_(1)
    k.add_(1)


class _Stepper:
    """Runs ``_decode_step`` for one static cache and batch: compiled (``compile_config``), and on CUDA captured as
    a CUDA graph after two warm-up steps. Kept with its cache (``state.StaticSlot``), so the next call that refills
    that cache replays the same graph."""

    def __init__(self, model, cache, rows: int, eos, pad, compile_config, key: tuple, decode: DecodeConfig):
        device = model.device
        self.key, self.decode = key, decode
        self.model, self.cache, self.name, self.eos, self.pad = model, cache, cache_kwarg_name(model), eos, pad
        self.tok = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [R, 1] graph inputs and outputs
        self.pos = torch.zeros_like(self.tok)
        self.k = torch.zeros((), dtype=torch.long, device=device)
        self.unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        self.fn, self.graph, self.warm = _decode_step, None, 0
        self.capture = device.type == "cuda" and compile_config is not None
        if compile_config is not None:
            self.fn = torch.compile(_decode_step, dynamic=False,
                                    **_compile_kwargs(compile_config, device.type, decode.step_inductor_options))

    def __deepcopy__(self, memo):  # a CUDA graph cannot be copied; a copied model captures its own step
        return None

    def _run(self) -> None:
        self.fn(self.model, self.name, self.cache, self.tok, self.pos, self.k, self.unfinished, self.eos, self.pad)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        with _capture_blas(self.decode.capture_blas, self.model.dtype if self.capture else None):
            self._warm_or_capture()

    def _warm_or_capture(self) -> None:
        if not self.capture or self.warm < 2:  # warm-up steps are real steps (compile, autotune, allocator)
            self._eager_step()
        else:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # records only: nothing runs, so a failure leaves the state intact
                    self._run()
            except Exception as err:  # noqa: BLE001 - decode on without the graph rather than lose the call
                warnings.warn(f"relay_hf: capturing the decode step failed ({type(err).__name__}: {err}); "
                              "decoding without a CUDA graph", RuntimeWarning, stacklevel=4)
                self.capture = False
                self._run()
                return
            self.graph = graph
            graph.replay()

    def _eager_step(self) -> None:
        try:
            if self.capture:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._run()
                torch.cuda.current_stream().wait_stream(side)
            else:
                self._run()
            self.warm += 1
        except Exception as err:  # noqa: BLE001 - a compile failure must not lose the user's call
            # dynamo / inductor fail while compiling, before the step runs, so running it eagerly now is one step
            if self.fn is _decode_step:
                raise
            warnings.warn(f"relay_hf: compiling the decode step failed ({type(err).__name__}: {err}); decoding "
                          "eagerly", RuntimeWarning, stacklevel=5)
            self.fn, self.capture = _decode_step, False
            self._run()


@contextlib.contextmanager
def _capture_blas(library: str | None, dtype: torch.dtype | None):
    """``library`` preferred inside the block for fp16/bf16 ``dtype`` (CUDA only), else nothing changes."""
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


def _compile_kwargs(compile_config, device_type: str, step_options: tuple = DEFAULT_DECODE.step_inductor_options
                    ) -> dict:
    """``torch.compile`` arguments for the step from the user's ``CompileConfig``. The loop captures its own CUDA
    graph, so inductor's graph modes become their no-graph forms; on CUDA, inductor also gets ``step_options``
    under the user's own options (``torch.compile`` takes a mode or options, so the mode's options are spelled out)."""
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


def _stepper(model, slot, rows: int, eos, pad, compile_config, decode: DecodeConfig) -> _Stepper:
    """The slot's step if its graph was captured for these values (they are baked into it), else a new one."""
    compiled = None if compile_config is None else repr(compile_config.to_dict())
    key = rows, None if eos is None else (tuple(eos[0].tolist()), int(eos[1])), int(pad), compiled, decode
    if slot.stepper is not None and slot.stepper.key == key:
        return slot.stepper
    slot.stepper = None  # free the old graph's pool first
    slot.stepper = _Stepper(model, slot.cache, rows, eos, pad, compile_config, key, decode)
    return slot.stepper


def _stop_length(tokens: torch.Tensor, eos: torch.Tensor) -> int:
    """How many of ``tokens [R, n]`` stock generate keeps: it stops after the step at which every row has had EOS."""
    hit = torch.isin(tokens, eos)
    if not bool(hit.any(1).all()):
        return tokens.shape[1]
    return int(hit.int().argmax(1).max()) + 1


def _eos(model, gen: GenerationConfig, T: int):
    """``(ids [E] int64, min_k 0-d int64, columns [V] bool)`` on the model's device, or ``None`` without EOS."""
    if gen.eos_token_id is None:
        return None
    ids = torch.tensor(gen.eos_token_id, device=model.device).reshape(-1)
    min_k = torch.tensor(max(gen.min_new_tokens or 0, (gen.min_length or 0) - T), device=model.device)
    columns = torch.zeros(model.get_output_embeddings().weight.shape[0], dtype=torch.bool, device=model.device)
    return ids, min_k, columns.index_fill_(0, ids, True)


def fast_generate(model, ids: torch.Tensor, mask: torch.Tensor, slot, gen: GenerationConfig, streamer, compile_config,
                  n_new: int, decode: DecodeConfig = DEFAULT_DECODE) -> torch.Tensor:
    """Greedy generation on relay_hf's loop. ``ids``/``mask`` ``[R, T]`` in relay layout (shared prefix first, then
    each row's pads, then its own tokens); ``slot`` a ``state.StaticSlot`` whose static ``RelayCache`` holds the
    prefix only. Prefills the rows' own tokens (the prefix is never recomputed), then decodes ``n_new`` tokens at
    most with ``_Stepper``. Returns ``[R, T + n]`` int64 sequences, ``n`` as stock generate gives it (``n_new``, or
    fewer when every row has hit EOS)."""
    R, T = ids.shape
    cache = slot.cache
    eos = _eos(model, gen, T)
    pad = torch.tensor(gen.pad_token_id if gen.pad_token_id is not None else int(eos[0][0]) if eos else 0,
                       device=ids.device)
    if streamer is not None:
        streamer.put(ids.cpu())
    pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # stock's positions: pads get 0
    P = cache.prefix_length
    logits = model(input_ids=ids[:, P:], position_ids=pos[:, P:], use_cache=True, logits_to_keep=1,
                   **{cache_kwarg_name(model): cache}).logits
    step = _stepper(model, slot, R, eos, pad, compile_config, decode)
    step.k.zero_()
    step.unfinished.fill_(True)
    first = _choose(logits[:, -1, :], step.k, step.unfinished, eos, pad)
    step.k.fill_(1)
    step.tok.copy_(first[:, None])
    step.pos.copy_(pos[:, -1:] + 1)
    tokens, sent = [first], 0
    while True:
        done = len(tokens) >= n_new or (eos is not None and not bool(step.unfinished.any()))  # the host's one look
        keep = len(tokens)
        if eos is not None and (done or streamer is not None):
            keep = _stop_length(torch.stack(tokens, 1), eos[0])
        if streamer is not None:
            for t in tokens[sent:keep]:
                streamer.put(t.cpu())
            sent = keep
        if done:
            break
        for _ in range(min(decode.chunk, n_new - len(tokens))):
            step()
            tokens.append(step.tok[:, 0].clone())
    if streamer is not None:
        streamer.end()
    return torch.cat([ids, torch.stack(tokens[:keep], 1)], 1)
