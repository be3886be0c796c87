"""Serving: requests under shared system prompts through transformers' continuous batching, stock vs patched, and
relay_hf's fixed-batch ``generate`` on the same requests (random-init model, no download).

    python -m benchmarks.serve --requests 128 --prefix-len 2048 --new-tokens 64          # H200, Llama-3-8B shape
    python -m benchmarks.serve --model-shape smollm2-135m --device cpu --dtype float32 --requests 16 \\
        --prefix-len 820 --new-tokens 16 --rates 0.5 1                                    # the CPU point
    python -m benchmarks.serve --model-shape tiny --device cpu --dtype float32 --requests 4 --prefix-len 32 \\
        --new-tokens 4 --rates 2 --csv /tmp/serve.csv                                     # smoke run (seconds)

Workload: ``--requests`` requests, request ``i`` under system prompt ``i * g // R`` of ``g = --groups`` prompts of
S tokens, then its own user prompt of a random length in ``--user-len`` (uniform, inclusive), ``--new-tokens`` new
tokens each (no EOS). Modes:

* ``stock_cb``: ``model.generate_batch(inputs, ...)`` on the unpatched model (sdpa, block sharing on, transformers'
  defaults but the sizes below).
* ``stock_cb_graphs``: the same with ``use_cuda_graph=True`` (CUDA).
* ``relay_cb``: the same call as ``stock_cb`` after ``relay_hf.patch(model)`` (on CUDA relay's flash kernel on
  transformers' decode fast path, CUDA graphs as transformers defaults them for flash kernels; elsewhere the host
  road: ``model.relay_continuous_road``).
* ``flash_cb``: no patch; the model switched to relay's flash kernel by its id (``relay-hf/relay-flash3``), as a
  stock transformers user (or ``transformers serve --attn-implementation``) would run it.
* ``relay_generate``: ``relay_hf.patch(model)``, then plain ``generate(**inputs, max_new_tokens=N)`` over the requests
  in fixed batches of ``--fixed-batch`` rows (left-padded), one batch after the other. Its ``step``: the mean decode
  step of those batches, ``(wall(N) - wall(1)) / (N - 1)`` per batch, to set beside a continuous-batching mode's
  offline ``tpot_p50`` (with ``--fixed-batch`` equal to ``--requests`` both decode every request at once).

The continuous-batching modes get one ``ContinuousBatchingConfig``: ``--max-batch-tokens``, ``--num-blocks`` and
``--page-size`` when given (on a CPU they must be: transformers otherwise sizes the cache from the machine's RAM), and
any other field of it by ``--cb-option FIELD=VALUE`` (what transformers offers against its per-step host work:
``use_async_batching``, the padding intervals, ``default_compile_level``); the rows' ``note`` names them.
``--persistent``: every ``generate_batch`` call keeps its manager (``persistent_manager=True``: its CUDA graphs and
warm-up are kept for the next call; transformers sizes a kept manager by its first call's requests, so the warm-up
is the whole workload, and the prompt pages it cached stay shared for the timed call, as for a user who sends the same
requests again); the rows' ``arrival`` says ``offline persistent``. ``first_call``: the warm-up
call's wall seconds (with ``--full-warm-up``, the whole workload in a fresh manager). ``--gc-freeze``: ``gc.freeze()``
after that call, as a server might after its warm-up (transformers' manager runs a full ``gc.collect()`` whenever a
``generate_batch`` call stops; frozen objects are not walked again); the rows' ``note`` says so.

Offline (all requests at once): ``throughput`` (new tokens / wall s of the whole call, after one warm-up call of
the same mode on 2 requests (``relay_generate``: on its first batch), or on the whole workload with ``--full-warm-up``
or ``--persistent``: Triton compiles a kernel variant the first time a step's shapes need it), and for the
continuous-batching modes ``ttft`` / ``tpot`` p50 and p99 from each request's token timestamps (time to its first
token since it was added; time per output token after it).
Online (``--rates``, requests per second; continuous-batching modes): the first ``--online-requests`` requests arrive
as a Poisson process through ``init_continuous_batching().add_request`` to a manager warmed up first (as
``transformers serve`` warms its manager before it takes requests); ``throughput`` (new tokens / s from the first
arrival to the last result), ``ttft`` and ``tpot`` p50 / p99. Rows go to ``benchmarks/data/serve.csv`` (``--csv``).
"""

from __future__ import annotations

import argparse
import ast
import gc
import random
import time

import torch

import relay_hf
from relay_hf.flash import KERNEL_ID, offer_kernel

from .common import DATA, SERVE_FIELDS, append_rows, environment, print_table, progress, say, sync
from .generate import SHAPES, build_model

MODES = ("stock_cb", "stock_cb_graphs", "relay_cb", "flash_cb", "relay_generate")
DEFAULT_MODES = ("stock_cb", "relay_cb", "relay_generate")


def requests(vocab: int, R: int, S: int, groups: int, user_len: tuple[int, int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, vocab, (groups, S), generator=g).tolist()
    rng = random.Random(seed)
    return [prompts[i * groups // R] + torch.randint(10, vocab, (rng.randint(*user_len),), generator=g).tolist()
            for i in range(R)]


def cb_config(args, mode: str = "stock_cb"):
    from transformers import ContinuousBatchingConfig

    fields = ContinuousBatchingConfig.__dataclass_fields__
    kw = {"use_cuda_graph": True} if mode == "stock_cb_graphs" else {}
    if args.page_size:  # transformers 5.17 calls the page a block
        kw["page_size" if fields.get("page_size") and fields["page_size"].default is not None else "block_size"] = \
            args.page_size
    for name in ("max_batch_tokens", "num_blocks"):
        if getattr(args, name):
            kw[name] = getattr(args, name)
    for option in getattr(args, "cb_option", None) or ():
        name, eq, value = option.partition("=")
        if not eq:
            raise ValueError(f"--cb-option {option!r}: expected FIELD=VALUE")
        if name not in fields:
            raise ValueError(f"--cb-option {option!r}: ContinuousBatchingConfig has no field {name!r}")
        try:
            kw[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # a bare word: a string field's value (scheduler_type=prefill_first)
            kw[name] = value
    return ContinuousBatchingConfig(**kw)


def generation_config(model, N: int):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)


def _latencies(outputs) -> dict[str, list[float]]:
    ttft, tpot = [], []
    for out in outputs:
        stamps = out.timestamps or []
        if stamps:
            ttft.append(stamps[0] - out.created_time)
        if len(stamps) > 1:
            tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {"ttft": ttft, "tpot": tpot}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def offline(model, mode: str, inputs: list[list[int]], N: int, args) -> tuple[float, dict]:
    """Wall seconds of serving every request at once, and the requests' latencies (CB modes)."""
    gen = generation_config(model, N)
    device = model.device
    if mode == "relay_generate":
        B = args.fixed_batch

        def run():
            for start in range(0, len(inputs), B):
                rows = inputs[start:start + B]
                width = max(map(len, rows))
                ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
                mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
                model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
            return []
    else:
        def run():
            out = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb_config(args, mode),
                                       record_timestamps=True, persistent_manager=args.persistent)
            return list(out.values())

    sync(device)
    start = time.perf_counter()
    outputs = run()
    sync(device)
    return time.perf_counter() - start, _latencies(outputs)


def online(model, mode: str, inputs: list[list[int]], N: int, rate: float, args, seed: int) -> tuple[float, dict]:
    """Requests added at Poisson arrival times (``rate`` per second): seconds from the first arrival to the last
    result, and the latencies; ``(None, {})`` when some request did not finish (timeout, or the manager stopped)."""
    rng = random.Random(seed)
    model.destroy_cached_continuous_batching_manager()  # a kept offline manager holds the cache's memory
    manager = model.init_continuous_batching(generation_config=generation_config(model, N),
                                             continuous_batching_config=cb_config(args, mode))
    manager.warmup()  # as transformers serve does before it takes requests: the clock starts on a warm manager
    manager.start()
    results = []
    try:
        start = time.perf_counter()
        due = start
        for i, ids in enumerate(inputs):
            due += rng.expovariate(rate)
            time.sleep(max(0.0, due - time.perf_counter()))
            manager.add_request(ids, request_id=f"q{i}", max_new_tokens=N, record_timestamps=True)
        deadline = time.perf_counter() + args.timeout
        while len(results) < len(inputs) and time.perf_counter() < deadline and manager.is_running():
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results.append(out)
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=60)
    if len(results) < len(inputs):  # no row: a throughput over the finished requests alone would flatter
        say(f"online rate {rate}: {len(results)} of {len(inputs)} requests finished within {args.timeout} s")
        return None, {}
    return wall, _latencies(results)


def _rows(mode: str, metric_values: dict, base: dict) -> list[dict]:
    rows = []
    for metric, (unit, value) in metric_values.items():
        if value is not None:
            rows.append({**base, "mode": mode, "metric": metric, "unit": unit, "median": round(value, 6), "n": 1})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--user-len", type=int, nargs=2, default=(32, 128))
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES)
    p.add_argument("--persistent", action="store_true",
                   help="keep each generate_batch call's manager for the next (implies --full-warm-up)")
    p.add_argument("--fixed-batch", type=int, default=64)
    p.add_argument("--rates", type=float, nargs="*", default=[], help="online arrival rates (requests / s)")
    p.add_argument("--online-requests", type=int, default=None, help="online: the first this many requests")
    p.add_argument("--max-batch-tokens", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after each mode's warm-up call (transformers' manager runs gc.collect() as every "
                        "generate_batch call stops; frozen objects are not walked)")
    p.add_argument("--cb-option", action="append", metavar="FIELD=VALUE",
                   help="another ContinuousBatchingConfig field for the continuous-batching modes, a Python literal "
                        "(use_async_batching=False, default_compile_level=1, q_padding_interval_size=64); repeatable")
    p.add_argument("--timeout", type=float, default=600.0, help="online: seconds to wait for the last result")
    p.add_argument("--full-warm-up", action="store_true", help="warm up on the whole offline workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="")
    p.add_argument("--csv", default=str(DATA / "serve.csv"))
    args = p.parse_args(argv)
    cb_config(args)  # a --cb-option transformers does not take fails here, before the model is built
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    S, N, R = args.prefix_len, args.new_tokens, args.requests
    model = build_model(args.model_shape, device, dtype, S + args.user_len[1] + N + 16)
    inputs = requests(model.config.vocab_size, R, S, args.groups, tuple(args.user_len), args.seed)
    base = {**environment(device), "model": args.model_shape, "dtype": args.dtype, "S": S,
            "U": f"{args.user_len[0]}-{args.user_len[1]}", "R": R, "groups": args.groups, "new_tokens": N,
            "note": " ".join([args.note] + [f"cb:{o}" for o in args.cb_option or ()]
                             + (["gc-freeze"] if args.gc_freeze else [])).strip()}
    rows = []
    stock_attn = model.config._attn_implementation
    for mode in progress(args.modes, "modes"):
        _set_up(model, mode, stock_attn)
        # warm-up: kernels, allocator; --full-warm-up: the whole workload once (every kernel variant it needs compiled)
        # a kept manager is sized by the requests of its first call: --persistent warms up on the whole workload
        full = args.full_warm_up or args.persistent
        # relay_generate warms up on one whole batch at least: its step is recorded per batch shape, and a first
        # recording inside wall(N) would count in its decode step
        warm = inputs if full else inputs[:args.fixed_batch] if mode == "relay_generate" else inputs[:2]
        first, _ = offline(model, mode, warm, N if full or mode == "relay_generate" else 2, args)
        if args.gc_freeze:  # what the process holds after its warm-up is never walked by a collection again
            gc.freeze()
        wall, lat = offline(model, mode, inputs, N, args)
        used = _relay_used(model, mode)
        road = f", road {getattr(model, 'relay_continuous_road', None)}" if relay_hf.is_patched(model) else ""
        throughput = R * N / wall
        step = None
        if mode == "relay_generate" and N > 1:  # its decode step: the same batches with one new token take the rest
            prefills, _ = offline(model, mode, inputs, 1, args)
            step = (wall - prefills) / (N - 1) / -(-R // args.fixed_batch)
        say(f"{mode} offline: {throughput:,.0f} tok/s ({wall:.2f} s; first call {first:.2f} s)"
            + ("" if step is None else f", decode step {step * 1e3:.2f} ms at {min(R, args.fixed_batch)} rows") + road)
        extra = {"arrival": "offline persistent" if args.persistent else "offline", "relay_used": used}
        rows += _rows(mode, {"throughput": ("tok/s", throughput), "wall": ("s", wall), "first_call": ("s", first),
                             "ttft_p50": ("s", _percentile(lat["ttft"], 50)),
                             "ttft_p99": ("s", _percentile(lat["ttft"], 99)),
                             "tpot_p50": ("ms", _scaled(_percentile(lat["tpot"], 50))),
                             "tpot_p99": ("ms", _scaled(_percentile(lat["tpot"], 99))), "step": ("ms", _scaled(step))},
                      {**base, **extra})
        if mode == "relay_generate":
            continue
        online_inputs = inputs[:args.online_requests or R]
        for rate in args.rates:
            wall, lat = online(model, mode, online_inputs, N, rate, args, args.seed)
            if wall is None:
                continue
            rows += _rows(mode, {"throughput": ("tok/s", len(online_inputs) * N / wall),
                                 "ttft_p50": ("s", _percentile(lat["ttft"], 50)),
                                 "ttft_p99": ("s", _percentile(lat["ttft"], 99)),
                                 "tpot_p50": ("ms", _scaled(_percentile(lat["tpot"], 50))),
                                 "tpot_p99": ("ms", _scaled(_percentile(lat["tpot"], 99)))},
                          {**base, "R": len(online_inputs), "arrival": f"poisson {rate:g}/s", "relay_used": used})
            say(f"{mode} poisson {rate:g}/s: TPOT p99 {_scaled(_percentile(lat['tpot'], 99))} ms, TTFT p50 "
                f"{_percentile(lat['ttft'], 50)} s")
    _set_up(model, None, stock_attn)
    append_rows(args.csv, SERVE_FIELDS, rows)
    print_table(rows, ["mode", "arrival", "metric", "unit", "median"])
    say(f"{len(rows)} rows appended to {args.csv}")


def _set_up(model, mode: str | None, stock_attn: str) -> None:
    """The model as ``mode`` runs it (``None``: as built): patched or not, on its own attention or relay's kernel; a
    kept manager of the previous mode dropped."""
    model.destroy_cached_continuous_batching_manager()
    relay_hf.unpatch(model)
    model.set_attn_implementation(stock_attn)
    if mode in ("relay_cb", "relay_generate"):
        relay_hf.patch(model)
    elif mode == "flash_cb":
        offer_kernel()
        model.set_attn_implementation(KERNEL_ID)


def _relay_used(model, mode: str) -> bool:
    """Relay served the mode's calls: relay's flash kernel (by id, or the patched model's flash road), or host-road
    steps counted by ``relay_hf.stats``."""
    if mode == "flash_cb" or getattr(model, "relay_continuous_road", None) == "flash":
        return True
    return relay_hf.is_patched(model) and relay_hf.stats(model).relay_steps > 0


def _scaled(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


if __name__ == "__main__":
    main()
