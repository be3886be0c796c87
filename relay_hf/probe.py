"""Patch-time probe: does this model, switched to ``"relay"``, compute exactly what stock attention computes?

A config cannot say whether an attention module hands its KV to the registered attention function untouched
(DiffLlama splits the values with ``chunk()``, JetMoe repeats them, Doge transposes them, MLA models expand cached
latents themselves) or whether the model attends the way relay assumes (XLM-R / CamemBERT as causal LMs without
``is_decoder`` attend bidirectionally; a model that derives positions from the cache length instead of taking
``position_ids`` sees the relay layout's positions). So ``patch`` asks the model: two rows sharing a 5-token prefix,
the second left-padded by 2, go through

* the stock computation, as stock ``generate`` runs it on the patched model: the prompt as one forward that builds
  the model's own cache, then one decode step on that cache (under ``"relay"`` both run the model's own attention),
* the relay computation, exactly as the patched ``generate`` runs it: ``RelayCache.from_prefix``, a fork carrying the
  rows' padding, the rows' suffixes in the relay layout ``[prefix | pads | suffix]`` (``relay_hf.prefix``), then one
  decode step, relay attention computed by its PyTorch reference on every device (``kernels.reference_only``: the
  question is the model's structure, and on CUDA ``patch`` would otherwise wait for Triton to compile kernels for a
  new head size, which the first call compiles anyway),

and what both steps hand on at the last position is compared.

Only the first few decoder layers run (``_cut``): relay is checked per attention call, so the first layer of each
kind the model has (its layer type and its modules' own settings: sliding or full, with or without RoPE...) and the
layer after the last of them (which carries a difference at earlier positions, such as bidirectional attention, to
the last position) show what the whole depth would: 2 of SmolLM2's 30 layers. What is compared there is the hidden
state after the last kept layer; the final norm and the vocabulary projection are skipped (``_tapped``). The cut is
checked, not assumed: the kept layers run alone must hand on exactly what they hand on inside the whole model (its
stock prompt, stopped where the first layer left out begins); a model whose forward reads more than its layer list
(looped layers, layer counts in its config) fails that check. A model the cut probe does not accept, for whatever
reason, is probed again at full depth, comparing the logits, and that run alone decides: a decline and its reason
always come from the whole model.

The probe's rows (``probe_inputs.py``): a model whose sliding window is at most ``MAX_WINDOW`` tokens (gpt-oss: 128)
gets a prefix past its window, long enough that relay stores the prefix trimmed to the window: the stock prompt, the
stock step on the model's own sliding-window cache and relay's trimmed prefix all run past the window. Longer
windows (Mistral's and Gemma's 512 to 4096) run the same code with larger numbers, where a probe past them would cost
a prefill of that length; tests cover them with small windows.

A model whose forwards change with their length (dynamic NTK or longrope RoPE: ``rope.rope_limits``) is probed
where relay serves it: below that point, or for longrope past it when the point comes before the probe's positions
end; a dynamic NTK model whose point comes that soon is declined with a reason naming its RoPE.

A few milliseconds on a small model, and the model comes back as it was: every module's attributes, parameters,
buffers and training flag, its configs' layer counts, and the global RNG state.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from ._compat import cache_kwarg_name, output_cache
from .cache import RelayCache
from .kernels import reference_only
from .probe_inputs import probe_inputs

# max |relay - stock| over the logits (or the cut's hidden state), relative to max(max |stock value|, 1). fp32 /
# fp64 differ by summation order only; half types round every layer's activations. Worst seen on tiny random models
# of every accepted architecture (the reference on the CPU; on an H200, when the probe ran the Triton kernels, for
# 16 of them): fp32 2e-6, bf16 4.8e-2 (CPU) / 9.8e-3 (CUDA), fp16 1.5e-3 / 5.3e-3. A structural difference
# (bidirectional attention, a lost prefix, shifted positions) moves the logits of a trained model by a sizeable
# fraction of their range (SmolLM2's hidden state after 2 layers by 0.2 of its own); fp32 also catches the small
# shifts of random-weight models.
RTOL = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
DEFAULT_RTOL = 5e-2  # other dtypes (quantized weights)
HALF_DEPTH = 2  # 16-bit models: the hidden state after this many layers is held to the dtype's tolerance,
HALF_LOGIT_RTOL = 0.25  # and the logits to this one (``_last_logits``)
_MAX_ERROR_CHARS = 200
# the last word of a module attribute that names its own position (layer_idx, layer_id, kv_shared_layer_index...):
# not a setting, so it does not make a layer a kind of its own
_POSITION_WORDS = {"idx", "index", "id", "number"}
_SETTING_TYPES = (bool, int, float, str, type(None))


class _Stop(Exception):
    """Ends a forward where the first layer the cut leaves out begins (``_input_of``)."""


def probe_reason(model, *, whole_model: bool = False) -> str | None:
    """Why ``model`` (already switched to ``"relay"``) must not run relay attention, or ``None`` when relay
    reproduces it. ``whole_model``: probe at full depth only, without trying the first layers (``probed_layers``)
    first; a decline is the same either way.

    Returns a short reason naming the class and what happened, e.g. ``"DiffLlamaForCausalLM: its attention module
    does not hand the KV to the attention function (TypeError: chunk(): ...)"``. Returns ``None`` without running
    anything when parameters are on the meta device (offloaded weights): there is nothing to compute with.

    Any exception of the relay computation is a reason. So is one of the stock computation: under ``"relay"`` a plain
    forward is what every later call of the model runs, and a model whose plain forward fails there either fails on
    its own attention too (declining costs nothing: ``generate`` then runs stock, which raises stock's own error) or
    fails because of relay (declining is required). Accepting is only ever the verified answer: on the model's
    first layers when the cut is checked to be faithful (``_accepted_on_first_layers``), else on the whole model.
    """
    if any(p.device.type == "meta" for p in model.parameters()):
        return None
    try:
        inputs = probe_inputs(model)
    except Exception as e:  # a model that cannot be probed is declined; patch never crashes on it
        return f"{type(model).__name__}: relay attention cannot be checked on it ({_short(e)})"
    cut = None if whole_model else _cut(model)
    if cut is not None:
        with _probing(model):
            if _accepted_on_first_layers(model, inputs, *cut):
                return None
    with _probing(model):  # a fresh start: nothing of the cut run (hooks transformers installed on it...) stays
        return _reason(model, inputs, lambda out: _last_logits(out, inputs["hidden"]))


def probed_layers(model) -> int | None:
    """How many of ``model``'s first decoder layers ``probe_reason`` tries it on before the whole model (``_cut``):
    the first layer of each kind and the one after the last of them; ``None`` when it probes the whole model only."""
    cut = _cut(model)
    return None if cut is None else cut[1]


@contextlib.contextmanager
def _probing(model):
    """Where the probe runs: the model preserved (``_preserved``), no autograd, no warnings, and on the CPU one
    intra-op thread (``_one_thread``)."""
    with _preserved(model), torch.no_grad(), warnings.catch_warnings(), _one_thread(model):
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def _one_thread(model):
    """One intra-op thread while a CPU model is probed, the caller's count put back after. The probe's matrices have
    a few rows: threads add nothing but their synchronisation, which on a busy machine (a descheduled thread holds
    every other at each operation's barrier) costs ten times the work itself."""
    threads = torch.get_num_threads()
    cpu = all(p.device.type == "cpu" for p in model.parameters())
    if cpu and threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if cpu and threads > 1:
            torch.set_num_threads(threads)


def _reason(model, inputs: dict, read, names: tuple[str, str] = ("logits", f"hidden state after layer {HALF_DEPTH}")
            ) -> str | None:
    """The probe on ``model`` as it stands (whole, or cut to its first layers): a reason, or ``None``. ``read(out)``
    gives what is compared of a forward (``(main, early)``, ``compare_steps``); ``names`` names them in the reason."""
    name = type(model).__name__
    try:
        stock = _stock_steps(model, inputs, read)
    except Exception as e:
        return f"{name}: a plain forward fails under relay's attention implementation ({_short(e)})"
    try:
        relay = _relay_steps(model, inputs, read)
    except Exception as e:
        if "RelayKV" in str(e) or "RelayMask" in str(e):  # the module operated on the relay objects themselves
            return f"{name}: its attention module does not hand the KV to the attention function ({_short(e)})"
        return f"{name}: relay attention cannot run it ({_short(e)})"
    why = compare_steps(stock, relay, RTOL.get(inputs["dtype"], DEFAULT_RTOL), names)
    if why is None:
        return None
    if not inputs["positions"]:
        return (f"{name}: relay output differs from stock attention on the {why}: its forward takes no "
                "position_ids, so its positions follow the relay layout instead of the rows' tokens")
    return (f"{name}: relay output differs from stock attention on the {why}: bidirectional or otherwise "
            "non-standard attention")


# -- running the first layers only -------------------------------------------------------------------------------
def _cut(model) -> tuple[torch.nn.ModuleList, int, list] | None:
    """Where the probe may stop: ``(layers, k, configs)``, the model's decoder layers, how many of them it runs, and
    the config objects whose ``num_hidden_layers`` counts them; ``None`` when it runs them all.

    ``layers`` is the decoder's ``ModuleList`` of ``num_hidden_layers`` entries (a child of the decoder before one
    further down, and the one holding the most parameters, should there be several). ``k`` covers the first layer of
    every kind (``_layer_kind``) and the one after the last of them."""
    text = model.config.get_text_config(decoder=True)
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 2:
        return None
    try:
        decoder = model.get_decoder()
    except Exception:  # an exotic model without the lookup: its whole module tree
        decoder = model
    # the decoder's own list (``model.layers``, ``transformer.h``) before one deeper down, e.g. a vision tower's
    lists = [[m for m in modules if isinstance(m, torch.nn.ModuleList) and len(m) == n]
             for modules in (decoder.children(), decoder.modules())]
    lists = lists[0] or lists[1]
    if not lists:
        return None
    layers = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    layer_types = getattr(text, "layer_types", None)
    first: dict = {}
    for i, layer in enumerate(layers):
        kind = (layer_types[i] if isinstance(layer_types, (list, tuple)) and i < len(layer_types) else None,
                _layer_kind(layer))
        first.setdefault(kind, i)
    k = max(first.values()) + 2
    if k >= n:
        return None
    configs = {id(c): c for c in (text, getattr(decoder, "config", None))
               if c is not None and getattr(c, "num_hidden_layers", None) == n}
    return layers, k, list(configs.values())


def _layer_kind(layer: torch.nn.Module) -> tuple:
    """What tells a layer's computation apart from another's, short of its weights: each submodule's name and class
    and its plain settings (``sliding_window``, ``use_rope``, ``is_causal``, ``scaling``...), its own position
    (``layer_idx``) and private attributes left out."""
    kind = []
    for name, module in layer.named_modules():
        settings = tuple((key, value) for key, value in vars(module).items()
                         if key[0] != "_" and isinstance(value, _SETTING_TYPES) and key != "training"
                         and key.rsplit("_", 1)[-1] not in _POSITION_WORDS)
        kind.append((name, type(module), settings))
    return tuple(kind)


def _accepted_on_first_layers(model, inputs: dict, layers: torch.nn.ModuleList, k: int, configs: list) -> bool:
    """Whether the probe accepts the model run with only its first ``k`` layers, comparing the hidden state those
    hand on (``_tapped``), and those layers, run alone, hand on what they hand on inside the whole model (so that what
    the probe saw is the model's own computation). Any exception is a ``False``: the whole model is probed then."""
    try:
        whole = _input_of(layers[k], lambda: _forward(model, inputs["ids"], inputs["mask"], inputs, use_cache=True))
        if whole is None:
            return False
        cut_inputs = {**inputs, "hidden": False}  # the hooks read the layers' outputs themselves
        names = (f"hidden state after layer {k}", f"hidden state after layer {HALF_DEPTH}")
        with _only_first(layers, k, configs), _tapped(model, layers, k, inputs["half"]) as (read, first):
            if _reason(model, cut_inputs, read, names) is not None:
                return False
        return bool(first) and _same(whole, first[0], RTOL.get(inputs["dtype"], DEFAULT_RTOL))
    except Exception:
        return False


@contextlib.contextmanager
def _tapped(model, layers: torch.nn.ModuleList, k: int, half: bool):
    """Forward hooks on the cut model that give the probe what it compares: the hidden state after the last kept
    layer, at the last position (and for a 16-bit model also after ``HALF_DEPTH`` layers when that is earlier: the
    same split of tolerances as ``_last_logits``). The final norm and the vocabulary projection apply the same
    per-position map to stock's and relay's hidden states, so they add nothing to the comparison; the output
    embedding gets no rows (``_no_rows``): its weight, SmolLM2's largest matrix, is then not read at all.

    Yields ``(read, first)``: ``read(out)`` the last forward's ``(main [B, hidden], early [B, hidden] or None)``,
    fp32; ``first`` the last kept layer's first output ``[B, T, hidden]`` (the stock prompt's, ``_same``)."""
    early = HALF_DEPTH - 1 if half and k > HALF_DEPTH else None
    seen: dict[int, torch.Tensor] = {}
    first: list[torch.Tensor] = []

    def keeper(i: int):
        def keep(module, args, output):
            seen[i] = output[0] if isinstance(output, (tuple, list)) else output
            if i == k - 1 and not first:
                first.append(seen[i])
        return keep

    handles = [layers[i].register_forward_hook(keeper(i)) for i in {k - 1, early} - {None}]
    head = _output_embeddings(model)
    if head is not None:
        handles.append(head.register_forward_pre_hook(_no_rows))

    def read(out) -> tuple:
        return seen[k - 1][:, -1].float(), None if early is None else seen[early][:, -1].float()

    try:
        yield read, first
    finally:
        for handle in handles:
            handle.remove()


def _output_embeddings(model) -> torch.nn.Module | None:
    """The vocabulary projection module, where it is one of its own (not the input embedding, which some models use
    both ways)."""
    try:
        head = model.get_output_embeddings()
    except Exception:
        return None
    return head if isinstance(head, torch.nn.Module) and head is not model.get_input_embeddings() else None


def _no_rows(module, args):
    """Forward pre-hook: the hidden states ``[..., L, hidden]`` the projection gets, with no positions left."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2 and args[0].is_floating_point():
        return (args[0][..., :0, :], *args[1:])
    return None


def _input_of(layer: torch.nn.Module, forward) -> torch.Tensor | None:
    """The hidden states ``layer`` is called with when ``forward()`` first reaches it; the forward ends there."""
    seen: list = []

    def stop(module, args, kwargs):
        seen.append(args[0] if args else kwargs.get("hidden_states"))
        raise _Stop

    handle = layer.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        forward()
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen[0] if seen and isinstance(seen[0], torch.Tensor) else None


@contextlib.contextmanager
def _only_first(layers: torch.nn.ModuleList, k: int, configs: list):
    """The model with only the first ``k`` of ``layers``, its configs counting ``k`` layers (caches, masks and
    ``RelayCache`` size themselves by it); the same list object and values come back, and each config's attributes
    as they were (a config may derive its layer count, or refuse to set it: then this raises, before any forward)."""
    modules, saved = layers._modules, [(config, dict(vars(config))) for config in configs]
    layers.__dict__["_modules"] = type(modules)(list(modules.items())[:k])
    try:
        for config in configs:
            config.num_hidden_layers = k
            if config.num_hidden_layers != k:
                raise ValueError(f"{type(config).__name__} does not count {k} layers when told to")
        yield
    finally:
        for config, attrs in saved:
            vars(config).clear()
            vars(config).update(attrs)
        layers.__dict__["_modules"] = modules


def _same(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    """Whether two stock hidden states agree to ``rtol`` of the larger of max |a| and 1 (NaN where both have it)."""
    if a.shape != b.shape:
        return False
    a, b = a.float(), b.float()
    both = a.isnan() & b.isnan()
    diff = float((a - b).abs().masked_fill(both, 0.0).nan_to_num(float("inf")).max()) if a.numel() else 0.0
    scale = float(a.abs().nan_to_num(0.0).max()) if a.numel() else 0.0
    return diff <= rtol * max(scale, 1.0)


def _short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    msg = lines[0] if lines else ""
    if len(msg) > _MAX_ERROR_CHARS:
        msg = msg[:_MAX_ERROR_CHARS] + "..."
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as ``generate`` derives them from a left-padded mask: ``cumsum - 1``, pads at 0."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _forward(model, ids: torch.Tensor, mask: torch.Tensor, inputs: dict, **kwargs):
    """One forward of ``ids`` (the last ``ids.shape[1]`` columns of ``mask``), passing what ``generate`` would pass,
    the last position's logits only where the forward can skip the others, and every layer's hidden states where
    ``inputs["hidden"]`` (a 16-bit model probed whole: ``_last_logits``)."""
    if inputs["positions"]:
        kwargs["position_ids"] = _positions(mask)[:, -ids.shape[1]:]
    if inputs["keep"]:
        kwargs["logits_to_keep"] = 1
    if inputs["hidden"]:
        kwargs["output_hidden_states"] = True
    return model(input_ids=ids, attention_mask=mask, **kwargs)


def _last_logits(out, half: bool) -> tuple:
    """What the probe compares of a forward's output: ``(the last position's logits [B, V], its hidden state after
    layer HALF_DEPTH [B, hidden] or None)``, fp32. The hidden state is taken for 16-bit models: every way relay can go
    wrong shows there already (a wrong key or position in the first layer, bidirectional attention in the second)
    while the summation-order noise of the 16-bit layers has not grown (through 32 random-weight bf16 layers it
    reaches the logits' tolerance), so it is held to the dtype's tolerance and the logits to ``HALF_LOGIT_RTOL``."""
    hidden = getattr(out, "hidden_states", None) if half else None
    early = hidden[min(HALF_DEPTH, len(hidden) - 1)][:, -1].float() if hidden else None
    return out.logits[:, -1].float(), early


def _stock_steps(model, inputs: dict, read) -> tuple[tuple, tuple]:
    """The prompt and one decode step as stock ``generate`` runs them on the patched model: the prompt as one forward
    that builds the model's own cache (a sliding-window layer's keeps its window only), then the step on that cache;
    a model that returns no cache gets the step as a second whole forward. ``read(out)`` of each."""
    ids, mask, step = inputs["ids"], inputs["mask"], inputs["step"]
    out = _forward(model, ids, mask, inputs, use_cache=True)
    first = read(out)
    cache, mask = output_cache(out), torch.cat([mask, torch.ones_like(step)], 1)
    if cache is None:
        out = _forward(model, torch.cat([ids, step], 1), mask, inputs, use_cache=False)
    else:
        out = _forward(model, step, mask, inputs, use_cache=True, **{cache_kwarg_name(model): cache})
    return first, read(out)


def _relay_steps(model, inputs: dict, read) -> tuple[tuple, tuple]:
    """The same two steps as the patched ``generate`` runs them: the prefix once at batch 1 into a ``RelayCache``,
    a fork carrying the rows' padding, the suffixes after the prefix in the relay layout, then one decode step."""
    ids, mask, step = inputs["relay_ids"], inputs["relay_mask"], inputs["step"]
    cache = RelayCache.from_prefix(model, inputs["prefix"]).fork(suffix_padding=inputs["n_pad"])
    kwargs = {cache_kwarg_name(model): cache, "use_cache": True}
    with reference_only():  # what is probed is the model's structure: no kernel compiles while patching
        first = read(_forward(model, ids[:, inputs["prefix"].numel():], mask, inputs, **kwargs))
        mask = torch.cat([mask, torch.ones_like(step)], 1)
        return first, read(_forward(model, step, mask, inputs, **kwargs))


def compare_steps(stock, relay, rtol: float,
                  names: tuple[str, str] = ("logits", f"hidden state after layer {HALF_DEPTH}")) -> str | None:
    """Where and by how much the relay outputs differ from stock's beyond ``rtol``, or ``None``: the probe's verdict
    on its two steps (``stock`` / ``relay``: ``(prompt, decode step)``). Each step gives ``(main, early or None)``
    (fp32, ``[B, ...]``): ``main`` (the logits, or the cut model's last hidden state) is held to ``rtol``, or,
    where there is an ``early`` hidden state (16-bit), to ``HALF_LOGIT_RTOL`` and ``early`` to ``rtol``."""
    for what, (a_main, a_early), (b_main, b_early) in (("prompt", stock[0], relay[0]),
                                                        ("decode step", stock[1], relay[1])):
        pairs = [(a_main, b_main, rtol if a_early is None else HALF_LOGIT_RTOL, names[0])]
        if a_early is not None and b_early is not None:
            pairs.append((a_early, b_early, rtol, names[1]))
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
    """Run in eval mode (no dropout) on a forked global RNG, then put back every module's attributes and the contents
    of each dict, set and list among them: parameters, buffers, submodules, and the forward hooks a forward may
    install (transformers' output capturing installs its hooks on a module tree once, flagged by an attribute), and
    the training flag. A forward may stash state (rope deltas, a rotary cache): that goes too."""
    saved = []
    for module in model.modules():
        attrs = dict(module.__dict__)
        # most of them are empty hook dicts: an empty one needs no copy, only to be empty again
        held = [(v, _copy(v) if v else None) for v in attrs.values() if isinstance(v, (dict, set, list))]
        saved.append((module, attrs, held))
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            model.eval()
            yield
    finally:
        for module, attrs, held in saved:
            for store, old in held:
                if old is None:
                    if store:
                        store.clear()
                elif _changed(store, old):
                    store.clear()
                    if isinstance(store, list):
                        store.extend(old)
                    else:
                        store.update(old)
            if module.__dict__.keys() != attrs.keys() or any(module.__dict__[k] is not v for k, v in attrs.items()):
                module.__dict__.clear()
                module.__dict__.update(attrs)


def _copy(store):
    """A shallow copy of a dict, set or list (as a plain one of its kind: it only keeps the objects)."""
    return list(store) if isinstance(store, list) else set(store) if isinstance(store, set) else dict(store)


def _changed(store, old) -> bool:
    """Whether a dict, set or list no longer holds the very objects its copy ``old`` holds."""
    if isinstance(store, dict):
        return store.keys() != old.keys() or any(store[k] is not v for k, v in old.items())
    if isinstance(store, list):
        return len(store) != len(old) or any(a is not b for a, b in zip(store, old))
    return store != old
