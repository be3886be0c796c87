"""The compiled decode step's artifacts, kept across processes in the user's cache directory.

Why: compiling the decoder-layer region (``regional.py``) is one-time work per model shape, dtype and software stack; a
new process would otherwise compile it again. After the first compiled step is captured, torch's portable cache
artifacts (``torch.compiler.save_cache_artifacts``: inductor's compiled graphs and their kernels) are written to one
file per key, and again to a file of its own once a suffix prefill has compiled through the same layer
(``DecodeStep.keep_prefill_compiled``); a later process loads them (``load_cache_artifacts``) before its first compile,
which then finds the work done (docs/performance.md, the cold-call rows).

The directory is ``$RELAY_HF_CACHE_DIR``, else ``$XDG_CACHE_HOME/relay_hf``, else ``~/.cache/relay_hf``. Reading or
writing it never fails a call: a missing, unreadable or stale file is compiled again and rewritten.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path

import torch

from ._version import __version__

logger = logging.getLogger("relay_hf")

_TRIED: set[Path] = set()  # files this process has tried to load (once each)
_KEPT: set[Path] = set()  # files loaded or written by this process: nothing to write
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """Where the artifacts live (module docstring)."""
    explicit = os.environ.get("RELAY_HF_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.path.expanduser("~")
        base = os.path.join(home if os.path.isabs(home) else tempfile.gettempdir(), ".cache")  # no home: temp
    return Path(base) / "relay_hf"


def artifact_path(model, settings: str) -> Path | None:
    """The file for ``model``'s compiled region under ``settings`` (the compile arguments): keyed by the model's class
    and config, its dtype and device kind, and the versions of torch, transformers, triton and relay_hf. ``None``
    (nothing kept) when the key cannot be built, e.g. a config attribute that does not serialise."""
    try:
        return _artifact_path(model, settings)
    except Exception as err:  # noqa: BLE001 - never lose the user's call over a cache file
        logger.info("relay_hf: not keeping compiled artifacts (%s: %s)", type(err).__name__, err)
        return None


def _artifact_path(model, settings: str) -> Path:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = model.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    parts = (type(model).__qualname__, model.config.to_json_string(use_diff=False), str(model.dtype), device_name,
             torch.__version__, transformers.__version__, triton_version, __version__, settings)
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:24]
    return cache_dir() / "compiled" / f"{type(model).__name__}-{digest}.bin"


def load(path: Path) -> bool:
    """Load the artifacts at ``path`` into torch's caches (once per process); ``True`` when there were some."""
    with _LOCK:
        if path in _TRIED:
            return False
        _TRIED.add(path)
    try:
        data = path.read_bytes()
    except OSError:
        return False
    try:
        loaded = torch.compiler.load_cache_artifacts(data)  # None: nothing in it could be read (torch logged why)
    except Exception as err:  # noqa: BLE001 - a stale or damaged file: compile again, rewrite it
        logger.info("relay_hf: ignoring the compiled artifacts at %s (%s: %s)", path, type(err).__name__, err)
        return False
    if loaded is None:
        return False
    with _LOCK:
        _KEPT.add(path)
    return True


def save(path: Path) -> None:
    """Write what this process has compiled to ``path`` (once per process, and not over artifacts it loaded from
    there), atomically; errors are logged only."""
    with _LOCK:
        if path in _KEPT:
            return
        _KEPT.add(path)
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(saved[0])
        partial.replace(path)
    except Exception as err:  # noqa: BLE001 - never lose the user's call over a cache file
        logger.info("relay_hf: could not keep the compiled artifacts at %s (%s: %s)", path, type(err).__name__, err)
