"""When relay pays: the one place that decides relay vs the plain (stock SDPA) path for a batch.

The numbers come from ``python -m relay_hf.bench kernel`` on an H200 (docs/performance.md, session 5): per decode
step the Triton relay kernel beats SDPA over the prefix expanded to the batch from ``rows * prefix_length`` = 4096
tokens on (B=8, S=512: 1.31x; B=8, S=1024: 1.56x). At one row the kernel alone is 0.97-1.43x SDPA's speed, and a
single row has nothing to share, so ``generate`` runs stock there (no prefix split, stock cache).

Except where the call would run on relay_hf's captured decode loop (``captured_loop``: a static cache on CUDA with
compile on, greedy, no processors; ``decode.fast_reason``). There the loop, not the kernel, decides: transformers'
static loop is host-bound while the captured step replays back to back, and the attention kernel's few microseconds
either way are noise next to that. H200, bf16, Llama-3-8B, median decode step (docs/performance.md, session 8): one
row 5.38 / 5.48 / 5.62 ms vs stock static 7.50 / 9.27 / 10.77 ms at S = 1024 / 4096 / 8192; 8 rows x 256 shared
tokens (below the threshold) 5.49 vs 27.1 ms. So such calls run relay from one row and any prefix of
``min_prefix_length`` tokens (for one row the "prefix" is its prompt but the last token). On CPU the PyTorch path
wins as soon as two rows share the prefix.
"""

from __future__ import annotations

import torch

CUDA_MIN_SHARED_TOKENS = 4096  # rows * prefix tokens below which the CUDA relay kernel is not measured to win


def relay_pays(rows: int, prefix_length: int, device: torch.device, min_prefix_length: int,
               captured_loop: bool = False) -> str | None:
    """``None`` when relay should serve this batch, else the reason it should not. ``captured_loop``: the call
    would run on relay_hf's CUDA-graph decode loop (only counts on CUDA)."""
    captured_loop = captured_loop and device.type == "cuda"
    if rows < 2 and not captured_loop:
        return "a single row has nothing to share"
    if prefix_length < min_prefix_length:
        return f"common prefix of {prefix_length} tokens is below min_prefix_length={min_prefix_length}"
    if device.type == "cuda" and not captured_loop and rows * prefix_length < CUDA_MIN_SHARED_TOKENS:
        return (f"{rows} rows x {prefix_length} prefix tokens < {CUDA_MIN_SHARED_TOKENS}: SDPA is faster on this "
                "GPU (relay_hf.dispatch)")
    return None
