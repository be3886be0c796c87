"""What a kept prefix's check costs on a hit (``relay_hf.freshness``), against the ``generate`` call it guards.

    python -m benchmarks.kept_check                      # H200: Llama-3-8B shape, bf16, S=4096, B=64, 32 new tokens
    python -m benchmarks.kept_check --model-shape smollm2-135m --device cpu --dtype float32 --prefix-len 820 --batch 8

Prints the wall time of a warm ``generate`` call under a kept system prompt (``prefix_kept`` = S), the median time of
the hit's check alone (``SegmentCheck.holds``: a CUDA-graph replay of two tokens through the decoder on CUDA, an eager
forward elsewhere; the embedding fingerprint; the partial-reach sums), of the structure read every call
(``dependencies.kv_dependencies``, host only), and their shares of the call.
"""

from __future__ import annotations

import argparse
import time

import torch

import relay_hf
from benchmarks.common import sync
from benchmarks.generate import SHAPES, build_model
from relay_hf.dependencies import kv_dependencies
from relay_hf.freshness import SegmentCheck


def _wall(fn, device, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--user-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    S, B, U, N = args.prefix_len, args.batch, args.user_len, args.new_tokens
    model = build_model(args.model_shape, device, dtype, S + U + N + 8)
    relay_hf.patch(model)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    system = torch.randint(3, vocab, (S,), generator=g)
    ids = torch.cat([system.expand(B, S), torch.randint(3, vocab, (B, U), generator=g)], 1).to(device)
    mask = torch.ones_like(ids)
    call = lambda: model.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False)  # noqa: E731
    call()  # the first call prefills the prompt (and compiles / captures on CUDA)
    generate_s = _wall(call, device, args.reps)
    assert model.relay_last_decision.prefix_kept == S
    depends = kv_dependencies(model)
    check = SegmentCheck.record(model, system, system, {"partial_params": depends.partial})
    assert check.holds(model, system)
    # as a call's prefill runs them: the structure once per call, then the hit's check (its memo seeded by the first)
    depends_s = _wall(lambda: kv_dependencies(model), device, 2 * args.reps)
    check_s = _wall(lambda: check.holds(model, system, {"partial_params": depends.partial}), device, 2 * args.reps)
    print(f"{args.model_shape} {args.dtype} on {args.device}, S={S} B={B} U={U} N={N}")
    print(f"generate under the kept prompt: {generate_s * 1e3:.1f} ms; the hit's check: {check_s * 1e3:.2f} ms "
          f"({100 * check_s / generate_s:.2f}% of the call); the structure (every call): {depends_s * 1e3:.2f} ms "
          f"({100 * depends_s / generate_s:.2f}%)")


if __name__ == "__main__":
    main()
