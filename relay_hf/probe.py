"""Patch-time probe: does this model, switched to ``"relay"``, compute exactly what stock attention computes?

A config cannot say whether an attention module hands its KV to the registered attention function untouched
(DiffLlama splits the values with ``chunk()``, JetMoe repeats them, Doge transposes them, MLA models expand cached
latents themselves) or whether the model attends the way relay assumes (XLM-R / CamemBERT as causal LMs without
``is_decoder`` attend bidirectionally; a model that derives positions from the cache length instead of taking
``position_ids`` sees the relay layout's positions). So ``patch`` asks the model: two rows sharing a 5-token prefix,
the second left-padded by 2, go through

* the stock computation: plain forwards without a cache (under ``"relay"`` they run the model's own attention), and
* the relay computation, exactly as the patched ``generate`` runs it: ``RelayCache.from_prefix``, a fork carrying the
  rows' padding, the rows' suffixes in the relay layout ``[prefix | pads | suffix]`` (``relay_hf.prefix``), then one
  decode step,

and the last-position logits of both steps are compared. A few milliseconds on a small model, and the model comes
back as it was: every module's attributes, parameters, buffers and training flag, and the global RNG state.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import torch

from ._compat import cache_kwarg_name
from .cache import RelayCache
from .prefix import relay_layout

PROBE_PREFIX = 5  # shared tokens
PROBE_SUFFIXES = (3, 1)  # tokens after the prefix per row: the second row is left-padded by 2
# max |relay - stock| over the logits, relative to max(max |stock logit|, 1). fp32 / fp64 differ by summation order
# only; half types round every layer's activations. Worst seen on tiny random models of every accepted architecture
# (CPU reference; H200 Triton kernels for 16 of them): fp32 2e-6, bf16 4.8e-2 (CPU) / 9.8e-3 (CUDA), fp16 1.5e-3 /
# 5.3e-3. A structural difference (bidirectional attention, a lost prefix, shifted positions) moves the logits of a
# trained model by a sizeable fraction of their range; fp32 also catches the small shifts of random-weight models.
RTOL = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
DEFAULT_RTOL = 5e-2  # other dtypes (quantized weights)
HALF_DEPTH = 2  # 16-bit models: the hidden state after this many layers is held to the dtype's tolerance,
HALF_LOGIT_RTOL = 0.25  # and the logits to this one (``_last_logits``)
_MAX_ERROR_CHARS = 200


def probe_reason(model) -> str | None:
    """Why ``model`` (already switched to ``"relay"``) must not run relay attention, or ``None`` when relay
    reproduces it.

    Returns a short reason naming the class and what happened, e.g. ``"DiffLlamaForCausalLM: its attention module
    does not hand the KV to the attention function (TypeError: chunk(): ...)"``. Returns ``None`` without running
    anything when parameters are on the meta device (offloaded weights): there is nothing to compute with.

    Any exception of the relay computation is a reason. So is one of the stock computation: under ``"relay"`` a plain
    forward is what every later call of the model runs, and a model whose plain forward fails there either fails on
    its own attention too (declining costs nothing: ``generate`` then runs stock, which raises stock's own error) or
    fails because of relay (declining is required). Accepting is only ever the verified answer.
    """
    name = type(model).__name__
    if any(p.device.type == "meta" for p in model.parameters()):
        return None
    try:
        inputs = _probe_inputs(model)
    except Exception as e:  # a model that cannot be probed is declined; patch never crashes on it
        return f"{name}: relay attention cannot be checked on it ({_short(e)})"
    with _preserved(model), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            stock = _stock_logits(model, inputs)
        except Exception as e:
            return f"{name}: a plain forward fails under relay's attention implementation ({_short(e)})"
        try:
            relay = _relay_logits(model, inputs)
        except Exception as e:
            if "RelayKV" in str(e) or "RelayMask" in str(e):  # the module operated on the relay objects themselves
                return f"{name}: its attention module does not hand the KV to the attention function ({_short(e)})"
            return f"{name}: relay attention cannot run it ({_short(e)})"
    why = _compare(stock, relay, RTOL.get(inputs["dtype"], DEFAULT_RTOL))
    if why is None:
        return None
    if not inputs["positions"]:
        return (f"{name}: relay output differs from stock attention on the {why}: its forward takes no "
                "position_ids, so its positions follow the relay layout instead of the rows' tokens")
    return (f"{name}: relay output differs from stock attention on the {why}: bidirectional or otherwise "
            "non-standard attention")


def _short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    msg = lines[0] if lines else ""
    if len(msg) > _MAX_ERROR_CHARS:
        msg = msg[:_MAX_ERROR_CHARS] + "..."
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _special_ids(model) -> set[int]:
    """Every token id a config names (``pad_token_id``, ``eos_token_id``, ``image_token_index``...)."""
    found: set[int] = set()
    configs = (model.config, model.config.get_text_config(decoder=True), getattr(model, "generation_config", None))
    for config in configs:
        for key, value in (vars(config) if config is not None else {}).items():
            if key.endswith(("_id", "_ids", "_index")):
                values = value if isinstance(value, (list, tuple)) else [value]
                found.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return found


def _probe_inputs(model) -> dict:
    """The probe's rows in both layouts, on the input embedding's device.

    ``ids`` / ``mask`` ``[2, T]`` int64: stock layout ``[pads | prefix | suffix]``; ``relay_ids`` / ``relay_mask``: the
    same rows as ``generate`` lays them out for relay; ``n_pad`` ``[2]``: each row's masked columns in front of its
    suffix there; ``prefix`` ``[P]``; ``step`` ``[2, 1]``: the
    token of the decode step; ``positions``: whether the forward takes ``position_ids`` (``generate`` passes them only
    then); ``dtype``: the embedding's dtype (picks the tolerance).
    """
    embeddings = model.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, torch.Tensor):
        weight = next(model.parameters())
    vocab = getattr(embeddings, "num_embeddings", None) or model.config.get_text_config(decoder=True).vocab_size
    special = _special_ids(model)
    n_tokens = PROBE_PREFIX + sum(PROBE_SUFFIXES) + 1
    # ordinary tokens from the upper half of the vocabulary, never an id a config reserves; deterministic (no RNG)
    tokens = [t for t in range(vocab // 2, vocab) if t not in special][::3][:n_tokens]
    if len(tokens) < n_tokens:
        tokens = [t for t in range(vocab) if t not in special][:n_tokens]
    if len(tokens) < n_tokens:
        raise ValueError(f"a vocabulary of {vocab} tokens has fewer than {n_tokens} ordinary ones")
    prefix, rest = tokens[:PROBE_PREFIX], tokens[PROBE_PREFIX:]
    T = PROBE_PREFIX + max(PROBE_SUFFIXES)
    ids = torch.full((len(PROBE_SUFFIXES), T), prefix[0], dtype=torch.long)  # pads hold an ordinary token (masked)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(PROBE_SUFFIXES):
        row, rest = prefix + rest[:n], rest[n:]
        ids[b, T - len(row):] = torch.tensor(row)
        mask[b, T - len(row):] = 1
    n_pad = (mask == 0).sum(-1)
    layout = relay_layout(ids, mask, n_pad, PROBE_PREFIX)
    step = torch.full((len(PROBE_SUFFIXES), 1), rest[0], dtype=torch.long)
    rows = dict(ids=ids, mask=mask, relay_ids=layout.ids, relay_mask=layout.mask, n_pad=layout.suffix_padding,
                prefix=torch.tensor(prefix), step=step)
    return {**{k: v.to(weight.device) for k, v in rows.items()},
            "positions": "position_ids" in inspect.signature(model.forward).parameters, "dtype": weight.dtype}


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as ``generate`` derives them from a left-padded mask: ``cumsum - 1``, pads at 0."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _last_logits(model, ids: torch.Tensor, mask: torch.Tensor, positions: bool, **kwargs) -> tuple:
    """What the probe compares of one forward of ``ids`` (the last ``ids.shape[1]`` columns of ``mask``), passing
    what ``generate`` would pass: ``(the last position's logits [B, V], its hidden state after layer HALF_DEPTH
    [B, hidden] or None)``, fp32. The hidden state is taken for 16-bit models: every way relay can go wrong shows there
    already (a wrong key or position in the first layer, bidirectional attention in the second) while the
    summation-order noise of the 16-bit layers has not grown (through 32 random-weight bf16 layers it reaches the
    logits' tolerance), so it is held to the dtype's tolerance and the logits to ``HALF_LOGIT_RTOL``."""
    extra = dict(position_ids=_positions(mask)[:, -ids.shape[1]:]) if positions else {}
    half = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
    out = model(input_ids=ids, attention_mask=mask, **extra, **kwargs, **({"output_hidden_states": True} if half
                                                                           else {}))
    hidden = getattr(out, "hidden_states", None) if half else None
    early = hidden[min(HALF_DEPTH, len(hidden) - 1)][:, -1].float() if hidden else None
    return out.logits[:, -1].float(), early


def _stock_logits(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt and one decode step, each one full forward without a cache: what stock attention computes."""
    ids, mask, step = inputs["ids"], inputs["mask"], inputs["step"]
    first = _last_logits(model, ids, mask, inputs["positions"], use_cache=False)
    ids, mask = torch.cat([ids, step], 1), torch.cat([mask, torch.ones_like(step)], 1)
    return first, _last_logits(model, ids, mask, inputs["positions"], use_cache=False)


def _relay_logits(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The same two steps as the patched ``generate`` runs them: the prefix once at batch 1 into a ``RelayCache``,
    a fork carrying the rows' padding, the suffixes after the prefix in the relay layout, then one decode step."""
    ids, mask, step = inputs["relay_ids"], inputs["relay_mask"], inputs["step"]
    cache = RelayCache.from_prefix(model, inputs["prefix"]).fork(suffix_padding=inputs["n_pad"])
    kwargs = {cache_kwarg_name(model): cache, "use_cache": True}
    first = _last_logits(model, ids[:, PROBE_PREFIX:], mask, inputs["positions"], **kwargs)
    mask = torch.cat([mask, torch.ones_like(step)], 1)
    return first, _last_logits(model, step, mask, inputs["positions"], **kwargs)


def _compare(stock, relay, rtol: float) -> str | None:
    """Where and by how much the relay outputs differ from stock's beyond ``rtol``, or ``None``: logits, or for a
    16-bit model the early hidden state at ``rtol`` and the logits at ``HALF_LOGIT_RTOL``."""
    for what, (a_logits, a_early), (b_logits, b_early) in (("prompt", stock[0], relay[0]),
                                                            ("decode step", stock[1], relay[1])):
        pairs = [(a_logits, b_logits, rtol if a_early is None else HALF_LOGIT_RTOL, "logits")]
        if a_early is not None and b_early is not None:
            pairs.append((a_early, b_early, rtol, f"hidden state after layer {HALF_DEPTH}"))
        for a, b, tol, name in pairs:
            if a.shape != b.shape:
                return f"{what} ({name} of shape {tuple(b.shape)}, stock's {tuple(a.shape)})"
            if bool(torch.isfinite(a).all()) and not bool(torch.isfinite(b).all()):
                return f"{what} (non-finite {name} where stock's are finite)"
            diff = float((a - b).abs().nan_to_num(float("inf")).max())
            scale = float(a.abs().nan_to_num(0.0).max())
            if diff > tol * max(scale, 1.0):
                return f"{what} ({name}: max |diff| {diff:.3g}, max |value| {scale:.3g})"
    return None


@contextlib.contextmanager
def _preserved(model):
    """Run in eval mode (no dropout) on a forked global RNG, then put back every module's attributes, parameters,
    buffers and submodules (a forward may stash state, e.g. rope deltas or a rotary cache) and its training flag."""
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in model.modules()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            model.eval()
            yield
    finally:
        for module, attrs, params, buffers, children in saved:
            for store, old in ((attrs["_parameters"], params), (attrs["_buffers"], buffers),
                               (attrs["_modules"], children)):
                if store.keys() != old.keys() or any(store[k] is not v for k, v in old.items()):
                    store.clear()
                    store.update(old)
            if module.__dict__.keys() != attrs.keys() or any(module.__dict__[k] is not v for k, v in attrs.items()):
                module.__dict__.clear()
                module.__dict__.update(attrs)
