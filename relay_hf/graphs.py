"""Work captured as a CUDA graph: the states it lives through, and the capture itself (``capture_graph``), shared by
the decode step (``step.py``), the suffix prefill (``suffix_prefill.py``) and the kept-prefix check
(``freshness.py``).

Why one helper: each records work that a host-bound eager run would slow down, on the model's device whichever device
is current, while other threads may run eager work on the model (a concurrent stock call, a prefill, a decode step);
each warms up the same way torch's capture recipe does, on a side stream (``on_side_stream``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Warming:
    """Before its capture (CUDA only): ``left`` more eager runs, each on a side stream as torch's capture recipe warms
    up; at ``left == 0`` the next run captures it (``Captured``, or ``Eager`` when that fails)."""

    left: int


@dataclass(frozen=True, slots=True)
class Pending:
    """Captured once what it reads stays put: the decode step's choice reads the logits buffer of a captured forward,
    so the first step whose forward replays captures it (``Captured``, or ``Eager`` when that fails); until then it
    runs as eager ops."""


@dataclass(frozen=True, slots=True)
class Captured:
    """Replayed as ``graph`` every run, on the buffers it was recorded with."""

    graph: torch.cuda.CUDAGraph


@dataclass(frozen=True, slots=True)
class Eager:
    """Run as eager ops every time, for good; ``reason`` says why (off CUDA, or its capture failed: warned once and
    never retried, so a failing capture costs one attempt, not one a run)."""

    reason: str


@contextlib.contextmanager
def queued_on(stream: torch.cuda.Stream | None, device: torch.device, reads: tuple = ()):
    """Work queued on ``stream`` after what the caller queued so far (the caller's stream does not wait for it), or
    on the caller's stream where ``stream`` is ``None``. ``reads``: the caller's tensors it reads, kept from reuse
    until it has."""
    if stream is None:
        yield
        return
    with torch.cuda.device(device):
        stream.wait_stream(torch.cuda.current_stream())
        for t in reads:
            if t.is_cuda:
                t.record_stream(stream)
        with torch.cuda.stream(stream):
            yield


def on_side_stream(fn: Callable[[], T], device: torch.device, side: torch.cuda.Stream | None = None) -> T:
    """``fn()`` on ``side`` (``None``: a new stream of ``device``), which first waits for the current stream, which
    waits for it after (also when ``fn`` raises): the warm-up of torch's capture recipe, so the allocator's blocks and
    the libraries' workspaces a capture needs exist before it (``capture_graph`` passes the stream it records on, if
    any, as ``side``)."""
    with torch.cuda.device(device):
        side = side if side is not None else torch.cuda.Stream()
        try:
            with queued_on(side, device):
                return fn()
        finally:
            torch.cuda.current_stream().wait_stream(side)


def capture_graph(fn: Callable[[], T], device: torch.device, warm_up: bool = False, pool=None,
                  stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn`` recorded as a CUDA graph on ``device`` (whichever device is current), after one eager run when
    ``warm_up`` (on ``stream`` where given, else on a side stream), in the memory ``pool`` of graphs it never runs
    beside (``None``: a pool of its own), on ``stream`` (``None``: torch's capture stream). The matrix products a
    graph records use the cuBLAS workspace of the stream it is recorded on, so a graph replayed beside others is
    recorded on a stream they are not (``freshness.check_stream``), after a warm-up there (the workspace then exists
    outside the graph's pool).
    Returns the graph, not yet replayed, and what ``fn`` returned while recording (tensors the graph's replays
    write). Raises what the warm-up or the capture raised: nothing runs while recording, so what ``fn`` would change
    is intact then, and the caller decides what a failure means."""
    with torch.cuda.device(device):
        if warm_up:
            on_side_stream(fn, device, stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's eager work on the model (a concurrent stock call, a prefill, a decode step)
        # neither breaks this capture nor is refused while it runs
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            out = fn()
    return graph, out
