"""Stock's token choice, rebuilt for relay_hf's decode loop: which calls it can reproduce, and the choice itself.

Why: the loop (``decode.py``) captures each step's choice as a CUDA graph, so it cannot call stock's ``_sample``
(which waits for the device). It runs stock's own logits processors and draw as eager ops instead, so every score is
what stock computes, bit for bit:

* ``loop_processors`` builds stock's processor list for the call and judges it (while deciding, ``policy``): each
  entry must be one the loop runs, else the reason goes to ``relay_last_decision.loop_reason`` and transformers' loop
  decodes;
* ``loop_sampler`` turns those processors into a ``Sampler`` (its device tensors) when the call runs on the loop;
* ``choose`` picks one token per row from a step's logits, on the per-row state of a ``Choice``. The draw is
  ``torch.multinomial``'s own one-sample algorithm (``argmax(probs / Exp(1) noise)``) without its host-side value
  check, on the device generator, so a seeded call draws what stock draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from ._compat import logits_processors
from .graphs import Eager, Pending
from .host import to_device

# stock's processors that read nothing but the scores and never wait for the device: the loop calls them as they are
_SCORE_ONLY = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
               "TypicalLogitsWarper", "EpsilonLogitsWarper", "LogitNormalization"}
# stock's processors the loop reproduces from its own device state (EOS ban while too short; repetition penalty)
_EOS_BAN = {"MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"}
_PENALTY = "RepetitionPenaltyLogitsProcessor"


@dataclass(frozen=True, eq=False)
class LoopProcessors:
    """Stock's processors for one call, judged by ``loop_processors`` as ones the loop runs: what its ``Sampler`` is
    built from (``loop_sampler``) once the call runs on the loop.

    Attributes:
        warpers: stock's own score-only processors for this call, in stock's order (they follow the penalty and the
            EOS ban in stock's list too).
        penalty: stock's ``RepetitionPenaltyLogitsProcessor`` for this call, or ``None``.
        vocab: the logits' last dimension (the output embedding's rows).
    """

    warpers: tuple
    penalty: object | None
    vocab: int


@dataclass(frozen=True, eq=False)
class Sampler:
    """How the loop turns a step's logits into tokens, as stock's processors and token selection do.

    Attributes:
        sample: draw from the processed distribution (``do_sample``), else argmax.
        warpers: ``LoopProcessors.warpers``.
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


def loop_processors(model, gen: GenerationConfig, ids: torch.Tensor, mask: torch.Tensor) -> LoopProcessors | str:
    """Stock's processors for this call (``ids`` / ``mask`` ``[B, T]`` in stock layout), or why the loop cannot
    reproduce stock's processing: stock's own processor list is built and each entry must be one the loop runs."""
    head = getattr(model.get_output_embeddings(), "weight", None)
    if not isinstance(head, torch.Tensor):
        return "a model without an output embedding (its vocabulary size is unknown before a forward)"
    warpers, penalty = [], None
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
            penalty = proc
    return LoopProcessors(tuple(warpers), penalty, head.shape[0])


def loop_sampler(model, gen: GenerationConfig, ids: torch.Tensor, processors: LoopProcessors) -> Sampler:
    """The ``Sampler`` of a call that runs on the loop: ``processors`` from ``loop_processors`` for the same ``gen``
    and ``ids`` (``[B, T]`` stock layout), its EOS and pad tokens, and its minimum length."""
    vocab, penalty, seen = processors.vocab, None, None
    if processors.penalty is not None:
        penalty = processors.penalty.penalty
        ones = torch.ones(ids.shape[0], vocab, device=ids.device)
        seen = processors.penalty(ids, ones) != 1  # [B, V] what stock penalises
    eos, eos_list = None, None
    if gen.eos_token_id is not None:
        eos_list = torch.tensor(gen.eos_token_id).reshape(-1).tolist()  # on the host: the key reads no device value
        eos_ids = to_device(torch.tensor(eos_list), model.device)
        # isin, as stock's processors and criterion match: an id outside the vocabulary never matches
        eos = eos_ids, torch.isin(torch.arange(vocab, device=model.device), eos_ids)
    # stock's _prepare_generated_length: min_new_tokens, when set, replaces min_length (as min_new_tokens + T)
    min_k = gen.min_new_tokens if gen.min_new_tokens is not None else max(0, (gen.min_length or 0) - ids.shape[1])
    pad = gen.pad_token_id if gen.pad_token_id is not None else eos_list[0] if eos is not None else 0
    sample = bool(gen.do_sample)
    warpers = processors.warpers
    key = (sample, tuple(_settings(w) for w in warpers), penalty, None if eos is None else tuple(eos_list), int(pad))
    return Sampler(sample, warpers, penalty, seen, eos, min_k, int(pad), key)


def _field_of(processor_name: str) -> str:
    """The generation-config field a processor comes from, for a message (best effort)."""
    known = {"SuppressTokensLogitsProcessor": "suppress_tokens", "SuppressTokensAtBeginLogitsProcessor":
             "begin_suppress_tokens", "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
             "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id", "InfNanRemoveLogitsProcessor":
             "remove_invalid_values", "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
             "EtaLogitsWarper": "eta_cutoff", "TopHLogitsWarper": "top_h"}
    return known.get(processor_name, "generation config")


class Choice:
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


def choose(logits: torch.Tensor, choice: Choice, tok: torch.Tensor) -> None:
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
