"""Relay's paged decode kernel (relay-flash3's ``flash_attn_with_kvcache``, the continuous-batching fast path's
attention) against its bandwidth floor and against the same kernel over a table that shares no page.

    python -m benchmarks.paged                                     # 128 requests x (2048 shared + 128 own), bf16
    python -m benchmarks.paged --requests 32 128 256 --groups 1 4 --tune   # tile variants timed first
    TRITON_INTERPRET=1 python -m benchmarks.paged --device cpu --dtype float32 --heads 4 2 --head-dim 16 \\
        --prefix-len 32 --own-len 8 --requests 4 --page-size 16    # the CPU smoke run (Triton's interpreter)

A point is R requests, one decode query each, under ``--groups`` system prompts of S tokens (whole pages, shared in
the block table as transformers' block sharing leaves them), each request with ``--own-len`` tokens of its own pages,
and the step's new K/V written by the call. Rows go to benchmarks/data/kernel.csv (``--csv``; ``L_s`` is the own
length, ``B`` the requests):

* ``paged`` (µs): a layer that reads the step's groups (every layer but a step's first); ``paged_first``: the first
  layer, which also derives the groups from the block table; ``paged_unshared``: the same kernel over a table where
  every request holds its own copy of the prefix pages (what a paged flash kernel without sharing reads);
* ``floor_paged`` (µs): the bytes the step must move (each shared page once, every own page, the new K/V, q and the
  output) over the measured copy bandwidth; ``bandwidth`` (GB/s) ``paged`` achieves;
* ``relerr``: ``paged`` against the kernel's PyTorch path (float32 math), relative Frobenius norm.

CUDA times are ``do_bench_cudagraph`` replays (the calls captured in one CUDA graph, as transformers captures a decode
step); elsewhere wall times of synchronous calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import math
from pathlib import Path

import torch

from relay_hf.flash import load_kernel

from .common import DATA, KERNEL_FIELDS, device_us, environment, progress, say, summary, sweep
from .kernel import copy_bandwidth

# paged.Tiles overrides that ``--tune`` times before the sweep (paged.Tiles documents each field); the fastest by
# geometric mean over TUNE_CASES (requests, prefix tokens, prompts) is used
VARIANTS = {
    "default": {},
    "keys32": dict(prefix_keys=32, suffix_keys=32),
    "prefix_keys128": dict(prefix_keys=128),
    "suffix_keys32": dict(suffix_keys=32),
    "suffix_keys128": dict(suffix_keys=128),
    "splits8": dict(max_splits=8),
    "splits2": dict(max_splits=2),
    "prefix_warps4": dict(prefix_warps=4),
    "suffix_warps8": dict(suffix_warps=8),
    "rows32": dict(prefix_rows=32),
    "rows64": dict(prefix_rows=64),
    "rows128": dict(prefix_rows=128),
    "programs32": dict(prefix_programs=32),
    "stages2": dict(prefix_stages=2, suffix_stages=2),
    "stages4": dict(prefix_stages=4, suffix_stages=4),
    "prefix_stages2": dict(prefix_stages=2),
    "suffix_stages1": dict(suffix_stages=1),
    "suffix_stages2": dict(suffix_stages=2),
    "suffix_keys32_stages2": dict(suffix_keys=32, suffix_stages=2),
    "suffix_keys128_stages1": dict(suffix_keys=128, suffix_stages=1),
    "half_partials": dict(half_partials=True),
    "half_splits8": dict(half_partials=True, max_splits=8),
    "half_suffix_stages1": dict(half_partials=True, suffix_stages=1),
    "half_suffix_stages2": dict(half_partials=True, suffix_stages=2),
    "half_suffix_stages1_overlap": dict(half_partials=True, suffix_stages=1, overlap=True),
    "half_suffix_stages2_overlap": dict(half_partials=True, suffix_stages=2, overlap=True),
    "splits2_overlap": dict(max_splits=2, overlap=True),
    "half_splits2_overlap_stages1": dict(half_partials=True, max_splits=2, overlap=True, suffix_stages=1),
    "half_splits2_overlap_stages2": dict(half_partials=True, max_splits=2, overlap=True, suffix_stages=2),
    "s2_pk128": dict(max_splits=2, prefix_keys=128),
    "merge_launch": dict(suffix_merges=False),
    "overlap": dict(overlap=True),
    "suffix_warps2": dict(suffix_warps=2),
    "suffix_keys32_warps2": dict(suffix_keys=32, suffix_warps=2),
    "suffix_keys128_warps8": dict(suffix_keys=128, suffix_warps=8),
}
TUNE_CASES = [(128, 2048, 1), (32, 2048, 1), (128, 2048, 4)]


def paged_inputs(R: int, S: int, L: int, groups: int, H_q: int, H_kv: int, D: int, page: int, dtype, device,
                 shared: bool = True):
    """``(q, k_cache, v_cache, k, v, block_table, cache_seqlens)`` of one decode step: ``q``, ``k``, ``v``
    ``[R, 1, H, D]``; pages ``[P, page, H_kv, D]``; ``block_table [R, M]`` int32 (the ``S // page`` prefix pages of
    request ``r``'s prompt ``r * groups // R``, shared unless ``shared=False``, then its own pages);
    ``cache_seqlens [R]`` int32 ``S + L``."""
    if S % page:
        raise ValueError(f"--prefix-len {S} must be whole pages of {page} tokens")
    g = torch.Generator(device=device).manual_seed(R + S + L)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)  # noqa: E731
    prefix_pages, own_pages = S // page, -(-(L + 1) // page)
    prompt_pages = torch.arange(groups * prefix_pages, device=device).view(groups, prefix_pages)
    which = torch.arange(R, device=device) * groups // R
    if shared:
        prefix = prompt_pages[which]  # [R, S // page]: identical ids within a prompt
        next_page = groups * prefix_pages
    else:
        prefix = groups * prefix_pages + torch.arange(R * prefix_pages, device=device).view(R, prefix_pages)
        next_page = groups * prefix_pages + R * prefix_pages
    own = next_page + torch.arange(R * own_pages, device=device).view(R, own_pages)
    table = torch.cat([prefix, own], 1).to(torch.int32)
    pages = int(table.max()) + 1
    k_cache, v_cache = rnd(pages, page, H_kv, D), rnd(pages, page, H_kv, D)
    if not shared:  # each request's copy holds its prompt's keys: the same attention as the shared table
        copies = table[:, :prefix_pages].flatten().long()
        originals = prompt_pages[which].flatten()
        k_cache[copies], v_cache[copies] = k_cache[originals], v_cache[originals]
    seqlens = torch.full((R,), S + L, dtype=torch.int32, device=device)
    return rnd(R, 1, H_q, D), k_cache, v_cache, rnd(R, 1, H_kv, D), rnd(R, 1, H_kv, D), table, seqlens


def floor_bytes(R, S, L, groups, H_q, H_kv, D, itemsize) -> int:
    """Bytes one step must move: each prompt's K/V once, every request's own K/V (with the new token) read, the new
    K/V written, q read and the output written."""
    return itemsize * (2 * H_kv * D * (groups * S + R * (L + 1)) + 2 * R * H_kv * D + 2 * R * H_q * D)


def _modules():
    """relay-flash3's ``grouping`` and ``paged`` modules, as relay_hf loads the kernel."""
    kernel = load_kernel()
    return tuple(importlib.import_module(f"{kernel.__name__}.{name}") for name in ("grouping", "paged"))


def _timed(inputs, scale: float, tiles, derive: bool):
    """One call of the Triton path on ``inputs``: the step's groups derived by the call (a step's first layer) or
    derived once before (every other layer)."""
    grouping, paged = _modules()
    q, kc, vc, k, v, table, seqlens = inputs
    groups = None if derive else grouping.share_groups(table, seqlens, kc.shape[1], tiles.rows_per_tile(q, kc))
    return lambda: paged.paged_relay_triton(q, kc, vc, k, v, table, seqlens, scale, 0.0, None, groups, tiles=tiles)


def tune(device, args) -> tuple[str, object]:
    """Time every ``VARIANTS`` entry (``paged.Tiles`` overrides) on ``TUNE_CASES``; the best geometric mean."""
    _, paged = _modules()
    H_q, H_kv = args.heads
    dtype = getattr(torch, args.dtype)
    scores = {}
    for name, overrides in progress(VARIANTS.items(), "tune"):
        tiles = dataclasses.replace(paged.TILES, **overrides)
        times = []
        for R, S, groups in TUNE_CASES:
            inputs = paged_inputs(R, S, args.own_len, groups, H_q, H_kv, args.head_dim, args.page_size, dtype, device)
            times.append(summary(device_us(_timed(inputs, args.head_dim ** -0.5, tiles, False), device,
                                           reps=args.reps))["median"])
        scores[name] = math.prod(times) ** (1 / len(times))
        say(f"tune {name:>14}: " + "  ".join(f"R={R},S={S},g={g}: {t:6.1f} us"
                                             for (R, S, g), t in zip(TUNE_CASES, times)))
    best = min(scores, key=scores.get)
    print(f"tune: using {best} {VARIANTS[best]}")
    return best, dataclasses.replace(paged.TILES, **VARIANTS[best])


def paged_point(R: int, S: int, groups: int, args, device, bw: float | None, tiles=None) -> list[dict]:
    _, paged = _modules()
    tiles = tiles or paged.TILES
    H_q, H_kv = args.heads
    D, L, page, dtype = args.head_dim, args.own_len, args.page_size, getattr(torch, args.dtype)
    q, kc, vc, k, v, table, seqlens = inputs = paged_inputs(R, S, L, groups, H_q, H_kv, D, page, dtype, device)
    unshared = paged_inputs(R, S, L, groups, H_q, H_kv, D, page, dtype, device, shared=False)
    scale = D ** -0.5
    providers = {"paged": _timed(inputs, scale, tiles, False), "paged_first": _timed(inputs, scale, tiles, True),
                 "paged_unshared": _timed(unshared, scale, tiles, False)}
    out = providers["paged"]()
    ref = paged.paged_attention_torch(q.float(), kc.float(), vc.float(), k.float(), v.float(), table, seqlens,
                                      scale, 0.0, None)
    relerr = float((out.float() - ref).norm() / ref.norm())
    shape = dict(dtype=args.dtype, H_q=H_q, H_kv=H_kv, D=D, L_s=L, S=S, B=R, groups=groups, note=args.note)
    if tiles != paged.TILES:
        shape["note"] = " ".join(filter(None, [args.note, f"tiles: {tiles}"]))
    rows, times = [], {}
    for name, fn in providers.items():
        times[name] = summary(device_us(fn, device, reps=args.reps))
        rows.append(dict(shape, provider=name, metric="time", unit="us", **times[name]))
    nbytes = floor_bytes(R, S, L, groups, H_q, H_kv, D, dtype.itemsize)
    if bw is not None:
        rows.append(dict(shape, provider="floor_paged", metric="time", unit="us", median=nbytes / bw * 1e6, n=1))
    rows.append(dict(shape, provider="paged", metric="bandwidth", unit="GB/s",
                     median=nbytes / times["paged"]["median"] / 1e3, n=1))
    rows.append(dict(shape, provider="paged", metric="relerr", unit="1", median=relerr, n=1))
    return rows


def _line(rows: list[dict]) -> dict:
    get = {(r["provider"], r["metric"]): r["median"] for r in rows}
    paged_us, floor = get[("paged", "time")], get.get(("floor_paged", "time"), float("nan"))
    line = dict(R=rows[0]["B"], S=rows[0]["S"], groups=rows[0]["groups"], paged_us=paged_us,
                first_us=get[("paged_first", "time")], unshared_us=get[("paged_unshared", "time")],
                floor_us=floor, over_floor=paged_us / floor, GBps=get[("paged", "bandwidth")],
                relerr=get[("paged", "relerr")])
    say(f"R={line['R']} S={line['S']} groups={line['groups']}: paged {paged_us:.1f} us ({line['over_floor']:.2f}x "
        f"floor, {line['GBps']:,.0f} GB/s), first layer {line['first_us']:.1f} us, unshared {line['unshared_us']:.1f}"
        f" us")
    return line


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paged", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[128])
    parser.add_argument("--prefix-len", type=int, nargs="+", default=[2048])
    parser.add_argument("--groups", type=int, nargs="+", default=[1])
    parser.add_argument("--own-len", type=int, default=128, help="tokens of each request's own pages before the step")
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("H_Q", "H_KV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per provider off CUDA (CUDA: 10 replays)")
    parser.add_argument("--tune", action="store_true", help="time the Tiles VARIANTS first, use the fastest")
    parser.add_argument("--note", default="")
    parser.add_argument("--csv", type=Path, default=DATA / "kernel.csv", help="append the rows here")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env = environment(device)
    print(f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}, commit {env['commit']}")
    bw = copy_bandwidth(device) if device.type == "cuda" else None
    grid = [(R, S, g) for R, S, g in itertools.product(args.requests, args.prefix_len, args.groups) if g <= R]
    tiles = None
    if args.tune:
        if device.type != "cuda":
            parser.error("--tune times the Triton kernels: it needs CUDA")
        _, tiles = tune(device, args)
    return sweep(grid, lambda R, S, groups: paged_point(R, S, groups, args, device, bw, tiles), _line, "paged", env,
                 args.csv, KERNEL_FIELDS)

if __name__ == "__main__":
    main()
