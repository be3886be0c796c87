"""relay_hf.graphs: work captured as a CUDA graph on the model's device (the decode step's and the kept-prefix
check's one capture helper)."""

import pytest
import torch

from relay_hf.graphs import capture_graph, on_side_stream


@pytest.mark.gpu
def test_a_capture_warms_up_records_without_running_and_replays_on_the_buffers():
    x = torch.arange(4.0, device="cuda")
    runs = []

    def work():
        runs.append(torch.cuda.is_current_stream_capturing())
        return x * 2

    graph, out = capture_graph(work, x.device, warm_up=True)
    assert runs == [False, True]  # one eager warm-up run, then the recording
    x.add_(1)
    graph.replay()
    assert torch.equal(out, (torch.arange(4.0, device="cuda") + 1) * 2)  # the replay read x as it is now


@pytest.mark.gpu
def test_a_failed_capture_raises_and_the_side_stream_is_waited_for():
    x = torch.zeros(3, device="cuda")

    def fails():
        x.add_(1)
        raise RuntimeError("no capture here")

    with pytest.raises(RuntimeError, match="no capture here"):
        on_side_stream(fails, x.device)
    assert torch.equal(x, torch.ones(3, device="cuda"))  # the current stream waited for the side stream's work
    assert on_side_stream(lambda: x + 1, x.device).sum().item() == 6
