"""The installed relay_hf's version, in a module of its own: ``artifacts.py`` keys compiled work by it without
importing the package (whose ``__init__`` imports every module, ``artifacts.py`` among them)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("relay_hf")
except PackageNotFoundError:  # pragma: no cover - running from a source tree that was never installed
    __version__ = "0+unknown"
