"""Values the host hands the device without waiting for it.

A plain copy of a CPU tensor to CUDA waits for everything queued on the stream before it. A call that launched work
before laying itself out (a kept prefix's check: ``kept.launch_checks``) would then idle the host until that work is
done; copied through pinned memory, the copy is queued like a kernel and the host goes on (docs/performance.md, the
chat turn).
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (a CPU tensor the caller does not change afterwards) on ``device``: on CUDA a copy queued through pinned
    memory (torch's pinned-memory pool keeps the staging buffer until the copy is done), elsewhere ``t.to(device)``."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
