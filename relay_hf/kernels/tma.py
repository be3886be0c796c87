"""TMA descriptors of the prefix K/V: where they can run, and a per-plan cache by prefix address that keeps no prefix
tensor alive. The prefix's full tiles load through them (``jit._attend_tma``); everything else uses pointer loads.

A descriptor covers ``prefix_* [1, H_kv, P, D]`` as ``[H_kv, P, D]`` with blocks ``[1, BLOCK_N, BLOCK_D]``.
"""

from __future__ import annotations

import torch

from .config import DEFAULT_CONFIG, KernelConfig
from .device import hopper, interpreting

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton without TMA descriptors: pointer loads only
    TensorDescriptor = None

MAX_CACHED_DESCRIPTORS = 256  # per plan: a few per layer and prefix; old addresses are dropped first


class _Address:
    """The ``base`` of a cached TMA descriptor: the address and dtype it was built for, never the tensor, so a cached
    descriptor keeps no freed prefix alive (a descriptor is a function of address, shape, strides and dtype only)."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self._ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self._ptr


def tma_layout_ok(t: torch.Tensor, block_d: int, config: KernelConfig) -> bool:
    """TMA can load ``t [1, H_kv, P, D]``'s tiles: Hopper+ (or the interpreter, which emulates it), fp16/bf16, an
    unpadded head dim, unit last stride and 16-byte aligned other strides (the base is checked per call)."""
    return (config.prefix_tma and TensorDescriptor is not None and t.dtype in (torch.float16, torch.bfloat16)
            and t.shape[-1] == block_d and t.shape[2] > 0
            and (interpreting() or (t.is_cuda and hopper(t.device.index or 0)))
            and t.stride(3) == 1 and all(t.stride(i) * t.element_size() % 16 == 0 for i in (1, 2)))


def prefix_descriptors(prefix_key: torch.Tensor, prefix_value: torch.Tensor, block_n: int, block_d: int,
                       config: KernelConfig = DEFAULT_CONFIG):
    """TMA descriptors over ``[H_kv, P, D]`` for the prefix's full tiles, or ``(None, None)`` where TMA cannot run
    (``tma_layout_ok``, or a base that is not 16-byte aligned). Built on the tensors themselves (what the
    interpreter reads); a plan's calls go through ``PrefixDescriptors``."""
    if not all(tma_layout_ok(x, block_d, config) and x.data_ptr() % 16 == 0 for x in (prefix_key, prefix_value)):
        return None, None
    return tuple(TensorDescriptor(x[0], list(x.shape[1:]), list(x.stride()[1:]), [1, block_n, block_d])
                 for x in (prefix_key, prefix_value))


class PrefixDescriptors:
    """The TMA descriptors of one plan's prefix layout (shapes and strides fixed by the plan), per call's addresses.

    ``by_address`` (CUDA): built once per prefix address and reused while the prefix sits there (every decode step of
    a layer), holding the address, not the tensor. Otherwise (the interpreter, which reads the tensors through their
    descriptors) built per call on the tensors."""

    def __init__(self, prefix_key: torch.Tensor, prefix_value: torch.Tensor, block_n: int, block_d: int,
                 config: KernelConfig, by_address: bool | None = None):
        # TMA where the layout allows; a call whose prefix base is not 16-byte aligned takes the pointer loads
        self.enabled = all(tma_layout_ok(x, block_d, config) for x in (prefix_key, prefix_value))
        self.block = [1, block_n, block_d]
        self.shapes = [list(x.shape[1:]) for x in (prefix_key, prefix_value)]  # [H_kv, P, D] each
        self.strides = (prefix_key.stride()[1:], prefix_value.stride()[1:])
        self.dtype = prefix_key.dtype
        self.by_address = not interpreting() if by_address is None else by_address
        self.cache: dict[tuple[int, int], tuple] = {}

    def get(self, prefix_key: torch.Tensor, prefix_value: torch.Tensor, ptrs: tuple[int, int] | None = None) -> tuple:
        """``(kd, vd)`` TMA descriptors for this call's prefix, or ``(None, None)``: pointer loads. ``ptrs``: the
        tensors' ``data_ptr()``s where the caller has read them already."""
        if not self.enabled:
            return None, None
        if ptrs is None:
            ptrs = (prefix_key.data_ptr(), prefix_value.data_ptr())
        if not self.by_address:
            if ptrs[0] % 16 or ptrs[1] % 16:
                return None, None
            return tuple(TensorDescriptor(x[0], shape, list(st), self.block)
                         for x, shape, st in zip((prefix_key, prefix_value), self.shapes, self.strides))
        descs = self.cache.get(ptrs)
        if descs is None:
            if ptrs[0] % 16 or ptrs[1] % 16:
                descs = (None, None)
            else:
                descs = tuple(TensorDescriptor(_Address(ptr, self.dtype), shape, list(st), self.block)
                              for ptr, shape, st in zip(ptrs, self.shapes, self.strides))
            if len(self.cache) >= MAX_CACHED_DESCRIPTORS:
                self.cache.pop(next(iter(self.cache)))
            self.cache[ptrs] = descs
        return descs


__all__ = ["MAX_CACHED_DESCRIPTORS", "PrefixDescriptors", "TensorDescriptor", "prefix_descriptors", "tma_layout_ok"]
