"""The test tree's packages can never stand in for a module of the environment.

A package under ``tests/`` is imported as ``tests.<name>`` by pytest, but wherever ``tests/`` itself is on
``sys.path`` (a script run from there, as ``continuous_tp_worker.py`` is) it is importable as ``<name>``: a test
package called ``kernels`` then answers transformers' ``import kernels`` (the ``kernels`` distribution) and breaks it.
Naming every test package ``test_*`` keeps them out of the namespace distributions use.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import sys
from pathlib import Path

from tests.helpers import REPO

TESTS = REPO / "tests"


def _test_packages() -> list[Path]:
    """Every package directory under ``tests/`` (a folder with an ``__init__.py``), ``tests`` itself left out."""
    return sorted(p.parent for p in TESTS.rglob("__init__.py") if p.parent != TESTS)


def _outside_tests(entry: str) -> bool:
    path = Path(entry or ".").resolve()
    return path != TESTS and TESTS not in path.parents


def _found_elsewhere(name: str) -> str | None:
    """What ``import name`` finds when no folder of ``tests/`` is on the path: a distribution's top-level module, a
    standard-library one, or anything the import machinery locates on the rest of ``sys.path``; ``None`` if none.

    ``sys.modules`` is not consulted (a test package imported under that name earlier would answer for itself), and
    only the path-based finder runs, over ``sys.path`` without ``tests/``, plus the meta-path finders an editable
    install adds, each asked directly."""
    distributions = importlib.metadata.packages_distributions()
    if name in distributions:
        return f"distribution {distributions[name]}"
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return "the standard library"
    path = [entry for entry in sys.path if _outside_tests(entry)]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    for finder in sys.meta_path:
        if spec is not None:
            break
        if finder is importlib.machinery.PathFinder or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, None)
    if spec is None or (spec.origin and not _outside_tests(spec.origin)):
        return None
    return spec.origin or "a namespace package"


def test_every_test_package_is_named_test_and_shadows_nothing_installed():
    packages = _test_packages()
    misnamed = [p.relative_to(REPO).as_posix() for p in packages if not p.name.startswith("test_")]
    assert not misnamed, f"test packages not named test_*: {misnamed}"
    shadowing = {p.relative_to(REPO).as_posix(): found for p in packages
                 if (found := _found_elsewhere(p.name)) is not None}
    assert not shadowing, f"test packages named like an importable module: {shadowing}"
