"""The kernel check asked before the first relay call on CUDA (``kernels.check``), and the reference-only switch the
patch-time probe runs under: what a compiled call must never trace."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensorMode

import relay_hf.kernels.check as check
from relay_hf.kernels import AttentionOptions, StepMetadata, attend


@pytest.fixture
def fresh():
    check.kernel_reason.cache_clear()
    yield check.kernel_reason
    check.kernel_reason.cache_clear()


def test_a_kernel_that_agrees_with_the_reference_has_no_reason(fresh):
    # on a CPU relay_attention is the reference itself; on CUDA this is the Triton kernel against it
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert fresh(device, torch.float32, 4, 2, 16) is None
    assert fresh(device, torch.float64, 4, 2, 16) is None  # the kernel does not take it: the reference serves


def test_a_kernel_that_fails_or_differs_gives_the_reason(fresh, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(check, "relay_attention", broken)
    reason = fresh(torch.device("cpu"), torch.bfloat16, 8, 2, 256)
    assert "failed" in reason and "out of resources" in reason and "8 / 2 heads of 256" in reason
    fresh.cache_clear()
    monkeypatch.setattr(check, "relay_attention", lambda q, *a, **k: torch.zeros_like(q))
    assert "differs from its PyTorch reference" in fresh(torch.device("cpu"), torch.float32, 4, 2, 16)


def test_a_compiled_call_never_reads_the_reference_only_switch():
    # dynamo cannot trace a context variable: attend's dispatch must decide without reading it while compiling
    with FakeTensorMode():
        q = torch.empty(2, 4, 1, 16, device="cuda", dtype=torch.bfloat16)
        prefix = torch.empty(1, 2, 8, 16, device="cuda", dtype=torch.bfloat16)
        suffix = torch.empty(2, 2, 3, 16, device="cuda", dtype=torch.bfloat16)
    step, options = StepMetadata(), AttentionOptions()
    try:
        torch._dynamo.export(lambda *t: attend(step, options, *t, True))(q, prefix, prefix, suffix, suffix)
    except torch._dynamo.exc.Unsupported as error:  # a graph break in the dispatch
        pytest.fail(f"attend's dispatch breaks a compiled graph: {error}")
    except Exception:  # noqa: BLE001 - past the dispatch (a torch built without CUDA cannot run the op's fake)
        pass
