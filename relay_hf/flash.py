"""relay's attention as a kernel package behind transformers' flash interface (continuous batching's fast path).

The directory ``flash_kernel/`` follows the ``kernels`` package's layout (``build/torch-universal/metadata.json`` and
``build/torch-universal/relay_flash3/``), so it could be published on the Hub unchanged; its code imports nothing
from relay_hf. Its metadata names the ``cuda`` backend, which ``kernels`` 0.16 (transformers 5.17) and 0.19 both
parse; the variant directory is the noarch ``torch-universal`` (Triton and PyTorch code, nothing compiled ahead).

transformers loads it by the id ``KERNEL_ID`` through the ``LOCAL_KERNELS`` environment variable (``offer_kernel``;
no network), in this process and in the processes it spawns (``transformers serve``'s engine). relay_hf and its tests
load the same files with ``load_kernel``; ``check_reason`` runs it once per device and shape against its own
PyTorch path before a manager relies on it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from .kernels.check import TOLERANCE

KERNEL_ID = "relay-hf/relay-flash3"  # transformers takes its continuous-batching fast path only for ".*flash.*[23]"
KERNEL_DIR = Path(__file__).resolve().parent / "flash_kernel"
VARIANT_DIR = KERNEL_DIR / "build" / "torch-universal"
_OWN_NAME = "relay_hf._relay_flash3"  # relay_hf's copy, when the kernels package has not loaded the kernel


@cache
def kernel_metadata() -> dict:
    """The kernel's ``metadata.json`` (id, name, version, license, backend), read once: ``load_kernel`` asks for its
    id on every call, and the flash road calls it at every forward (``begin_step``)."""
    return json.loads((VARIANT_DIR / "metadata.json").read_text())


def load_kernel() -> ModuleType:
    """The kernel module, imported once per process: by the ``kernels`` package where it is installed (the module
    transformers then finds for ``KERNEL_ID``), else by relay_hf from the same files."""
    module = sys.modules.get(kernel_metadata()["id"]) or sys.modules.get(_OWN_NAME)
    if module is not None:
        return module
    try:
        import kernels

        return kernels.get_local_kernel(KERNEL_DIR)
    except Exception:  # no kernels package, or one whose loader refuses the directory: relay_hf's own copy
        pass
    package = VARIANT_DIR / "relay_flash3"
    spec = importlib.util.spec_from_file_location(_OWN_NAME, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[_OWN_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(_OWN_NAME, None)
        raise
    return module


def local_kernels_entry() -> str:
    """``KERNEL_ID=<directory>``: the ``LOCAL_KERNELS`` entry that lets transformers load the kernel by its id."""
    return f"{KERNEL_ID}={KERNEL_DIR}"


def offer_kernel() -> None:
    """Add ``local_kernels_entry`` to ``LOCAL_KERNELS`` (kept entries for other kernels stay; once)."""
    entries = [e for e in os.environ.get("LOCAL_KERNELS", "").split(":") if e]
    if local_kernels_entry() not in entries:
        entries = [e for e in entries if not e.startswith(f"{KERNEL_ID}=")] + [local_kernels_entry()]
        os.environ["LOCAL_KERNELS"] = ":".join(entries)


@cache
def check_reason(device: torch.device, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the kernel cannot serve this device and shape (it failed to build or run, or differs from its PyTorch
    path on a small random step with shared pages), or ``None``. Run once per device, dtype and head shape."""
    kernel = load_kernel()
    gen = torch.Generator().manual_seed(0)
    page, rows = 16, 4
    table = torch.tensor([[0, 1, 2, -1], [0, 1, 3, -1], [0, 4, 5, -1], [6, 7, -1, -1]], dtype=torch.int32)
    past = torch.tensor([40, 37, 33, 20], dtype=torch.int32)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.5).to(device=device, dtype=dtype)

    q, k, v = rand(rows, 1, q_heads, head_dim), rand(rows, 1, kv_heads, head_dim), rand(rows, 1, kv_heads, head_dim)
    caches = rand(8, page, kv_heads, head_dim), rand(8, page, kv_heads, head_dim)
    tol = TOLERANCE[dtype]
    try:
        outs = []
        table, past = table.to(device), past.to(device)
        # groups made here, one row per tile (any tile size up to the kernel's serves): not the step memo's
        groups = kernel.grouping.share_groups(table, past, page, rows_per_tile=1)
        for run, extra in ((kernel.paged.paged_relay_triton, {"groups": groups}),
                           (kernel.paged.paged_attention_torch, {})):
            kc, vc = caches[0].clone(), caches[1].clone()
            outs.append(run(q, kc, vc, k, v, table, past, head_dim ** -0.5, 0.0, None, **extra))
        cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
        qs, ks = rand(12, q_heads, head_dim), rand(12, kv_heads, head_dim)
        packed = [kernel.varlen.varlen_attention(qs, ks, ks, cu, cu, 7, causal=True, use_triton=triton)
                  for triton in (True, False)]
    except Exception as error:  # a kernel that cannot build or run here: the host-planned road serves instead
        return f"relay's flash kernel failed on {device} ({dtype}): {type(error).__name__}: {str(error)[:200]}"
    for (name, got, want) in (("paged decode", *outs), ("varlen", *packed)):
        if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            return f"relay's flash kernel ({name}) differs from its PyTorch path on {device} ({dtype})"
    return None


def read_totals(device: torch.device) -> tuple[int, int, int]:
    """``(steps, rows, tokens)`` the kernel has counted on ``device`` in this process: steps in which requests read
    shared pages once, the requests of those steps, and the shared tokens they did not read again (all models and
    managers of the process together; the first call starts the count)."""
    return load_kernel().paged.read_totals(device)


def begin_step(model, args) -> None:
    """Forward pre-hook of a model on the flash road: a step begins, so the kernel derives its shared pages again at
    the step's first layer (in eager steps and in the forward a CUDA graph records alike)."""
    load_kernel().paged.begin_step()


def forget_steps() -> None:
    """The kernel drops what it keeps of steps in flight (their caches and graphs are gone)."""
    load_kernel().paged.forget_steps()
