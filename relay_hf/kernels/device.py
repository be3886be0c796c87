"""What this machine can run the Triton relay kernels on: Triton importable, a CUDA device or the CPU interpreter
(``TRITON_INTERPRET=1``), the SM count a work split plans for, and whether a device is Hopper or newer (TMA
descriptors, programmatic dependent launch)."""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None


def triton_available() -> bool:
    """Triton imports and can run here: a CUDA device, or the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


def interpreting() -> bool:
    """Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``, set before Triton is
    imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def num_sms(device_index: int) -> int:
    """The SM count of CUDA device ``device_index``; 4 without CUDA (the interpreter)."""
    if not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def hopper(device_index: int) -> bool:
    """Hopper or newer: TMA descriptors and programmatic dependent launch."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


__all__ = ["hopper", "interpreting", "num_sms", "triton_available"]
