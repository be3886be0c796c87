"""The one place that touches Triton's internals: a kernel Triton compiled, launched again through its C launcher
without Triton's per-launch Python (CUDA only; the interpreter compiles nothing).

What is read from Triton, and where Triton 3.x keeps it: ``CompiledKernel`` (``triton.compiler``); its
``_init_handles()``, ``_run`` (the launcher object: ``launch``, ``launch_cooperative_grid``, ``launch_pdl``,
``global_scratch_size``, ``profile_scratch_size``), ``function`` and ``packed_metadata``; the ``launcher`` and
``tensordesc_meta`` cells of the wrapper Triton puts around a launcher that takes tensor descriptors;
``triton.backends.nvidia.driver.make_tensordesc_arg``; ``triton.knobs.runtime.launch_enter_hook`` /
``launch_exit_hook``. Whatever of it is missing or shaped otherwise, ``DirectLaunch`` declines and the caller
launches through Triton.
"""

from __future__ import annotations

import inspect

import torch

try:
    from triton.compiler import CompiledKernel
except ImportError:  # pragma: no cover - no compiled kernels to reuse: every call goes through Triton's launcher
    CompiledKernel = None

MAX_EXPANDED_DESCRIPTORS = 64  # expanded descriptor arguments per kernel, by prefix address


def constexpr_tail(kernel, constexprs: dict) -> tuple:
    """The values of ``kernel``'s constexpr parameters (all after its runtime ones), as Triton's launcher passes them
    to a compiled kernel: from ``constexprs``, else the parameter's default."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    tail = [i for i, p in enumerate(params) if "constexpr" in str(p.annotation)]
    assert tail == list(range(tail[0], len(params))), "constexpr parameters must come last"
    return tuple(constexprs[p.name] if p.name in constexprs else p.default for p in params[tail[0]:])


def runtime_params(kernel) -> tuple[str, ...]:
    """The names of ``kernel``'s runtime (non-constexpr) parameters, in order."""
    return tuple(p.name for p in inspect.signature(kernel.fn).parameters.values()
                 if "constexpr" not in str(p.annotation))


def compiled(kernels) -> bool:
    """Every launch returned a ``CompiledKernel`` (what ``DirectLaunch`` can reuse)."""
    return CompiledKernel is not None and all(isinstance(k, CompiledKernel) for k in kernels)


def can_reuse() -> bool:
    """This Triton has compiled kernels to launch directly."""
    return CompiledKernel is not None


def _idle(hook) -> bool:
    """Whether a Triton launch hook would do nothing (``None``, or a ``HookChain`` with no hook in it): then a launch
    may skip it (profilers register hooks, and then every launch goes through Triton)."""
    return hook is None or getattr(hook, "calls", None) == []


class DirectLaunch:
    """One compiled kernel launched through its C launcher with the arguments it takes, skipping Triton's per-launch
    Python (the runner closure, scratch checks, the tensor-descriptor wrapper that rebuilds each TMA descriptor
    every launch): about half of an eager call's host time (docs/performance.md, eager host column). ``launch``
    returns ``False`` where that is not possible here (a kernel that needs scratch memory, a launch hook, a
    launcher of another shape); the caller then launches through Triton.

    ``descriptor_slots``: the positions of the two (consecutive) TMA-descriptor arguments among the runtime ones
    (``jit.DESCRIPTOR_SLOTS``), expanded into what the C launcher takes; ``None``: the kernel takes none."""

    def __init__(self, kernel, grid: tuple, tail: tuple, device_index: int,
                 descriptor_slots: tuple[int, int] | None = None):
        self.grid, self.tail, self.device_index, self.ok = grid, tail, device_index, False
        if descriptor_slots is not None:
            assert descriptor_slots[1] == descriptor_slots[0] + 1, "descriptor arguments must be consecutive"
        self.slots = descriptor_slots
        try:
            from triton import knobs
            from triton.backends.nvidia.driver import make_tensordesc_arg

            kernel._init_handles()
            run = kernel._run
            launch, meta = run.launch, None
            code = getattr(launch, "__code__", None)  # None: the C launcher itself (no descriptor arguments)
            cells = {} if code is None else dict(zip(code.co_freevars, launch.__closure__ or ()))
            if cells:  # Triton's wrapper for tensor-descriptor arguments: its C launcher and descriptor layouts
                launch, meta = cells["launcher"].cell_contents, cells["tensordesc_meta"].cell_contents
                meta = list(meta) if meta else [None, None]  # no layouts: descriptors go as base, shape, strides
            if run.global_scratch_size or run.profile_scratch_size or not callable(launch):
                return
            self.head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                         kernel.packed_metadata, None, None, None)
            self.c_launch, self.meta, self.expand, self.knobs = launch, meta, make_tensordesc_arg, knobs.runtime
            self.descs: dict[tuple[int, int], tuple] = {}
            self.ok = True
        except (AttributeError, ImportError, KeyError, TypeError, ValueError):
            self.ok = False

    def launch(self, args: tuple, tma_key: tuple[int, int] | None) -> bool:
        """Launch with ``args`` (the kernel's runtime arguments in order; TMA descriptors at ``descriptor_slots``
        when ``tma_key``, the prefix addresses, is given). ``False``: nothing was launched."""
        if not self.ok or not (_idle(self.knobs.launch_enter_hook) and _idle(self.knobs.launch_exit_hook)):
            return False
        if tma_key is not None:
            kd, vd = self.slots
            expanded = self.descs.get(tma_key)
            if expanded is None:
                if self.meta is None or len(self.meta) != 2:
                    self.ok = False
                    return False
                expanded = (*self.expand(args[kd], self.meta[0]), *self.expand(args[vd], self.meta[1]))
                if len(self.descs) >= MAX_EXPANDED_DESCRIPTORS:
                    self.descs.pop(next(iter(self.descs)))
                self.descs[tma_key] = expanded
            args = (*args[:kd], *expanded, *args[vd + 1:])
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        try:
            self.c_launch(*self.grid, stream, *self.head, *args, *self.tail)
        except TypeError:  # the launcher parses its arguments before launching: nothing ran, Triton's path will
            self.ok = False
            return False
        return True


__all__ = ["DirectLaunch", "can_reuse", "compiled", "constexpr_tail", "runtime_params"]
