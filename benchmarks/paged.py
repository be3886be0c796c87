"""Relay's paged decode kernel (relay-flash3's ``flash_attn_with_kvcache``, the continuous-batching fast path's
attention) against its bandwidth floor and against the same kernel over a table that shares no page.

    python -m benchmarks.paged                                     # 128 requests x (2048 shared + 128 own), bf16
    python -m benchmarks.paged --requests 32 128 256 --groups 1 4
    python -m benchmarks.paged --device cpu --dtype float32 --heads 4 2 --head-dim 16 --prefix-len 32 \\
        --own-len 8 --requests 4 --page-size 16                    # the CPU smoke run (Triton's interpreter)

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
import importlib
import itertools
from pathlib import Path

import torch

from relay_hf.flash import load_kernel

from .common import DATA, KERNEL_FIELDS, append_rows, device_us, environment, print_table, progress, say, summary
from .kernel import copy_bandwidth


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
    k_cache, v_cache = rnd(int(table.max()) + 1, page, H_kv, D), rnd(int(table.max()) + 1, page, H_kv, D)
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


def paged_point(R: int, S: int, groups: int, args, device, bw: float | None) -> list[dict]:
    kernel = load_kernel()
    grouping, paged = (importlib.import_module(f"{kernel.__name__}.{name}") for name in ("grouping", "paged"))

    H_q, H_kv = args.heads
    D, L, page, dtype = args.head_dim, args.own_len, args.page_size, getattr(torch, args.dtype)
    q, kc, vc, k, v, table, seqlens = paged_inputs(R, S, L, groups, H_q, H_kv, D, page, dtype, device)
    unshared = paged_inputs(R, S, L, groups, H_q, H_kv, D, page, dtype, device, shared=False)
    scale = D ** -0.5
    rows_per_tile = max(1, paged.BLOCK_M_PREFIX // paged._pow2(H_q // H_kv))
    step_groups = grouping.share_groups(table, seqlens, page, rows_per_tile)

    def run(inputs, step=None):
        q_, kc_, vc_, k_, v_, table_, seqlens_ = inputs
        if step is None:
            return lambda: kernel.flash_attn_with_kvcache(q_, kc_, vc_, k_, v_, cache_seqlens=seqlens_,
                                                          block_table=table_, softmax_scale=scale)
        return lambda: paged.paged_relay_triton(q_, kc_, vc_, k_, v_, table_, seqlens_, scale, 0.0, None, step)

    inputs = (q, kc, vc, k, v, table, seqlens)
    providers = {"paged": run(inputs, step_groups), "paged_first": run(inputs), "paged_unshared": run(unshared)}
    out = providers["paged"]()
    ref = paged.paged_attention_torch(q.float(), kc.float(), vc.float(), k.float(), v.float(), table, seqlens,
                                      scale, 0.0, None)
    relerr = float((out.float() - ref).norm() / ref.norm())
    shape = dict(dtype=args.dtype, H_q=H_q, H_kv=H_kv, D=D, L_s=L, S=S, B=R, groups=groups, note=args.note)
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
    parser.add_argument("--note", default="")
    parser.add_argument("--csv", type=Path, default=DATA / "kernel.csv", help="append the rows here")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env = environment(device)
    print(f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}, commit {env['commit']}")
    bw = copy_bandwidth(device) if device.type == "cuda" else None
    rows, lines = [], []
    grid = [(R, S, g) for R, S, g in itertools.product(args.requests, args.prefix_len, args.groups) if g <= R]
    for R, S, groups in progress(grid, "paged"):
        point = paged_point(R, S, groups, args, device, bw)
        rows += point
        lines.append(_line(point))
    print_table(lines, list(lines[0]))
    append_rows(args.csv, KERNEL_FIELDS, [dict(env, **r) for r in rows])
    print(f"appended {len(rows)} rows to {args.csv}")
    return rows


if __name__ == "__main__":
    main()
