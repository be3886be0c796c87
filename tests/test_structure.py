"""The package's house rules, read from its source (CONTRIBUTING.md says why each holds):

* imports run one way: no circle among ``relay_hf``'s modules, counting imports inside functions and those made only
  while type checking;
* short pieces: no module over 500 lines unless its docstring says why ("long because ..."), no class over 200
  lines, no function over 70;
* one owner per rule: the attention options are named only where they are defined (``kernels/options.py``), computed
  (the Triton kernels, the reference) and read from a module (the attention glue); only ``state.py`` touches the
  model's relay state.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGE = REPO / "relay_hf"
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 500, 200, 70
# the modules allowed to name an attention option, and the one allowed to read the model's relay state
OPTION_MODULES = {"relay_hf/kernels/options.py", "relay_hf/kernels/jit.py", "relay_hf/kernels/reference.py",
                  "relay_hf/attention.py"}
STATE_MODULES = {"relay_hf/state.py"}
# relay's flash kernel: a kernel package of its own (the ``kernels`` layout), shipped inside relay_hf; it keeps the
# size limits, takes its options as flash-attention's functions do, and imports nothing of relay_hf
KERNEL_PACKAGE = PACKAGE / "flash_kernel"


def _modules(package: bool = True) -> dict[str, Path]:
    """Dotted module name -> file, for every module of relay_hf (``package``) or of its flash kernel package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if (KERNEL_PACKAGE in path.parents) == package:
            continue
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def test_the_flash_kernel_package_imports_nothing_of_relay_hf():
    kernel = _modules(package=False)
    assert len(kernel) >= 4
    for path in kernel.values():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [
                a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not [n for n in names if n.split(".")[0] == "relay_hf"], path


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file (functions and type-checking blocks included). A
    ``from package import submodule`` imports the submodule; the package itself only when a name it defines is
    imported too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            subs = {f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in modules}
            found |= subs
            if source in modules and len(subs) < len(node.names):
                found.add(source)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
    return found - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []
    assert "relay_hf.kernels.plan" in graph["relay_hf.kernels"] or "relay_hf.kernels.metadata" in graph[
        "relay_hf.kernels"]  # the walk sees imports at all


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _long_pieces(path: Path) -> list[str]:
    text = path.read_text()
    tree = ast.parse(text)
    where = path.relative_to(REPO).as_posix()
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE and "long because" not in (ast.get_docstring(tree) or "").lower():
        found.append(f"{where}: {lines} lines, and its docstring does not say why")
    for node in ast.walk(tree):
        limit = {ast.ClassDef: MAX_CLASS, ast.FunctionDef: MAX_FUNCTION, ast.AsyncFunctionDef: MAX_FUNCTION}.get(
            type(node))
        if limit is not None and node.end_lineno - node.lineno + 1 > limit:
            found.append(f"{where}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    return found


def test_modules_classes_and_functions_are_short():
    modules = [*_modules().values(), *_modules(package=False).values()]
    long = [piece for path in modules for piece in _long_pieces(path)]
    assert not long, long


def _naming(pattern: str) -> set[str]:
    return {path.relative_to(REPO).as_posix() for path in _modules().values()
            if re.search(pattern, path.read_text(), re.IGNORECASE)}


@pytest.mark.parametrize("pattern,owners", [("softcap", OPTION_MODULES), (r"_relay_state\b", STATE_MODULES)])
def test_one_owner_per_rule(pattern, owners):
    named = _naming(pattern)
    assert named and named <= owners, sorted(named - owners)
