"""Where a patched model's call spends its time: the host functions and, on CUDA, the device kernels.

    python -m benchmarks.profile                                   # H200 / H100: Llama-3-8B shape, bf16
    python -m benchmarks.profile --calls continuous               # generate_batch on a kept manager (CUDA)
    python -m benchmarks.profile --calls patch                    # relay_hf.patch alone, in a fresh process
    python -m benchmarks.profile --model-shape tiny --device cpu --dtype float32 --prefix-len 32 --batch 2 \\
        --user-len 4 --calls first one_row rows continuous --num-blocks 64 --max-batch-tokens 64   # CPU smoke run

The workload is ``benchmarks.generate``'s (a system prompt of ``--prefix-len`` tokens, ``--batch`` rows of
``--user-len`` own tokens each) and ``benchmarks.serve``'s for continuous batching. Calls (``--calls``):

* ``patch``: ``relay_hf.patch`` itself (its probe: in a fresh process the model's first forwards, so the first use
  of the CUDA libraries, and of each attention kernel the probe's shapes select, falls in it);
* ``first``: the first ``generate`` after ``relay_hf.patch`` (``--new-tokens`` new tokens, every row): the one-time
  setup of a new shape (compiling, capturing) and the system prompt's prefill;
* ``one_row``: a warm chat turn: the first row alone, one new token, under the kept system prompt;
* ``rows``: every row, one new token, under the kept system prompt;
* ``steps``: every row, ``--step-tokens`` new tokens under the kept system prompt: the decode steps' kernels, each
  counted once a step and layer, after one short prefill;
* ``continuous``: ``generate_batch`` of the serving workload (``--requests``, ``--new-tokens``) on a manager kept
  from a first call of the same requests (``persistent_manager=True``).

Per call it prints the wall time (the median of ``--reps`` warm calls; ``patch`` and ``first`` run once, under
``cProfile``), then profiles further calls: on CUDA one for the device kernels' total time and count and the kernels
that took longest (``torch.profiler``), and one for the host functions by cumulative time (``cProfile``, ``--top``
lines). A profile is a reading, not a figure: nothing is appended to the CSVs (the timed figures come from
``benchmarks.generate`` and ``benchmarks.serve``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import threading
from types import SimpleNamespace

import torch

import relay_hf

from .common import environment, say, wall_s
from .generate import SHAPES, _inputs, build_model
from .serve import cb_config, generation_config, requests

CALLS = ("patch", "first", "one_row", "rows", "steps", "continuous")


def host_profile(fn, top: int) -> str:
    """``fn()`` under ``cProfile``, with the threads it starts (continuous batching steps in a thread of its
    manager): their functions by cumulative time, ``top`` lines. From Python 3.12 one profiler sees every thread
    (``sys.monitoring``); before, each new thread gets its own, started by its first event."""
    profilers = [cProfile.Profile()]

    def begin(*_):  # a new thread's first event (before 3.12): profile the thread from here on
        sys.setprofile(None)
        profilers.append(cProfile.Profile())
        profilers[-1].enable()

    per_thread = sys.version_info < (3, 12)
    if per_thread:
        threading.setprofile(begin)
    profilers[0].enable()
    try:
        fn()
    finally:
        profilers[0].disable()
        if per_thread:
            threading.setprofile(None)
    out = io.StringIO()
    stats = pstats.Stats(profilers[0], stream=out)
    for other in profilers[1:]:
        stats.add(other)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def device_profile(fn, device: torch.device, top: int) -> str:
    """``fn()`` under ``torch.profiler`` (CUDA): the kernels' total time and launch count, and the ``top`` kernels by
    their own device time; an empty string off CUDA."""
    if device.type != "cuda":
        return ""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    events = prof.key_averages()
    # the kernels themselves: the CPU ops that launched them carry their time too (as torch's own table footer counts)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    total_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    launches = sum(e.count for e in kernels)
    table = events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=70)
    return f"device kernels: {total_ms:.2f} ms over {launches} launches\n{table}"


def profile_call(name: str, fn, device: torch.device, reps: int, top: int, warm: bool = True) -> float:
    """Print ``fn``'s wall time (median of ``reps`` calls after one warm-up when ``warm``; else its one call), then
    its device and host profiles; returns the wall seconds."""
    if not warm:  # a first call happens once: the profiled call is the timed one
        timed = []
        report = host_profile(lambda: timed.append(wall_s(fn, device)), top)
        say(f"=== {name}: {timed[0] * 1e3:,.1f} ms (one call, under cProfile, which slows the host)")
        print(report)
        return timed[0]
    fn()
    wall = statistics.median(wall_s(fn, device) for _ in range(reps))
    say(f"=== {name}: {wall * 1e3:,.1f} ms")
    print(device_profile(fn, device, top))
    print(host_profile(fn, top))
    return wall


def main(argv=None) -> dict[str, float]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--prefix-len", type=int, default=4096, help="S: the system prompt's tokens")
    p.add_argument("--batch", type=int, default=64, help="B: rows of the generate calls")
    p.add_argument("--user-len", type=int, default=64, help="U: each row's own tokens")
    p.add_argument("--new-tokens", type=int, default=8, help="new tokens of the first call and of continuous batching")
    p.add_argument("--step-tokens", type=int, default=128, help="steps: new tokens of the profiled call")
    p.add_argument("--requests", type=int, default=128, help="continuous: requests (own tokens 32-128, serve's)")
    p.add_argument("--num-blocks", type=int, default=None, help="continuous: cache pages (off CUDA: required)")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="continuous: tokens per step (off CUDA: "
                   "required)")
    p.add_argument("--calls", nargs="+", default=["first", "one_row", "rows"], choices=CALLS)
    p.add_argument("--reps", type=int, default=5, help="timed warm calls per call")
    p.add_argument("--top", type=int, default=30, help="lines of each profile")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env = environment(device)
    print(f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}, triton {env['triton']}, "
          f"commit {env['commit']}")
    S, U, B, N = args.prefix_len, args.user_len, args.batch, args.new_tokens
    model = build_model(args.model_shape, device, getattr(torch, args.dtype), S + 2 * max(U, 128) + N + 256)
    walls = {}
    if "patch" in args.calls:
        walls["patch"] = profile_call("relay_hf.patch", lambda: relay_hf.patch(model), device, 1, args.top, warm=False)
    else:
        relay_hf.patch(model)
    vocab = model.config.vocab_size
    system = torch.randint(10, vocab, (1, S), generator=torch.Generator().manual_seed(S)).to(device)
    rows = _inputs(system, B, U, vocab, 7 * B)
    one = {k: v[:1] for k, v in rows.items()}

    def generate(inputs, n):
        return lambda: model.generate(**inputs, max_new_tokens=n)

    with torch.no_grad():
        if "first" in args.calls:
            walls["first"] = profile_call("first call after patch", generate(rows, N), device, 1, args.top,
                                          warm=False)
        elif {"one_row", "rows", "steps"} & set(args.calls):
            generate(rows, N)()  # the setup and the prompt's prefill, so the calls below find it kept
        if "one_row" in args.calls:
            walls["one_row"] = profile_call("one row under the kept prompt, first token", generate(one, 1), device,
                                            args.reps, args.top)
        if "rows" in args.calls:
            walls["rows"] = profile_call(f"{B} rows under the kept prompt, first token", generate(rows, 1), device,
                                         args.reps, args.top)
        if "steps" in args.calls:
            walls["steps"] = profile_call(f"{B} rows under the kept prompt, {args.step_tokens} new tokens",
                                          generate(rows, args.step_tokens), device, args.reps, args.top)
    if "continuous" in args.calls:
        served = requests(vocab, args.requests, S, 1, (32, 128), 0)
        config = cb_config(SimpleNamespace(page_size=None, num_blocks=args.num_blocks,
                                           max_batch_tokens=args.max_batch_tokens))

        def batch():
            return model.generate_batch(served, generation_config=generation_config(model, N),
                                        continuous_batching_config=config, persistent_manager=True)

        walls["continuous"] = profile_call(f"generate_batch, {args.requests} requests x {N} new tokens, kept manager",
                                           batch, device, args.reps, args.top)
        model.destroy_cached_continuous_batching_manager()
    relay_hf.unpatch(model)
    return walls


if __name__ == "__main__":
    main()
