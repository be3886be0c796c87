"""The kernel launches of one plan, in order: ``_partials_kernel`` once (one launch for both unit kinds) or twice
(the separate layout: prefix units, then suffix units), then ``_merge_kernel`` unless the suffix launch merges.

Each launch is a grid and its constexprs by name. The first call at an argument layout goes through Triton (which
compiles, or finds the compiled kernel); later calls at the same layout launch those compiled kernels directly
(``direct.DirectLaunch``), CUDA only.
"""

from __future__ import annotations

import torch

from .direct import DirectLaunch, compiled, constexpr_tail
from .jit import DESCRIPTOR_SLOTS, _merge_kernel, _partials_kernel

MAX_COMPILED = 64  # reuse keys per plan (argument layouts); beyond, the oldest is dropped

Grid = tuple[int, int, int]  # (programs, H_kv, 1), as a compiled kernel's launcher takes a grid


class KernelLaunches:
    """``partials``: ``(grid, constexprs)`` of each ``_partials_kernel`` launch, without ``TMA`` (both variants are
    kept, picked per call by the prefix base's alignment); ``merge``: the same for ``_merge_kernel``, or ``None``
    (the suffix launch merges). ``reuse``: keep the compiled kernels for direct launches (``KernelConfig
    .reuse_compiled`` on CUDA)."""

    def __init__(self, partials: list[tuple[Grid, dict]], merge: tuple[Grid, dict] | None, reuse: bool):
        self.partials = {tma: [(grid, dict(kw, TMA=tma)) for grid, kw in partials] for tma in (False, True)}
        self.merge = merge
        self.reuse = reuse
        # compiled kernels and their direct launchers by reuse key (see RelayPlan.run)
        self.compiled: dict[tuple, tuple[tuple, tuple[DirectLaunch, ...]]] = {}
        if reuse:  # a compiled kernel is launched with every parameter's value, constexprs included, in order
            self.tails = {tma: [constexpr_tail(_partials_kernel, kw) for _, kw in variant]
                          for tma, variant in self.partials.items()}
            self.merge_tail = None if merge is None else constexpr_tail(_merge_kernel, merge[1])

    def launch(self, args: tuple, merge_args: tuple | None, tma: bool, reuse_key: tuple | None,
               tma_key: tuple[int, int] | None) -> None:
        """Launch all kernels: ``args`` are ``_partials_kernel``'s runtime arguments (``jit.PARTIALS_PARAMS``),
        ``merge_args`` ``_merge_kernel``'s (``jit.MERGE_PARAMS``; ``None`` without a merge launch); ``tma``: the
        descriptors in ``args`` are set. ``reuse_key``: the argument layout (``None``: launch through Triton, keep
        nothing); ``tma_key``: the prefix addresses, when ``tma``."""
        hit = None if reuse_key is None else self.compiled.get(reuse_key)
        if hit is not None:
            kernels, direct = hit
            for (grid, _), tail, kernel, fast in zip(self.partials[tma], self.tails[tma], kernels, direct):
                if not fast.launch(args, tma_key):
                    kernel[grid](*args, *tail)
            if self.merge is not None and not direct[-1].launch(merge_args, None):
                kernels[-1][self.merge[0]](*merge_args, *self.merge_tail)
            return
        kernels = [_partials_kernel[grid](*args, **kw) for grid, kw in self.partials[tma]]
        if self.merge is not None:
            grid, kw = self.merge
            kernels.append(_merge_kernel[grid](*merge_args, **kw))
        if reuse_key is not None and compiled(kernels):
            if len(self.compiled) >= MAX_COMPILED:
                self.compiled.pop(next(iter(self.compiled)))
            grids = [grid for grid, _ in self.partials[tma]] + ([self.merge[0]] if self.merge is not None else [])
            tails = list(self.tails[tma]) + ([self.merge_tail] if self.merge is not None else [])
            slots = [DESCRIPTOR_SLOTS] * len(self.partials[tma]) + ([None] if self.merge is not None else [])
            index = torch.cuda.current_device()
            direct = tuple(DirectLaunch(k, g, t, index, s) for k, g, t, s in zip(kernels, grids, tails, slots,
                                                                                 strict=True))
            self.compiled[reuse_key] = (tuple(kernels), direct)


__all__ = ["KernelLaunches", "MAX_COMPILED"]
