"""The check a kept prefix passes on every hit: recomputed through the model as it is now, equal bit for bit to what
was recorded when the prefix was prefilled (``SegmentCheck``).

A kept segment's KV depends on (a) every parameter all tokens pass through (projections, norms, rotary tables:
dense weights), (b) the embedding rows of its own tokens, (c) parameters only some tokens reach (experts of a sparse
MoE, rows of a learned position table). The check looks at each, whatever way the model was changed (a write through
``.data`` or raw storage included, which no version counter sees):

(a) the KV of the prefix's first ``CHECK_TOKENS`` tokens, computed alone through the base model, at every layer;
(b) the segment's token embeddings, each projected on a fixed vector (one fp32 value per token);
(c) the integer sum of the raw bits of every such parameter.

Recorded and recomputed by the same code on the same device, shapes and dtype, so an unchanged model gives the same
bits (deterministic kernels at fixed shapes); the comparison is exact. Not seen: a change that leaves (a)'s tokens'
KV bit for bit as it was (a neuron they never activate, a change that rounds away for them) or that permutes values
within (c) (docs/api.md, "Kept prefixes"). A false
alarm would only cost a prefill. Cost on a hit: one forward of ``CHECK_TOKENS`` tokens through the decoder (the LM head
skipped), one embedding lookup, and a read of (c)'s parameters where the model has any (docs/performance.md).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import weakref
from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicCache

from ._compat import cache_kwarg_name
from .graphs import capture_graph, queued_on

logger = logging.getLogger("relay_hf")

# tokens at the start of a kept prefix recomputed at every hit: position 0 rotates nothing, the others exercise the
# rotary table; more tokens catch more of the changes that leave a few tokens' KV bit-identical (a neuron they never
# activate, a change that rounds away for them) at little cost on a GPU, where the weights are read once either way
CHECK_TOKENS = 8
_PARTIAL = re.compile(r"Expert|Moe|MoE")  # module classes whose parameters only routed tokens reach
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel ``DTensor``'s shard on this rank (its own storage and version counter), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


def reached_partly(module: torch.nn.Module, inputs: torch.nn.Module | None) -> bool:
    """Whether only some tokens reach ``module``'s parameters: a module whose class names experts (``...Experts``,
    ``...SparseMoeBlock``), or an embedding table besides the input embeddings ``inputs`` (a learned position
    table). Stacked parameters of 3+ dims count too (``partial_reach``)."""
    return _partial_class(type(module)) or (isinstance(module, torch.nn.Embedding) and module is not inputs)


@functools.cache
def _partial_class(cls: type) -> bool:
    return bool(_PARTIAL.search(cls.__name__))


def partial_reach(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters only some tokens reach (``reached_partly``, and parameters of 3+ dims). Empty for a dense
    model."""
    inputs = model.get_input_embeddings()
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if reached_partly(module, inputs):
            found.update((id(p), p) for p in module.parameters())
    found.update((id(p), p) for p in model.parameters() if p.dim() >= 3)
    return list(found.values())


def bit_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[n]`` int64: per tensor the exact sum of its elements' raw bits (any changed element changes it, unless
    another change cancels it exactly)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    sums = [local_shard(t).detach().view(_BITS[t.element_size()]).sum(dtype=torch.int64) for t in tensors]
    return torch.stack([s.to(sums[0].device) for s in sums])


def _embedded(model, ids: torch.Tensor) -> torch.Tensor:
    """``[n]`` fp32: the token embeddings of ``ids`` (``[n]``, on the model's device: a hit copies nothing to it, so
    the host never waits for the device here), each projected on a fixed vector."""
    emb = model.get_input_embeddings()(ids[None].to(model.device))[0].float()  # [n, H]
    probe = torch.linspace(1.0, 2.0, emb.shape[-1], device=emb.device)  # distinct weights: a swap within a row shows
    return emb @ probe


@torch.no_grad()
def _head_kv(model, head: torch.Tensor) -> torch.Tensor:
    """``[layers * 2 * H_kv * n * D]``: every layer's keys and values of ``head`` (``[n]`` ids) from position 0,
    computed alone, flattened into one tensor (one comparison reads them all)."""
    scratch = DynamicCache()
    model.base_model(input_ids=head[None].to(model.device), use_cache=True, **{cache_kwarg_name(model): scratch})
    return torch.cat([t.reshape(-1) for layer in scratch.layers for t in (layer.keys, layer.values)])


def check_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every captured check on ``device`` records and replays on (``_Replay``): one, so a call's checks
    (which share values: ``_partial``) run in order, and from torch's high-priority pool, which neither torch's
    capture stream nor the side streams of relay_hf's other graphs come from (a graph's matrix products use the
    cuBLAS workspace of the stream it was recorded on, and two graphs on one workspace must not run side by side)."""
    device = torch.device(device)
    with _STREAMS_LOCK:  # (two threads' first checks get the same stream)
        return _check_stream(device.index if device.index is not None else torch.cuda.current_device())


_STREAMS_LOCK = threading.Lock()


@functools.cache
def _check_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index, priority=-1)


class _Replay:
    """``_head_kv`` captured as a CUDA graph on its first replay (an eager forward of a few tokens through every layer
    is host-bound: ~25 ms on a 32-layer model on an H200, the replay reads the weights at memory speed). It reads the
    parameters' storage as it is at each replay (a write in place is seen); parameters, modules, hooks or plain values
    replaced change ``dependencies.kv_dependencies``, which drops the entry, and its graph with it. Capture fails:
    eager.

    Captured, it runs on the device's ``check_stream``, after what the caller queued before it (a write to a
    parameter included), beside what the caller queues after it: a chat turn's own prefill runs while the check does
    (docs/performance.md, the chat turn). ``__call__`` makes the caller's stream wait for it; ``run`` does not.

    ``launch`` replays it before the call has walked the model (``kept.launch_checks``: the device runs the check
    while the host decides), only where every parameter and buffer it read is still allocated where it was
    (``addresses``): a graph reads by address, so a freed one could fault the device."""

    def __init__(self):
        self.graph = self.kv = self.ids = self.stream = None
        self.eager = False
        self.reads: tuple | None = ()  # (weakref, where) of each parameter and buffer the graph reads (``addresses``)

    def __call__(self, model, head: torch.Tensor) -> torch.Tensor:
        kv = self.run(model, head)
        self.join(model)
        return kv

    def run(self, model, head: torch.Tensor) -> torch.Tensor:
        """``_head_kv(model, head)``: replayed on ``stream`` once captured (the caller's stream not made to wait),
        else eager on the caller's stream."""
        if self.eager or model.device.type != "cuda":
            return _head_kv(model, head)
        if self.graph is None:
            self.ids = head.to(model.device)  # the graph's input, kept alive with it (no copy while capturing)
            stream = check_stream(model.device)
            try:
                # warmed up where it is recorded: the stream's cuBLAS workspace exists before the capture, outside
                # the graph's pool
                graph, kv = capture_graph(lambda: _head_kv(model, self.ids), model.device, warm_up=True, stream=stream)
            except Exception as err:  # noqa: BLE001 - any capture failure: the eager forward is the same check
                logger.debug("relay_hf: the kept-prefix check runs eagerly: its capture failed: %s", err)
                self.eager = True
                return _head_kv(model, head)
            self.ids.record_stream(stream)  # (freed with the entry, while a replay may still read it)
            self.graph, self.kv, self.reads, self.stream = graph, kv, addresses(model), stream
        with self.on_stream(model):
            self.graph.replay()
        return self.kv

    def launchable(self) -> bool:
        """Whether the replay can be launched before the walk: captured, and every tensor it read still allocated
        where it was (``allocated``)."""
        return self.graph is not None and self.reads is not None and allocated(self.reads)

    def launch(self, model) -> torch.Tensor | None:
        """The replay's output, launched now and not read, or ``None`` where it cannot be launched before the walk
        (``launchable``)."""
        if not self.launchable():
            return None
        with self.on_stream(model):
            self.graph.replay()
        return self.kv

    def on_stream(self, model, reads: tuple = ()):
        """``queued_on`` this check's stream (``None`` before its capture, or eager: the caller's stream)."""
        return queued_on(self.stream, model.device, reads)

    def join(self, model) -> None:
        """The caller's stream made to wait for what this check queued (no host wait)."""
        if self.stream is not None:
            torch.cuda.current_stream(model.device).wait_stream(self.stream)

    def answer(self, found: torch.Tensor) -> torch.Tensor | _Answer:
        """``found`` (a 0-dim bool tensor queued within ``on_stream``) as the caller reads it: an ``_Answer`` that
        waits for ``stream`` alone, or ``found`` itself where there is no stream of its own."""
        return found if self.stream is None else _Answer(found, self.stream)


class _Answer:
    """A check's verdict queued on its replay's stream: ``bool()`` waits for that stream up to it, not for what the
    caller queued since (its prefill)."""

    def __init__(self, found: torch.Tensor, stream: torch.cuda.Stream):
        self.host = torch.empty((), dtype=torch.bool, pin_memory=True)
        self.host.copy_(found, non_blocking=True)  # (queued on ``stream``: ``_Replay.on_stream``)
        self.done = torch.cuda.Event()
        self.done.record(stream)

    def __bool__(self) -> bool:
        self.done.synchronize()
        return bool(self.host)


def addresses(model) -> tuple | None:
    """``(weakref, where)`` of every parameter and buffer of ``model`` (``_where``): what a captured forward reads by
    address; ``None`` where one has no storage of its own to locate (a wrapper tensor subclass): a graph recorded on
    it is then never replayed before the call's walk (a check's launch, a slot's prefill: ``StaticSlot.replayable``)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    try:
        return tuple((weakref.ref(t), _where(t)) for t in tensors.values())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _where(t: torch.Tensor) -> tuple[int, int]:
    """``(address, bytes)`` of ``t``'s storage from its first element on (a ``DTensor``'s shard on this rank)."""
    local = local_shard(t)
    storage = local.untyped_storage()
    return local.data_ptr(), storage.nbytes() - (local.data_ptr() - storage.data_ptr())


def allocated(reads: tuple) -> bool:
    """Whether every tensor of ``addresses`` is alive with as many bytes at the same address: what a graph read there
    is still allocated (a dropped parameter, a ``.data`` swapped by ``model.to`` or for a smaller tensor, a storage
    resized to nothing all fail this). Tensors a forward reads that are neither parameters nor buffers (a plain
    tensor attribute) are not seen here, nor by ``dependencies.kv_dependencies``."""
    for ref, where in reads:
        t = ref()
        if t is None or _where(t) != where:
            return False
    return True


def _partial(model, memo: dict) -> torch.Tensor:
    """``bit_sums`` of the parameters only some tokens reach, once per call: of ``memo["partial_params"]`` where the
    caller found them already (``dependencies.kv_dependencies`` does, in its walk of the modules), else found here."""
    if "partial" not in memo:
        params = memo.get("partial_params")
        memo["partial"] = bit_sums(partial_reach(model) if params is None else params)
    return memo["partial"]


def equal_on_device(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | bool:
    """``torch.equal(a, b)`` left on ``a``'s device (a 0-dim bool tensor, nothing read back), or a ``bool`` where the
    host knows the answer (shapes or dtypes differ; nothing to compare)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return True if a.numel() == 0 else torch.eq(a, b.to(a.device)).all()


class SegmentCheck(NamedTuple):
    """What a kept segment is checked against on a hit.

    Attributes:
        head: every layer's keys and values of the first ``CHECK_TOKENS`` tokens of the segment's full prefix (from
            position 0), computed alone, flattened (``_head_kv``).
        embedded: ``[n]`` fp32 the segment's own token embeddings, projected (``_embedded``).
        partial: ``[m]`` int64 ``bit_sums(partial_reach(model))``.
        replay: how a hit recomputes ``head`` (``_Replay``: a CUDA graph on CUDA).
        own: ``[n]`` int64 the segment's own token ids on the model's device (what ``_embedded`` reads on a hit).
        rows: what ``head``'s tokens gave as a check row of a recorded prefill, by graph
            (``check_row.CheckRow.keep``: ``{id(graph): (weakref to it, kv)}``, ``kv`` ``[layers * 2 * H_kv * n *
            D]`` in the model's dtype): at most ``check_row.MAX_REFERENCES``, not counted in the store's budget.
    """

    head: torch.Tensor
    embedded: torch.Tensor
    partial: torch.Tensor
    replay: _Replay
    own: torch.Tensor
    rows: dict

    @classmethod
    @torch.no_grad()
    def record(cls, model, full_ids: torch.Tensor, own_ids: torch.Tensor, memo: dict | None = None) -> SegmentCheck:
        """The check of a segment whose full prefix is ``full_ids`` (``[P]``) and own tokens ``own_ids`` (``[n]``),
        through ``model`` as it is now. ``memo``: values shared by the segments of one call (the same head, the same
        partial sums), computed once."""
        memo = {} if memo is None else memo
        head = full_ids[:CHECK_TOKENS]
        key = ("head", head.numpy().tobytes())
        if key not in memo:  # recorded by the replay a hit runs: the same kernels, the same bits
            replay = _Replay()
            memo[key] = replay(model, head).clone(), replay
        own = own_ids.to(model.device, torch.int64)
        return cls(memo[key][0], _embedded(model, own), _partial(model, memo), memo[key][1], own, {})

    @torch.no_grad()
    def verdict(self, model, full_ids: torch.Tensor, memo: dict | None = None) -> torch.Tensor | bool | _Answer:
        """Whether ``model`` as it is now gives this check's values, bit for bit, computed but not read: a 0-dim bool
        tensor on the model's device, or an ``_Answer`` queued on the check's own stream (a captured check), or a
        ``bool`` the host already knows. Nothing here waits for the device, and the caller's stream does not wait for
        the check, so a caller can launch more work (its prefill) before it reads the answer (``bool()``). A check
        ``launch``ed earlier in the call (``memo["launched"]``) is compared, not run again. Where the call runs a
        check row (``memo["check_row"]``, a ``check_row.CheckRow``) and launched none, the head is left to it: its
        verdict (read with ``bool()`` once the call's prefill is launched) compares that row."""
        memo = {} if memo is None else memo
        launched = memo.get("launched", {}).get(id(self.replay))  # by ``launch``, earlier in the call
        row = memo.get("check_row") if launched is None else None
        head = None
        if row is None:
            head = self.replay.run(model, full_ids[:CHECK_TOKENS]) if launched is None else launched[1]
        with self.replay.on_stream(model, reads=(self.head, self.embedded, self.partial, self.own)):
            partial = _partial(model, memo)  # here, or earlier in the call, on this stream or the caller's (waited for)
            if partial.is_cuda:
                partial.record_stream(torch.cuda.current_stream())
            pairs = [(self.embedded, _embedded(model, self.own)), (self.partial, partial)]
            pairs += [] if head is None else [(self.head, head)]
            found = [f for f in (equal_on_device(a, b) for a, b in pairs) if f is not True]
            known = False if any(f is False for f in found) else True if not found else None
            if known is None:
                answer = self.replay.answer(torch.stack([f.to(found[0].device) for f in found]).all())
                return answer if row is None else row.verdict(self, full_ids, answer, memo)
        self.replay.join(model)  # known on the host: the caller's stream goes on after what the check queued (the
        if row is None or known is False:  # entry may be dropped now, its graph with it)
            return known
        return row.verdict(self, full_ids, known, memo)

    def launch(self, model, check_row: bool = False) -> dict | None:
        """This check's forward launched now, before the call walks the model, where it can be (``_Replay.launch``):
        ``{id(replay): (replay, head)}`` for ``verdict``'s memo (``"launched"``); ``{}`` where it has no graph (its
        verdict runs the forward as it is now); ``None`` where its graph cannot be replayed now: a parameter or
        buffer it read is no longer allocated where it was (``allocated``), so the model changed, and the call's walk
        must drop the entry before its verdict is asked for (``dependencies.kv_dependencies``). The replay is held
        with its output, so its graph outlives the launch. ``check_row``: the call may run a check row
        (``check_row.py``): the forward is then not launched (``{}``, where it could be), since the row is compared
        instead, or, where the check has no reference row for the call's graph, the forward runs after the call's
        prefill, so the row it records is never older than the weights the check passed."""
        if self.replay.graph is None:
            return {}
        if check_row:
            return {} if self.replay.launchable() else None
        head = self.replay.launch(model)
        return None if head is None else {id(self.replay): (self.replay, head)}

    def holds(self, model, full_ids: torch.Tensor, memo: dict | None = None) -> bool:
        """Whether ``model`` as it is now gives this check's values, bit for bit (``verdict``, read now)."""
        return bool(self.verdict(model, full_ids, memo))

    def nbytes(self) -> int:
        return self.head.nbytes + self.embedded.nbytes + self.partial.nbytes + self.own.nbytes
