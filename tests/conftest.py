"""Fixtures (helpers live in tests/helpers.py): the embedded SmolLM2 model, loaded once per session; the system
prompt of the examples; a tiny model per architecture, unpatched afterwards."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU interpreter; must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import relay_hf  # noqa: E402
from tests.helpers import ARCHS, REPO, SMOLLM2_FILE, smollm2_dir, tiny_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) for SmolLM2-135M-Instruct in fp32 on CPU; dequantised once (~20 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=SMOLLM2_FILE, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=SMOLLM2_FILE)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # some tokenizers versions read no pad token from the GGUF
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


@pytest.fixture(scope="session")
def system_prompt() -> str:
    return (REPO / "examples" / "system_prompt.md").read_text()


@pytest.fixture(params=list(ARCHS))
def arch_model(request):
    """A tiny random model of each of the five architectures in ``tests.helpers.ARCHS``; unpatched afterwards."""
    model = tiny_model(request.param)
    yield model
    relay_hf.unpatch(model)
