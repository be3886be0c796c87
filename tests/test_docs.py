"""Every ```python block of README.md and docs/*.md runs as written.

Conventions (docs/quickstart.md states them for readers):

* the blocks of one page run in order in one namespace, like a notebook, from the repository root;
* a block whose first line is a ``# fragment:`` comment shows part of a program: it is compiled (a syntax check),
  not run;
* ``from_pretrained(..., gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")`` hands back the ``smollm2`` fixture's model
  and tokenizer (fp32 on the CPU, left padding; loaded once per test run) instead of dequantising the file again.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import relay_hf
from tests.helpers import REPO, SMOLLM2_FILE

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
FRAGMENT = "# fragment:"


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(first line number, code)`` of every ```python block of ``page``."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def is_fragment(code: str) -> bool:
    return code.lstrip().startswith(FRAGMENT)


RUNNABLE = [p for p in PAGES if any(not is_fragment(code) for _, code in python_blocks(p))]


def _page_param(page: Path):
    marks = [pytest.mark.slow] if SMOLLM2_FILE in page.read_text() else []
    return pytest.param(page, id=str(page.relative_to(REPO)), marks=marks)


def test_docs_have_python_blocks_and_few_fragments():
    """The pages the reader starts from carry code that runs; fragments stay the exception."""
    names = {p.relative_to(REPO).as_posix() for p in RUNNABLE}
    assert {"docs/quickstart.md", "docs/api.md"} <= names
    fragments = [(p.name, line) for p in PAGES for line, code in python_blocks(p) if is_fragment(code)]
    runnable = [(p.name, line) for p in PAGES for line, code in python_blocks(p) if not is_fragment(code)]
    assert len(fragments) <= 2 and len(fragments) < len(runnable), fragments


def test_fragments_are_valid_python():
    for page in PAGES:
        for line, code in python_blocks(page):
            if is_fragment(code):
                compile(code, f"{page}:{line}", "exec")


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


@pytest.mark.parametrize("page", [_page_param(p) for p in RUNNABLE])
def test_page_python_blocks_run_as_written(page, request, monkeypatch):
    monkeypatch.chdir(REPO)
    if SMOLLM2_FILE in page.read_text():
        request.getfixturevalue("smollm2_from_pretrained")
    namespace = {"__name__": f"docs_{page.stem}"}
    for line, code in python_blocks(page):
        if is_fragment(code):
            continue
        try:
            exec(compile(code, f"{page.relative_to(REPO)}:{line}", "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"{page.relative_to(REPO)}, block at line {line}: {type(err).__name__}: {err}") \
                from err
