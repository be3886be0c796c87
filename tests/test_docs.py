"""The docs' code and links: every ```python block of README.md and docs/*.md is valid Python and runs as written.

Conventions (docs/quickstart.md states them for readers):

* the blocks of one page run in order in one namespace, like a notebook, from the repository root;
* a block whose first line is a ``# fragment:`` comment shows part of a program: it is compiled (a syntax check),
  not run;
* ``from_pretrained(..., gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")`` hands back the ``smollm2`` fixture's model
  and tokenizer (fp32 on the CPU, left padding; loaded once per test run) instead of dequantising the file again.

The default run checks every page in seconds: each block compiles, every ``relay_hf`` name a block uses exists, every
repository path a block opens and every relative link resolves, and the pages whose blocks are cheap run. A page that
loads the embedded model generates under its ~820-token system prompt, minutes on a CPU: it runs under ``-m long``.
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import re
from pathlib import Path

import pytest

import relay_hf
from tests.helpers import REPO, SMOLLM2_FILE

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^()\s]+)\)")
HEADING = re.compile(r"^#+[ \t]+(.+?)[ \t]*$", re.MULTILINE)
FRAGMENT = "# fragment:"
# a printed line that reports nothing done: a bare zero ("0" finished, "0" relay steps) or a zero count of work
NOTHING_DONE = re.compile(r"^\s*0+(\.0*)?\s*$|\b0 (of \d+ )?(requests?|answers?|tokens?|steps?)\b")


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(first line number, code)`` of every ```python block of ``page``."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def is_fragment(code: str) -> bool:
    return code.lstrip().startswith(FRAGMENT)


def loads_embedded_model(page: Path) -> bool:
    return SMOLLM2_FILE in page.read_text()


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


RUNNABLE = [p for p in PAGES if any(not is_fragment(code) for _, code in python_blocks(p))]
BLOCKS = [(page, line, code) for page in PAGES for line, code in python_blocks(page)]


def _page_param(page: Path):
    marks = [pytest.mark.slow, pytest.mark.long] if loads_embedded_model(page) else []
    return pytest.param(page, id=str(page.relative_to(REPO)), marks=marks)


def test_docs_have_python_blocks_and_few_fragments():
    """The pages the reader starts from carry code that runs; fragments stay the exception."""
    names = {p.relative_to(REPO).as_posix() for p in RUNNABLE}
    assert {"docs/quickstart.md", "docs/api.md"} <= names
    fragments = [(p.name, line) for p, line, code in BLOCKS if is_fragment(code)]
    runnable = [(p.name, line) for p, line, code in BLOCKS if not is_fragment(code)]
    assert len(fragments) <= 2 and len(fragments) < len(runnable), fragments


def test_every_python_block_is_valid_python():
    for page, line, code in BLOCKS:
        compile(code, f"{page.relative_to(REPO)}:{line}", "exec")


def test_relay_hf_names_the_blocks_use_exist():
    """``relay_hf.X`` and ``from relay_hf... import X`` in any block (fragments too) name what the package has: a
    renamed function fails here in the default run, not only when the page's blocks run."""
    used = []
    for page, line, code in BLOCKS:
        where = f"{page.relative_to(REPO)}:{line}"
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "relay_hf":
                used.append((where, "relay_hf", node.attr))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "relay_hf":
                used += [(where, node.module, alias.name) for alias in node.names]
    assert used, "no block uses relay_hf"
    missing = []
    for where, module, name in used:
        try:
            found = hasattr(__import__(module, fromlist=[name]), name)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{where}: {module}.{name}")
    assert not missing, missing


def test_repository_paths_the_blocks_name_exist():
    """String literals of the runnable blocks that name a file of the repository (``"examples/system_prompt.md"``)
    point at one that exists."""
    named = [(page, line, node.value) for page, line, code in BLOCKS if not is_fragment(code)
             for node in ast.walk(ast.parse(code))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.fullmatch(r"[\w.\-]+(/[\w.\-]+)+\.\w+", node.value)]
    assert any(path == "examples/system_prompt.md" for _, _, path in named)
    missing = [f"{page.relative_to(REPO)}:{line}: {path}" for page, line, path in named if not (REPO / path).exists()]
    assert not missing, missing


def test_relative_links_resolve():
    """Every link of the pages to a file of the repository (and to a heading of a page, ``page.md#heading``)
    resolves; links inside code blocks are not links."""
    broken, checked = [], 0
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif fragment and file.suffix == ".md" and fragment not in map(anchor, HEADING.findall(
                    FENCE.sub("", file.read_text()))):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert checked > 10 and not broken, broken


@pytest.fixture
def smollm2_from_pretrained(request, monkeypatch):
    """Loading the embedded SmolLM2 returns the fixture's objects; yields that model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = request.getfixturevalue("smollm2")
    real_model, real_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def model_from_pretrained(*args, **kwargs):
        return model if kwargs.get("gguf_file") == SMOLLM2_FILE else real_model(*args, **kwargs)

    def tokenizer_from_pretrained(*args, **kwargs):
        return tokenizer if kwargs.get("gguf_file") == SMOLLM2_FILE else real_tokenizer(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model_from_pretrained)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tokenizer_from_pretrained)
    yield model
    relay_hf.unpatch(model)  # a page that patched the shared model leaves it stock for the next test
    assert not relay_hf.is_patched(model)


# Where transformers' errors go: the root logger, and the loggers that do not propagate to it: the library's own
# (``transformers``, outside CI) and continuous batching's (``ContinuousBatchingLogger``, a top-level name).
WATCHED_LOGGERS = ("", "transformers", "ContinuousBatchingLogger")


class _ErrorRecords(logging.Handler):
    """Keeps the ERROR records of the loggers it is added to (and of their children, from any thread), each once."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: dict[int, logging.LogRecord] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.records[id(record)] = record


def run_block(code: str, where: str, namespace: dict) -> None:
    """Run one block in ``namespace``; fail on an exception, on an ERROR logged meanwhile (transformers' too), on a
    printed line that reports nothing done (``NOTHING_DONE``).

    Raising is not the only way a block fails: continuous batching (``generate_batch``) logs a request that failed,
    or a generation thread that died, and returns what finished, possibly nothing, so such a block runs to its end
    and prints a count of zero. The block's output is printed again, for the report of a failure."""
    errors = _ErrorRecords()
    loggers = [logging.getLogger(name) for name in WATCHED_LOGGERS]
    for logger in loggers:
        logger.addHandler(errors)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, where, "exec"), namespace)
    except Exception as err:
        raise AssertionError(f"{where}: {type(err).__name__}: {err}") from err
    finally:
        for logger in loggers:
            logger.removeHandler(errors)
        print(out.getvalue(), end="")
    logged = [f"{r.name}: {r.getMessage()}" for r in errors.records.values()]
    assert not logged, f"{where}: logged errors: {logged}"
    idle = [line for line in out.getvalue().splitlines() if NOTHING_DONE.search(line)]
    assert not idle, f"{where}: the block printed that nothing was done: {idle}"


def test_a_block_fails_on_a_logged_error_and_on_nothing_done_but_not_on_work_done():
    """The checks ``run_block`` adds to "it raised", on blocks that take no time."""
    namespace = {}
    run_block("import logging\nlogging.getLogger('transformers.x').warning('w')\nprint('3 of 3 requests finished')",
              "ok", namespace)
    for name in ("transformers.generation", "ContinuousBatchingLogger", "some_library"):
        with pytest.raises(AssertionError, match=f"logged errors.*{name}: Error during batch generation"):
            run_block(f"logging.getLogger({name!r}).error('Error during batch generation')", "logs", namespace)
    for printed in ("print(0)", "print('0 of 3 requests finished, 0 tokens')", "print(f'{0} tokens made')"):
        with pytest.raises(AssertionError, match="nothing was done"):
            run_block(printed, "idle", namespace)
    with pytest.raises(AssertionError, match="ZeroDivisionError"):
        run_block("1 / 0", "raises", namespace)


@pytest.mark.parametrize("page", [_page_param(p) for p in RUNNABLE])
def test_page_python_blocks_run_as_written(page, request, monkeypatch):
    monkeypatch.chdir(REPO)
    if loads_embedded_model(page):
        request.getfixturevalue("smollm2_from_pretrained")
    namespace = {"__name__": f"docs_{page.stem}"}
    for line, code in python_blocks(page):
        if not is_fragment(code):
            run_block(code, f"{page.relative_to(REPO)}, block at line {line}", namespace)
