"""What a model's recorded work depends on: ``kv_dependencies`` sees every change through the model's structure and
version counters, and compares equal when nothing changed."""

import copy
import functools

import pytest
import torch

from relay_hf.dependencies import LatestWalk, kv_dependencies
from tests.helpers import tiny_model


def _edit_in_place(m):
    with torch.no_grad():
        m.model.layers[0].self_attn.k_proj.weight.mul_(1.5)


def _load_other_weights(m):
    m.load_state_dict(tiny_model("llama", seed=1).state_dict())


def _optimizer_step(m):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
    opt.step()


CHANGES = {
    "in-place edit": _edit_in_place,
    "load_state_dict": _load_other_weights,
    "optimizer step": _optimizer_step,
    "to float64": lambda m: m.to(torch.float64),
    "training mode": lambda m: m.train(),
    "attention implementation": lambda m: m.set_attn_implementation("eager"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_through_the_models_structure_changes_the_dependencies(change):
    """Writes in place change the version counters alone, the other changes the structure (what a static slot's
    recorded step is checked against: an in-place write keeps it). (A write that bypasses version counters is each
    kept entry's check's to catch: tests/test_freshness.py.)"""
    model = tiny_model("llama")
    before = kv_dependencies(model)
    assert kv_dependencies(model) == before  # nothing changed: equal (a kept prefix is served)
    CHANGES[change](model)
    after = kv_dependencies(model)
    assert after != before
    in_place = change in ("in-place edit", "load_state_dict", "optimizer step")
    assert (after.structure == before.structure) == in_place
    assert after.versions != before.versions or not in_place


def test_reading_the_model_changes_nothing():
    model = tiny_model("llama")
    before = kv_dependencies(model)
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5]]))
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, do_sample=False)
    assert kv_dependencies(model) == before


def test_a_child_registered_under_a_non_string_key_is_walked_and_its_change_seen():
    """``_modules`` keys are strings by convention only: a child put there under an int is still a module the
    forward may run, so the walk names it by its key and sees a change to it."""
    model = torch.nn.Sequential()
    model._modules[0] = torch.nn.Linear(2, 2)
    before = kv_dependencies(model)
    assert [entry[0] for entry in before.structure[1][0][:-1]] == ["", "0"]
    model._modules[0].train(False)
    assert kv_dependencies(model) != before


def test_the_walk_finds_the_layers_windows_and_kv_sizes_a_walk_of_their_own_finds():
    """A call reads per-layer windows and KV sizes from its ``kv_dependencies`` walk (``Dependencies.indexed``), not
    from a walk of their own: the same answers; and after a change, the next call's walk sees it (the values are
    the walk's, never kept across calls)."""
    from relay_hf.prefill import layer_windows
    from relay_hf.stats import layer_kv_bytes
    from tests.helpers import tiny_model_of_type

    model = tiny_model_of_type("gemma2")
    depends = kv_dependencies(model)
    assert layer_windows(model, depends) == layer_windows(model) and any(layer_windows(model))
    sizes = layer_kv_bytes(model, depends)
    assert sizes == layer_kv_bytes(model)
    window = next(w for w in layer_windows(model) if w is not None)
    attention = next(m for m in model.modules() if getattr(m, "sliding_window", None) == window)
    attention.sliding_window = window + 1
    again = kv_dependencies(model)
    assert again != depends and window + 1 in layer_windows(model, again)
    assert layer_windows(model, again) == layer_windows(model)
    attention.k_proj = torch.nn.Linear(attention.k_proj.in_features, 2 * attention.k_proj.out_features, bias=False)
    again = kv_dependencies(model)
    assert again != depends and layer_kv_bytes(model, again) == layer_kv_bytes(model) != sizes


def test_a_forward_replaced_by_one_that_took_the_freed_ones_id_is_a_change():
    """``id`` outlives its object: a ``forward`` set on the instance, removed, and replaced by a new one allocated
    where it was (as accelerate's hooks are removed and added again) has the old one's ``id``; the signature still
    differs (a weak reference, equal only while its referent lives)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    layer = model[0]
    layer.forward = functools.partial(torch.nn.Linear.forward, layer)
    first = id(layer.forward)
    before = kv_dependencies(model)
    del layer.forward
    new = functools.partial(torch.nn.Linear.forward, layer)
    for _ in range(100):  # (CPython reuses the freed block for the next object of its size)
        if id(new) == first:
            break
        new = functools.partial(torch.nn.Linear.forward, layer)
    assert id(new) == first  # the case this test is about
    layer.forward = new
    assert kv_dependencies(model) != before


def test_the_latest_walk_holds_no_module_and_gives_the_walk_back_while_what_it_found_lives():
    """``LatestWalk`` (what a patched model keeps of its latest walk between calls) gives back ``Dependencies`` equal
    to the walk's, with the same modules; a module it found that the user drops is freed, and it then answers
    ``None`` (the model changed: the call walks it first)."""
    import gc
    import weakref

    model = tiny_model("llama")
    depends = kv_dependencies(model)
    latest = LatestWalk(depends)
    again = latest.depends()
    assert again == depends and [m for _, m in again.indexed] == [m for _, m in depends.indexed]
    old = weakref.ref(model.model.layers[0].self_attn)
    model.model.layers[0].self_attn = copy.deepcopy(model.model.layers[0].self_attn)
    del depends, again
    gc.collect()
    assert old() is None and latest.depends() is None
