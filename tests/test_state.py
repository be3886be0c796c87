"""What a patched model keeps: up to two idle static slots, each handed to one call at a time; settings survive
copies."""

import copy
import pickle
import threading

import pytest
import torch

import relay_hf
from relay_hf.graphs import Captured
from relay_hf.state import RelayState, StaticSlot, attach_state, detach_state, relay_state
from tests.helpers import shared_prefix_batch, tiny_model


def test_the_idle_slot_goes_to_one_caller_at_a_time():
    state = RelayState("sdpa", 8, None)
    slot = StaticSlot(cache=object())
    assert state.take_static(lambda cache: True) is None
    state.give_back_static(slot)
    taken = []
    barrier = threading.Barrier(4)

    def take():
        barrier.wait()
        taken.append(state.take_static(lambda cache: True))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [s for s in taken if s is not None] == [slot]


def test_two_idle_slots_are_kept_most_recent_first_and_a_misfit_makes_room():
    state = RelayState("sdpa", 8, None)
    first, second, third = StaticSlot(cache="a"), StaticSlot(cache="b"), StaticSlot(cache="c")
    for slot in (first, second, third):
        state.give_back_static(slot)
    assert state.idle_static() is third  # the least recent ("a") was dropped
    assert state.take_static(lambda cache: cache == "b") is second  # any idle slot that fits, the others stay
    assert state.idle_static() is third
    state.give_back_static(second)
    assert state.take_static(lambda cache: cache == "z") is None
    assert state.idle_static() is second and len(state.idle_slots()) == 1  # room made for the caller's new slot
    assert state.idle_slots() == (second,)


def test_copies_keep_the_settings_and_no_buffers():
    state = RelayState("eager", 16, "declined: why")
    state.give_back_static(StaticSlot(cache="buffers"))
    for twin in (copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
        assert (twin.original_attn, twin.min_prefix_length, twin.declined) == ("eager", 16, "declined: why")
        assert twin.idle_static() is None
        twin.give_back_static(StaticSlot(cache="new"))  # a working lock of its own
        assert twin.idle_static().cache == "new"


def test_relay_state_is_what_patch_keeps_on_the_model():
    model = tiny_model("llama")
    assert relay_state(model) is None and relay_state(object()) is None
    relay_hf.patch(model, min_prefix_length=8)
    state = relay_state(model)
    assert isinstance(state, RelayState) and state.declined is None and state.min_prefix_length == 8
    assert relay_hf.patch(model) is model and relay_state(model) is state  # patching again keeps the state
    relay_hf.unpatch(model)
    assert relay_state(model) is None


def test_attach_and_detach_put_the_state_on_the_instance_and_take_it_off():
    model, state = tiny_model("llama"), RelayState("sdpa", 8, "declined: why")
    attach_state(model, state)
    assert relay_state(model) is state and relay_hf.is_patched(model)
    assert relay_state(copy.deepcopy(model)).declined == "declined: why"  # copies carry it
    assert detach_state(model) is state and relay_state(model) is None


# -- a slot's recorded step and prefills, and a model changed between calls ----------------------------------------
def _fresh(t: torch.Tensor, mean: float = 0.0) -> torch.Tensor:
    """Random values of ``t``'s shape, dtype and device, the same for every tensor of that shape."""
    g = torch.Generator().manual_seed(t.numel())
    return (mean + 0.2 * torch.randn(t.shape, generator=g)).to(t.device, t.dtype)


def _replace_a_parameter(model):
    proj = model.model.layers[0].mlp.down_proj
    proj.weight = torch.nn.Parameter(_fresh(proj.weight))


def _replace_a_module(model):  # the final norm: a module the compiled step's view of the model holds directly
    norm = copy.deepcopy(model.model.norm)
    with torch.no_grad():
        norm.weight.copy_(_fresh(norm.weight, mean=1.0))
    model.model.norm = norm


def _add_a_hook(model):
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: 4 * out)


def _write_in_place(model):
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(-2)


CHANGES = {"a parameter replaced": (_replace_a_parameter, False), "a module replaced": (_replace_a_module, False),
           "a hook added": (_add_a_hook, False), "an in-place write": (_write_in_place, True)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_model_changed_between_calls_gets_a_step_made_under_its_structure(device):
    """A static slot's decode step and recorded prefills are replayed only under the structure they were made under
    (``StaticSlot.made_under``): after a parameter or module replaced or a hook added, the next call on relay_hf's
    loop makes its step again (a CUDA graph would read the old parameter, run no hook); an in-place write keeps it
    (the graph reads the new values). Each time the tokens are stock's on the model as changed (fp32; on CUDA the
    step was captured)."""
    model = tiny_model("llama").to(device)
    reference = copy.deepcopy(model)
    relay_hf.patch(model, min_prefix_length=8, decode="graph")
    ids, mask, _ = shared_prefix_batch(seed=43)
    ids, call = ids.to(device), dict(attention_mask=mask.to(device), max_new_tokens=24, do_sample=False)
    before = reference.generate(ids, **call)
    assert torch.equal(model.generate(ids, **call), before)
    for name, (change, kept) in CHANGES.items():
        stepper = relay_state(model).idle_static().stepper
        assert stepper is not None and (device == "cpu" or isinstance(stepper.state, Captured)), name
        change(model)
        change(reference)
        want = reference.generate(ids, **call)
        assert not torch.equal(want, before), name  # the change shows in the tokens
        assert torch.equal(model.generate(ids, **call), want), name
        assert model.relay_last_decision.fast_decode, model.relay_last_decision
        assert (relay_state(model).idle_static().stepper is stepper) == kept, name
        before = want


@pytest.mark.gpu
def test_a_compiled_step_is_made_again_after_a_change_and_gives_what_a_fresh_patch_gives_on_gpu():
    """``decode="compile"`` on CUDA: the compiled step's view of the model holds the modules on the path to its
    decoder layers, and its graph reads by address; after each change the call gives what the same model patched
    afresh gives (its own compile, the same kernels), and its step was made again (kept after an in-place write)."""
    model = tiny_model("llama").cuda()
    reference = copy.deepcopy(model)  # unpatched: changed alongside, patched afresh per change
    relay_hf.patch(model, min_prefix_length=8, decode="compile")
    ids, mask, _ = shared_prefix_batch(seed=45)
    ids, call = ids.cuda(), dict(attention_mask=mask.cuda(), max_new_tokens=24, do_sample=False)
    model.generate(ids, **call)
    for name, (change, kept) in CHANGES.items():
        stepper = relay_state(model).idle_static().stepper
        assert isinstance(stepper.state, Captured) and stepper.compiled, name
        change(model)
        change(reference)
        fresh = relay_hf.patch(copy.deepcopy(reference), min_prefix_length=8, decode="compile")
        want = fresh.generate(ids, **call)
        assert torch.equal(model.generate(ids, **call), want), name
        assert model.relay_last_decision.decode_step == "compiled", model.relay_last_decision
        assert (relay_state(model).idle_static().stepper is stepper) == kept, name


def test_a_step_recorded_while_the_model_changed_is_made_again_by_the_next_call(monkeypatch):
    """A call walks the model once (``policy``); where it records a step or prefill on its slot, it walks
    again before giving the slot back (``StaticSlot.confirm``), and a model changed in between (here by a hook, in
    place of another thread) leaves the slot marked as made under no known structure: the next call makes its step
    again. A call that records nothing walks once."""
    import relay_hf.state

    model = tiny_model("llama")
    relay_hf.patch(model, min_prefix_length=8, decode="graph")
    ids, mask, _ = shared_prefix_batch(seed=44)
    call = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    swapped = []

    def swap_the_norm(module, args):  # once, while the call runs
        if not swapped:
            swapped.append(model.model.norm)
            model.model.norm = copy.deepcopy(model.model.norm)

    handle = model.lm_head.register_forward_pre_hook(swap_the_norm)
    model.generate(ids, **call)
    slot = relay_state(model).idle_static()
    assert swapped and slot.structure is None
    stepper = slot.stepper
    handle.remove()
    walks = []  # the slots' own walks (``StaticSlot.confirm``): the route's are ``policy``'s
    real = relay_hf.state.walk
    monkeypatch.setattr(relay_hf.state, "walk", lambda m: walks.append(1) or real(m))
    model.generate(ids, **call)
    slot = relay_state(model).idle_static()
    assert slot.stepper is not stepper and slot.structure is not None
    assert walks  # its step made again: walked again after the call
    walks.clear()
    model.generate(ids, **call)
    assert relay_state(model).idle_static().stepper is slot.stepper and not walks  # nothing recorded: no walk


def test_a_slot_replays_its_prefills_before_the_walk_only_where_what_they_read_is_still_allocated():
    """``StaticSlot.replayable``: a call routed under the model's latest walk may replay the slot's recorded prefills
    before walking only where every tensor they read is where it was (``SuffixPrefill.allocated``, taken at the
    first recording; not locatable: never); a slot made under another structure drops them anyway."""
    from relay_hf.freshness import addresses
    from relay_hf.suffix_prefill import SuffixPrefill

    model = torch.nn.Linear(4, 4)
    prefill = SuffixPrefill("cache")
    slot = StaticSlot(cache=object(), prefill=prefill, structure="s")
    assert prefill.allocated() and slot.replayable("s")  # nothing recorded yet
    prefill.reads = addresses(model)
    assert slot.replayable("s")
    model.weight = torch.nn.Parameter(torch.zeros(8, 4))
    assert not slot.replayable("s") and slot.replayable("t")
    prefill.reads = None  # a tensor that could not be located
    assert not slot.replayable("s")
