"""Regional compilation of the decode step: one compiled graph serves every decoder layer of the model.

Why: compiling the whole forward traces and compiles every layer again (a 32-layer 8B model took about a minute on
its first call, docs/performance.md); the layers share their code and shapes, so one layer's graph serves them all
(PyTorch's regional compilation recipe). The loop's forward then runs ``decode_view(model, cache, region)``: a
shallow copy of the model whose decoder-layer list holds ``RegionalLayer`` wrappers. The user's model, its modules
and its parameters are never modified (the copy shares the parameters and hooks, so it computes what the model
computes).

Two things would make every layer its own graph, and each wrapper removes them before the compiled region sees the
call:

* the cache: transformers hands every layer the same cache and the layer picks its own entry by ``layer_idx``, an
  int the compiled graph would specialise on (a recompile per layer). A wrapper hands its layer a ``LayerCacheView``
  of its own entry instead, which ignores the index; the wrapper is only made for a layer whose ``layer_idx``
  attributes all equal its position.
* the sizes: rows, prefix length and suffix capacity are marked dynamic, so one graph serves every batch bucket and
  prompt length (a one-row bucket still specialises: dynamo treats a size of 1 apart).

One region is compiled per model and compile settings (``RelayState.region``) and shared by all its decode steps; it
compiles its own copy of the region's code (``region_function``), so two models never share one code object's graphs
and recompile limit. A model whose layers still need a graph each (a per-layer constant the layer reads) can reach
dynamo's recompile limit; the step then falls back to the eager step (``step.DecodeStep``), after putting back the
cache positions the layers before the failure wrote.
"""

from __future__ import annotations

import copy
import types

import torch


def decoder_layers(model) -> tuple[tuple[str, ...], torch.nn.ModuleList] | None:
    """``(path, layers)``: the model's decoder-layer list and its attribute path from ``model``: the one
    ``ModuleList`` of the text config's ``num_hidden_layers`` modules of one class the model names in
    ``_no_split_modules``, whose layers name their cache entry (``layer_idx``, equal to their position: the view
    stands for the cache only then). ``None`` when there is no such list, or more than one, or when a module on its
    path has its own ``forward`` set on the instance (accelerate's hooks: the shallow copy would call the original
    module, so the layers would run uncompiled)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    count = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    found = []
    for path, module in model.named_modules():
        if (path and isinstance(module, torch.nn.ModuleList) and len(module) == count
                and all(type(m).__name__ in names for m in module) and len({type(m) for m in module}) == 1
                and _indexed(module)):
            found.append((tuple(path.split(".")), module))
    if len(found) != 1:  # none, or a vision tower as deep as the decoder: which is which is not known
        return None
    path = found[0][0]
    on_path = [model] + [model.get_submodule(".".join(path[:i])) for i in range(1, len(path) + 1)]
    if any("forward" in vars(m) for m in on_path):
        return None
    return found[0]


def _indexed(layers: torch.nn.ModuleList) -> bool:
    """Every layer names its own position as ``layer_idx`` (at least one module of each; none names another)."""
    for position, layer in enumerate(layers):
        indices = {m.__dict__["layer_idx"] for m in layer.modules() if "layer_idx" in m.__dict__}
        if indices != {position}:
            return False
    return True


class LayerCacheView:
    """Layer ``index`` of ``cache`` as the whole cache looks to that layer's attention: ``update`` writes this entry
    whatever index it is called with (``decoder_layers`` checked that the layer only ever names its own), and every
    other attribute is the cache's."""

    def __init__(self, cache, index: int):
        self.cache, self.entry = cache, cache.layers[index]

        def part(name):  # a static layer's buffers (a dynamic layer has no row_lengths)
            return getattr(self.entry, name, None)

        _dynamic(part("prefix_keys"), 2)  # [1, H_kv, P, D]
        _dynamic(part("prefix_values"), 2)
        _dynamic(part("keys"), 0, 2)  # [Rb, H_kv, S, D] (filled by the prefill before a decode step is made)
        _dynamic(part("values"), 0, 2)
        _dynamic(part("row_lengths"), 0)  # [Rb]

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.cache.update_layer(self.entry, key_states, value_states)

    def __getattr__(self, name):
        return getattr(self.cache, name)


def _dynamic(tensor, *dims: int) -> None:
    """Compile ``tensor`` with ``dims`` symbolic (rows, prefix and suffix lengths): one graph then serves every batch
    bucket, prompt length and token budget, so a new one costs a CUDA-graph capture, not a compile. ``maybe``: a dim
    the graph does specialise on is specialised (a recompile), never an error."""
    if isinstance(tensor, torch.Tensor):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


class RegionalLayer(torch.nn.Module):
    """A decoder layer run through the compiled ``region``, handed a ``LayerCacheView`` in place of ``cache``.
    Attributes the model's forward reads from its layers (``attention_type``, ...) are the layer's."""

    def __init__(self, layer: torch.nn.Module, index: int, cache, region):
        super().__init__()
        # plain attributes, not submodules: the wrapper owns nothing, the layer stays the model's
        self.__dict__.update(layer=layer, view=LayerCacheView(cache, index), cache=cache, region=region)

    def forward(self, *args, **kwargs):
        cache, view = self.__dict__["cache"], self.__dict__["view"]
        args = tuple(view if a is cache else a for a in args)
        kwargs = {k: view if v is cache else v for k, v in kwargs.items()}
        for value in (*args, *kwargs.values()):  # hidden states, position embeddings, ... [Rb, ...]
            for t in value if isinstance(value, tuple) else (value,):
                _dynamic(t, 0)
        return self.__dict__["region"](self.__dict__["layer"], args, kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["layer"], name)


def _run_layer(layer, args, kwargs):
    return layer(*args, **kwargs)


def region_function():
    """A fresh copy of the function the region compiles (its own code object, so its own dynamo cache: one per
    model and compile settings)."""
    return types.FunctionType(_run_layer.__code__.replace(), _run_layer.__globals__, "relay_decoder_layer")


def decode_view(model, path: tuple[str, ...], cache, region) -> torch.nn.Module:
    """A shallow copy of ``model`` whose module at ``path`` (the decoder-layer list) holds ``RegionalLayer``s over
    the model's own layers; everything else is the model's own objects."""
    layers = model.get_submodule(".".join(path))
    wrapped = torch.nn.ModuleList([RegionalLayer(layer, i, cache, region) for i, layer in enumerate(layers)])
    return _replaced(model, path, wrapped)


def _replaced(module: torch.nn.Module, path: tuple[str, ...], new: torch.nn.Module) -> torch.nn.Module:
    if not path:
        return new
    clone = copy.copy(module)
    clone.__dict__["_modules"] = dict(module._modules)  # its own child table; the children stay shared
    clone._modules[path[0]] = _replaced(module._modules[path[0]], path[1:], new)
    return clone
