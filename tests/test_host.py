"""relay_hf.host: values the host hands the device without waiting for it."""

import pytest
import torch

from relay_hf.host import to_device


def test_off_cuda_the_tensor_is_moved_as_is():
    t = torch.arange(5)
    assert to_device(t, "cpu") is t
    assert to_device(t, torch.device("meta")).device.type == "meta"


@pytest.mark.gpu
def test_on_cuda_the_copy_is_queued_without_waiting_for_the_stream_on_gpu():
    """With a long kernel queued on the stream, the copy returns without a host wait (torch's sync debug mode raises
    on one) and the device gets the values, also when the host changes its tensor right after."""
    t = torch.randint(0, 1000, (3, 4000))
    want = t.clone()
    torch.cuda._sleep(100_000_000)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = to_device(t, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    t.zero_()  # the copy went from pinned memory of its own
    assert out.is_cuda and torch.equal(out.cpu(), want)
