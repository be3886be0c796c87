"""The one dispatch rule: relay vs the plain path."""

import torch

from relay_hf.policy import CUDA_MIN_SHARED_TOKENS, relay_pays

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_single_row_and_short_prefix_go_plain():
    assert "single row" in relay_pays(1, 4096, CPU, 32)
    assert "min_prefix_length" in relay_pays(8, 16, CPU, 32)
    assert relay_pays(2, 32, CPU, 32) is None


def test_cuda_needs_enough_shared_tokens():
    assert relay_pays(4, 512, CUDA, 32) is not None  # below the smallest measured win
    assert relay_pays(8, 512, CUDA, 32) is None  # measured: relay 1.06x
    assert relay_pays(32, 512, CUDA, 32) is None  # measured: relay 1.84x
    assert relay_pays(4, CUDA_MIN_SHARED_TOKENS // 4, CUDA, 32) is None


def test_captured_loop_runs_relay_from_one_row_on_cuda_only():
    assert relay_pays(1, 100, CUDA, 32, captured_loop=True) is None  # the loop, not the kernel, decides
    assert relay_pays(2, 100, CUDA, 32, captured_loop=True) is None  # below CUDA_MIN_SHARED_TOKENS
    assert "min_prefix_length" in relay_pays(1, 16, CUDA, 32, captured_loop=True)
    assert "single row" in relay_pays(1, 4096, CPU, 32, captured_loop=True)  # no captured loop on CPU
    assert "single row" in relay_pays(1, 4096, CUDA, 32)
