"""relay-flash3: RelayAttention (arXiv 2402.14808) behind the flash-attention interface transformers' continuous
batching calls.

* ``flash_attn_with_kvcache`` — a decode step over a paged KV cache: writes each request's new K/V into its page,
  reads a run of leading pages shared by several requests (their prefix) once for all of them, each request's
  suffix (its other pages) apart, and merges the parts exactly by log-sum-exp. The grouping is derived on the
  device from the block table, so the call can be captured in a CUDA graph and replayed at any mix of requests
  (``paged.py``, ``grouping.py``, ``grouping_jit.py``).
* ``flash_attn_varlen_func`` — packed variable-length attention (prefill and mixed steps; ``varlen.py``);
  ``flash_attn_func`` the same for a batch of equal lengths (``dense.py``).

Self-contained: imports torch and (where present) Triton, nothing of relay_hf. On a CPU without
``TRITON_INTERPRET=1`` all run a PyTorch path with the same semantics.
"""

from .dense import flash_attn_func
from .paged import flash_attn_with_kvcache
from .varlen import flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
