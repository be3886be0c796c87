"""When relay pays: the one place that decides relay vs the plain (stock SDPA) path for a batch.

The numbers come from ``python -m relay_hf.bench kernel`` on an H200 (docs/performance.md, session 5): per decode
step the Triton relay kernel beats SDPA over the prefix expanded to the batch from ``rows * prefix_length`` = 4096
tokens on (B=8, S=512: 1.31x; B=8, S=1024: 1.56x). At one row the kernel alone is 0.97-1.43x SDPA's speed, but a
single row has nothing to share, so ``generate`` runs stock there (no prefix split, stock cache). On CPU the PyTorch
path wins as soon as two rows share the prefix.
"""

from __future__ import annotations

import torch

CUDA_MIN_SHARED_TOKENS = 4096  # rows * prefix tokens below which the CUDA relay kernel is not measured to win


def relay_pays(rows: int, prefix_length: int, device: torch.device, min_prefix_length: int) -> str | None:
    """``None`` when relay should serve this batch, else the reason it should not."""
    if rows < 2:
        return "a single row has nothing to share"
    if prefix_length < min_prefix_length:
        return f"common prefix of {prefix_length} tokens is below min_prefix_length={min_prefix_length}"
    if device.type == "cuda" and rows * prefix_length < CUDA_MIN_SHARED_TOKENS:
        return (f"{rows} rows x {prefix_length} prefix tokens < {CUDA_MIN_SHARED_TOKENS}: SDPA is faster on this "
                "GPU (relay_hf.dispatch)")
    return None
