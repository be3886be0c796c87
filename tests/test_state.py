"""What a patched model keeps: up to two idle static slots, each handed to one call at a time; settings survive
copies."""

import copy
import pickle
import threading

import relay_hf
from relay_hf.state import RelayState, StaticSlot, attach_state, detach_state, relay_state
from tests.helpers import tiny_model


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
