"""relay_hf's own decode loop over a static ``RelayCache``: greedy search or sampling, each step replayed as CUDA
graphs on CUDA (``step.py``), the host looking only every ``DecodeConfig.chunk`` steps.

Why: transformers' ``generate`` loop synchronises with the GPU after every token (``this_peer_finished``, the
streamer), so the GPU idles for part of every step while the host catches up (docs/performance.md, "What limits it";
measured by ``benchmarks/generate.py``). Here the device runs step after step (``step.DecodeStep``: the forward, then
stock's token choice, ``sampling.py``) while the host keeps what a per-step loop would: EOS and stop strings per row
(finished rows get ``pad``), the streamer (tokens arrive one step at a time, a chunk at a time), and the generator's
offset, rewound to where stock's would be when the last chunk ran past the stop. ``sampling.loop_processors`` says
what the loop cannot reproduce; ``policy`` then sends the call to transformers' loop.

The loop has gpt-fast's shape: ``_prefill`` (the rows' own tokens), then the decode step once per token,
``DecodeConfig.chunk`` steps between host looks (``fast_generate``).
"""

from __future__ import annotations

import torch

from ._compat import cache_kwarg_name, optimized_for_decode
from .sampling import Sampler, choose
from .step import DEFAULT_DECODE, DecodeConfig, made_step, step_for
from .suffix_prefill import SuffixPrefill, prefill_logits, recorded_length


def _prefill(model, slot, ids: torch.Tensor, mask: torch.Tensor, rows: int, decode: DecodeConfig, step=None,
             check_row=None):
    """The rows' own tokens after the cached prefix (``ids`` / ``mask`` ``[R, T]``, relay layout), at ``rows >= R``
    rows: the extra rows copy row 0, but for row ``R`` where the call runs a ``check_row`` (``check_row.py``: the
    slot's padding for it set by the caller). Recorded as a CUDA graph per suffix length where ``recorded_length``
    allows (one prefix, CUDA; ``suffix_prefill.py``; through ``step``'s compiled layer where it has one: the slot's
    step an earlier call made, ``step.made_step``), else eager ops; a replay hands the check row its keys and values.
    Returns the last logits ``[rows, V]``, and the last tokens and their next positions, ``[rows, 1]`` int64 each (the
    decode step's first inputs)."""
    R = ids.shape[0]
    fill = torch.zeros(rows - R, dtype=torch.long, device=ids.device)
    ids_b, mask_b = torch.cat([ids, ids[fill]]), torch.cat([mask, mask[fill]])
    cache = slot.cache
    P = cache.prefix_length
    pos = (mask_b.long().cumsum(-1) - 1).masked_fill(mask_b == 0, 0)  # stock's positions: pads get 0
    if check_row is not None:
        check_row.lay_out(ids_b[R], pos[R], P)
    own_ids, own_pos, name = ids_b[:, P:], pos[:, P:], cache_kwarg_name(model)
    L = own_ids.shape[1]
    if _recorded(model, ids_b, cache, decode):
        if slot.prefill is None:
            slot.prefill = SuffixPrefill(name)
        graph = slot.prefill.replays(own_ids, step)
        logits = slot.prefill(model, cache, own_ids, own_pos, step)
        if check_row is not None and graph is not None:
            check_row.supply(graph, cache, R, L)
    else:
        logits = prefill_logits(model, name, cache, own_ids, own_pos)
    return logits, ids_b[:, -1:], pos[:, -1:] + 1


def _recorded(model, ids: torch.Tensor, cache, decode: DecodeConfig) -> bool:
    """Whether the prefill of ``ids`` (``[rows, P + L]``) into ``cache`` runs as a recorded graph: on CUDA, one
    prefix, its own length a recorded one (``recorded_length``)."""
    L = ids.shape[1] - cache.prefix_length
    return ids.is_cuda and cache.groups is None and recorded_length(model, ids.shape[0], L, decode) == L


class _RngOffsets:
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
                  decode: DecodeConfig = DEFAULT_DECODE, verify=None, check_row=None) -> torch.Tensor:
    """Generation on relay_hf's loop.

    Args:
        ids, mask: ``[B, T]`` in relay layout (shared prefix first, then each row's pads, then its own tokens).
        stock_ids: ``[B, T]`` the same rows in stock layout (what stop strings read).
        slot: a ``state.StaticSlot`` whose static ``RelayCache`` holds the prefix and has at least
            ``decode.bucket(R)`` rows, ``R = B * rows_per_input`` (``num_return_sequences``); the extra rows copy row
            0 and are dropped.
        sampler: from ``sampling.loop_sampler``. ``stop``: a stop-string criterion (stock's, on stock-layout ids) or
            ``None``.
        n_new: tokens to make at most.
        verify: called once the prefill is launched and before anything is drawn or shown (the first token drawn,
            the streamer's first put): the check of a kept prefix the cache holds, read then (it raises to throw
            the call's work away); ``None``: nothing to read.
        check_row: a ``check_row.CheckRow`` the prefill runs in row ``R`` (the slot has more rows; its padding
            there is the check row's), or ``None``.

    Prefills the rows' own tokens (the prefix is never recomputed), then decodes. Returns ``[R, T + n]`` int64
    sequences in relay layout, ``n`` as stock generate gives it (``n_new``, or fewer when every row has finished).
    """
    ids, mask = ids.repeat_interleave(rows_per_input, 0), mask.repeat_interleave(rows_per_input, 0)
    R = ids.shape[0]
    cache = slot.cache
    Rb = cache.layers[0].suffix_padding.shape[0]
    made = made_step(slot, Rb, compile_config, decode)
    if made is None:
        slot.stepper = None  # a step for other settings: its graphs freed before the prefill records
    logits, last, pos = _prefill(model, slot, ids, mask, Rb, decode, made, check_row)
    with optimized_for_decode(model):  # as stock's decode steps run (an MoE's experts: batched, capturable)
        step = made if made is not None else step_for(model, slot, Rb, compile_config, decode)
        choice = step.choice_for(R, cache.layers[0].max_suffix_length, logits.shape[-1], sampler)
        choice.start(sampler, rows_per_input)
        step.tok.copy_(last)
        step.pos.copy_(pos)
        rng = _RngOffsets(ids.device, sampler.sample)
        rng.mark()
        if verify is not None and sampler.sample:
            verify()  # before the draw: a call run again draws what stock draws
        choose(logits[:R], choice, step.tok)
        if verify is not None and not sampler.sample:
            verify()  # greedy: after the choice is launched, so the device goes on while the host waits
        if streamer is not None:  # stock streams the prompt expanded to its return sequences
            streamer.put(ids.cpu())
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
