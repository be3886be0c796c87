"""The flash road of continuous batching (``policy.continuous_route``, ``continuous.RelayContinuousBatching``): a
patched model's managers run relay's flash kernel on transformers' decode fast path, with stock continuous
batching's tokens.

transformers takes that path on CUDA only; here it is opened on the CPU for the kernel's id (the test turns off
transformers' device check for it, and relay_hf's), so block tables, ``cache_seqlens`` and page sharing come from
transformers' own scheduler and cache exactly as on a GPU. The kernel runs its PyTorch paths (its Triton kernels
are checked against a float64 oracle in tests/test_flash_kernel) except where a test says so."""

from __future__ import annotations

import functools

import pytest
import torch

import relay_hf
from relay_hf import _compat, policy
from relay_hf.flash import KERNEL_ID, check_reason, load_kernel
from relay_hf.stats import full_layer_kv_bytes
from tests.helpers import tiny_model
from tests.test_continuous import (
    cb_config,
    finished,
    freed_without_the_cycle_collector,
    greedy,
    persistent_generate_batch,
    requests_under,
    started_and_stopped,
    tokens,
)

pytestmark = pytest.mark.skipif(not (_compat.decode_fast_path_available() and _compat.kernels_available()),
                                reason="this transformers has no decode fast path, or no kernels package it accepts")


@pytest.fixture
def kernel(monkeypatch):
    """The kernel module transformers calls, on its PyTorch paths, and the fast path opened on the CPU."""
    from transformers.generation.continuous_batching import initialization

    module = load_kernel()
    monkeypatch.setattr(module.paged, "triton_serves", lambda q: False)
    monkeypatch.setattr(module.varlen, "triton_serves", lambda q: False)
    monkeypatch.setattr(module.paged, "_STEP_GROUPS", module.paged._StepGroups())
    check = initialization.ensure_decode_fast_path_is_available

    def keep_for_relay(config, cb_config, user_requested):
        if KERNEL_ID not in (config._attn_implementation or ""):
            return check(config, cb_config, user_requested)
        if cb_config.max_blocks_per_request is None:
            cb_config.max_blocks_per_request = 16

    monkeypatch.setattr(initialization, "ensure_decode_fast_path_is_available", keep_for_relay)
    monkeypatch.setattr(policy, "flash_reason", policy.flash_fit_reason)
    return module


@pytest.fixture
def llama():
    return tiny_model("llama", seed=3)


def _calls(module, name, monkeypatch):
    """Count the calls of the kernel module's function ``name`` (one its entry points look up at each call:
    transformers keeps the entry points themselves from when it loaded the kernel)."""
    seen = []
    original = getattr(module, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        seen.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return seen


def test_generate_batch_runs_the_flash_kernel_and_gives_stock_tokens(llama, kernel, monkeypatch):
    inputs = requests_under([(48, 4), (40, 3)])
    stock = tokens(llama.generate_batch(inputs, generation_config=greedy(), continuous_batching_config=cb_config()),
                   len(inputs))
    decodes = _calls(kernel.paged, "paged_attention_torch", monkeypatch)
    relay_hf.patch(llama, min_prefix_length=8)
    relay = tokens(llama.generate_batch(inputs, generation_config=greedy(), continuous_batching_config=cb_config()),
                   len(inputs))
    assert relay == stock and decodes
    assert llama.relay_continuous_road == "flash" and llama.relay_continuous_reason is None
    assert llama.config._attn_implementation == "relay"  # back once the manager stopped


def test_shared_pages_found_in_real_block_tables_are_read_once(llama, kernel, monkeypatch):
    # the kernel's Triton path (CPU interpreter) on the paged steps: the groups it derives from transformers' tables
    monkeypatch.setattr(kernel.paged, "triton_serves", lambda q: True)
    derived = []
    share_groups = kernel.grouping.share_groups
    monkeypatch.setattr(kernel.grouping, "share_groups", lambda *a: derived.append(share_groups(*a)) or derived[-1])
    inputs = requests_under([(48, 4)], seed=5)
    gen = greedy(4)
    stock = tokens(llama.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb_config()), 4)
    relay_hf.patch(llama, min_prefix_length=8)
    relay = tokens(llama.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb_config()), 4)
    shared = [groups.bounds[:, 0].tolist() for groups in derived]
    assert relay == stock
    assert shared and all(pages == 48 // 16 for step in shared for pages in step)  # 3 full pages of the prompt
    seen = relay_hf.stats(llama)  # counted on the device by the kernel, folded in when the manager stopped
    assert seen.relay_steps > 0 and seen.relay_rows >= 2 * seen.relay_steps
    # per step, its requests share 3 pages that one tile reads: all but one request's reads of them not done again
    per_request = 3 * 16 * full_layer_kv_bytes(llama)
    assert seen.kv_bytes_not_reread == (seen.relay_rows - seen.relay_steps) * per_request


def test_seeded_sampling_gives_stock_tokens(llama, kernel):
    from transformers import GenerationConfig

    inputs = requests_under([(48, 5)], seed=2)
    gen = GenerationConfig(max_new_tokens=10, do_sample=True, top_k=20, temperature=0.9, eos_token_id=2,
                           pad_token_id=0)
    stock = tokens(llama.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb_config(seed=11)),
                   5)
    relay_hf.patch(llama, min_prefix_length=8)
    relay = tokens(llama.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb_config(seed=11)),
                   5)
    assert relay == stock and llama.relay_continuous_road == "flash"


def test_requests_joining_and_a_cancelled_one_and_generate_meanwhile(llama, kernel):
    inputs = requests_under([(48, 4)], seed=4)
    gen = greedy(16)
    want = [llama.generate(torch.tensor([p]), generation_config=gen)[0, len(p):].tolist() for p in inputs]
    plain = llama.generate(torch.tensor(inputs[:1]), max_new_tokens=5, do_sample=False)
    relay_hf.patch(llama, min_prefix_length=8)
    manager = llama.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config())
    manager.start()
    try:
        manager.add_request(inputs[0], request_id="r0")
        manager.add_request(inputs[1], request_id="r1")
        doomed = manager.add_request(inputs[3], request_id="doomed", max_new_tokens=200)
        manager.cancel_request(doomed)
        # a plain generate while the manager runs: stock, through the kernel's own flash functions (transformers
        # 5.17 runs the manager under a "paged|" name that generate cannot call: a clear error instead)
        if llama.config._attn_implementation == KERNEL_ID:
            assert torch.equal(llama.generate(torch.tensor(inputs[:1]), max_new_tokens=5, do_sample=False), plain)
            assert "flash kernel" in llama.relay_last_decision.reason
        else:
            with pytest.raises(ValueError, match="stop it before calling generate"):
                llama.generate(torch.tensor(inputs[:1]), max_new_tokens=5, do_sample=False)
        manager.add_request(inputs[2], request_id="r2")
        manager.add_request(inputs[3], request_id="r3")
        got = finished(manager, 4, skip=doomed)
        with pytest.raises(ValueError, match="stop it before relay_hf.unpatch"):
            relay_hf.unpatch(llama)
    finally:
        manager.stop(block=True, timeout=30)
    assert [got.get(f"r{i}") for i in range(4)] == want
    assert llama.config._attn_implementation == "relay"


def test_the_kernel_is_selected_for_the_patched_model_only(llama, kernel):
    other = tiny_model("llama", seed=4)
    relay_hf.patch(llama, min_prefix_length=8)
    manager = llama.init_continuous_batching(generation_config=greedy(), continuous_batching_config=cb_config())
    try:
        assert llama.config._attn_implementation.rpartition("|")[2] == KERNEL_ID
        assert other.config._attn_implementation == "sdpa"
        ids = torch.tensor(requests_under([(20, 1)], seed=6))
        want = tiny_model("llama", seed=4).generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(other.generate(ids, max_new_tokens=4, do_sample=False), want)
    finally:
        manager.stop(block=True, timeout=30)
    assert llama.config._attn_implementation == "relay"


def test_cuda_graphs_and_compiled_steps_stay_on_the_flash_road(llama, kernel):
    from transformers import ContinuousBatchingConfig

    relay_hf.patch(llama, min_prefix_length=8)
    assert policy.continuous_route(llama, ContinuousBatchingConfig(use_cuda_graph=True)) == (None, None)
    off = ContinuousBatchingConfig(max_blocks_per_request=0, use_cuda_graph=True)
    why, not_flash = policy.continuous_route(llama, off)
    assert "CUDA graphs" in why and "max_blocks_per_request=0" in not_flash


def test_values_of_another_head_size_keep_the_host_road(llama, kernel, monkeypatch):
    monkeypatch.setattr(policy, "kernels_available", lambda: True)  # 5.17's CI has no kernels package
    llama.config.v_head_dim = llama.config.head_dim // 2  # as MLA models declare it: the kernel reads one head size
    try:
        assert "values" in policy.flash_fit_reason(llama, cb_config())
    finally:
        del llama.config.v_head_dim


def test_on_the_cpu_the_host_road_serves_and_says_why(llama):
    relay_hf.patch(llama, min_prefix_length=8)
    inputs = requests_under([(48, 3)], seed=7)
    llama.generate_batch(inputs, generation_config=greedy(4), continuous_batching_config=cb_config())
    assert llama.relay_continuous_road.startswith("host: ") and "CUDA only" in llama.relay_continuous_road
    assert relay_hf.stats(llama).relay_steps > 0


def test_a_kernel_that_differs_from_its_pytorch_path_is_not_used(monkeypatch):
    module = load_kernel()
    check_reason.cache_clear()
    try:
        assert check_reason(torch.device("cpu"), torch.float32, 4, 2, 16) is None  # Triton, interpreted
        check_reason.cache_clear()
        monkeypatch.setattr(module.paged, "paged_relay_triton", lambda *a, **k: torch.zeros_like(a[0]))
        assert "differs from its PyTorch path" in check_reason(torch.device("cpu"), torch.float32, 4, 2, 16)
        check_reason.cache_clear()
        monkeypatch.setattr(module.varlen, "varlen_attention", None)
        assert "TypeError" in check_reason(torch.device("cpu"), torch.float32, 4, 2, 16)
    finally:
        check_reason.cache_clear()


@pytest.mark.gpu
def test_on_cuda_graphs_replay_while_requests_join_and_leave_with_stock_tokens():
    from tests.test_continuous import _stream_until

    model = tiny_model("llama", seed=3).cuda()
    inputs = requests_under([(48, 6)], seed=12)
    gen = greedy(12)
    want = [model.generate(torch.tensor([p], device="cuda"), generation_config=gen)[0, len(p):].tolist()
            for p in inputs]
    relay_hf.patch(model, min_prefix_length=8)
    manager = model.init_continuous_batching(generation_config=gen,
                                             continuous_batching_config=cb_config(use_cuda_graph=True))
    manager.start()
    try:
        assert model.relay_continuous_road == "flash"
        for i in range(3):
            manager.add_request(inputs[i], request_id=f"r{i}", streaming=i == 0)
        _stream_until(manager, "r0", 4)
        doomed = manager.add_request(inputs[5], request_id="doomed", max_new_tokens=200)
        for i in range(3, 6):
            manager.add_request(inputs[i], request_id=f"r{i}")
        manager.cancel_request(doomed)
        got = finished(manager, 6, skip=doomed)
    finally:
        manager.stop(block=True, timeout=30)
    assert [got.get(f"r{i}") for i in range(6)] == want


def test_a_kernel_transformers_does_not_take_leaves_stock_continuous_batching(llama, kernel, monkeypatch):
    import relay_hf.continuous

    def refuse():
        raise ValueError("no kernel here")

    inputs = requests_under([(48, 3)], seed=8)
    stock = tokens(llama.generate_batch(inputs, generation_config=greedy(4), continuous_batching_config=cb_config()),
                   3)
    relay_hf.patch(llama, min_prefix_length=8)
    monkeypatch.setattr(relay_hf.continuous, "offer_kernel", refuse)
    relay = tokens(llama.generate_batch(inputs, generation_config=greedy(4), continuous_batching_config=cb_config()),
                   3)
    assert relay == stock and "did not take relay's flash kernel" in llama.relay_continuous_reason
    assert llama.config._attn_implementation == "relay" and relay_hf.stats(llama).stock_calls == 1


@pytest.mark.parametrize("make", [persistent_generate_batch, started_and_stopped])
def test_a_manager_let_go_of_is_freed_at_once_as_stock(llama, kernel, make, monkeypatch):
    decodes = _calls(kernel.paged, "paged_attention_torch", monkeypatch)
    relay_hf.patch(llama, min_prefix_length=8)
    assert freed_without_the_cycle_collector(llama, make)
    assert llama.relay_continuous_road == "flash" and decodes
