"""Does relay's Triton kernel build, run and agree with its PyTorch reference on this device and head shape?

``patch``'s probe decides on the model's structure with the reference (``kernels.reference_only``), so it compiles
no kernel. What it no longer sees is a kernel that cannot build or run here (a tile that needs more shared memory than
this GPU has, an architecture Triton does not serve) or computes wrongly: this check asks, once per process, device,
dtype and head shape, before the first relay call on CUDA (``policy.kernel_check``), so such a model runs stock with
the reason instead of failing in its first call. It compiles the kernel variants of a short prefill and a decode step
(shapes as small as the kernels take), which the first call then reuses where its shapes map to the same variants.
"""

from __future__ import annotations

from functools import cache

import torch

from . import relay_attention, relay_attention_torch

# tolerance of a kernel against its PyTorch path (this check, and the flash road's, ``flash.check_reason``): fp32
# differs by summation order only, 16-bit types by their rounding
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}


@cache
def kernel_reason(device: torch.device, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why relay's kernel cannot serve calls of this shape on ``device`` (it failed to build or run, or differs from
    the reference on a random prefill and decode step: ``[3, q_heads, L_q, head_dim]`` queries over a 37-token prefix
    and 9 own tokens per row), or ``None``. Dtypes the kernel does not take run the reference anyway: ``None``."""
    if dtype not in TOLERANCE or q_heads % max(1, kv_heads) or head_dim <= 0:
        return None
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.5).to(device=device, dtype=dtype)

    rows, prefix, own = 3, 37, 9
    prefix_kv = rand(1, kv_heads, prefix, head_dim), rand(1, kv_heads, prefix, head_dim)
    suffix_kv = rand(rows, kv_heads, own, head_dim), rand(rows, kv_heads, own, head_dim)
    try:
        with torch.no_grad():
            for L_q in (own, 1):
                query = rand(rows, q_heads, L_q, head_dim)
                got = relay_attention(query, *prefix_kv, *suffix_kv, )
                want = relay_attention_torch(query, *prefix_kv, *suffix_kv, )
                tol = TOLERANCE[dtype]
                if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                    return (f"relay's Triton kernel differs from its PyTorch reference on {device} ({dtype}, "
                            f"{q_heads} / {kv_heads} heads of {head_dim})")
    except Exception as error:  # a kernel that cannot build or run here: stock serves, with the reason
        return (f"relay's Triton kernel failed on {device} ({dtype}, {q_heads} / {kv_heads} heads of {head_dim}): "
                f"{type(error).__name__}: {str(error)[:200]}")
    return None
