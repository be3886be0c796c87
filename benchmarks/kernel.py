"""One decode attention layer: relay_hf's op against SDPA over the expanded prefix, a PyTorch relay, the floor.

SDPA runs over the prefix copied into every row, which is what stock transformers holds and reads.

    python -m benchmarks.kernel                                    # Llama-3-8B shapes, bf16, on the GPU
    python -m benchmarks.kernel --prefix-len 4096 16384 --batch 1 32 --tune
    python -m benchmarks.kernel --prefix-len 4096 --batch 64 --groups 1 2 4 8   # several system prompts per batch
    python -m benchmarks.kernel --device cpu --dtype float32 --heads 4 2 --head-dim 16 --suffix-len 8 \\
        --prefix-len 64 --batch 2 --host-calls 30                  # the CPU smoke run (a few seconds)

Per point (S prefix tokens, B rows, one query per row, L_s suffix tokens each; with ``--groups g``, g system prompts of
S tokens each, the rows split evenly between them) it prints and appends to
benchmarks/data/kernel.csv (``--csv``):

* ``time`` (µs per call) of ``relay`` (the Triton kernel on CUDA, the PyTorch reference elsewhere), ``sdpa``
  (``scaled_dot_product_attention(enable_gqa=True)`` over the expanded prefix) and, on CUDA in fp16/bf16, ``naive``
  (two flash-attention calls with their LSE and a PyTorch merge). CUDA times are ``do_bench_cudagraph`` replays
  (no launch gaps; the L2 is not flushed, so shapes that fit in it read partly from it).
* ``floor_relay`` / ``floor_stock``: the bytes each must move over the measured copy bandwidth (CUDA).
* ``bandwidth`` (GB/s) relay achieves; ``host`` (µs per eager call, timed over ``--host-calls`` (300) calls with
  no synchronisation: what a call that is not captured in a graph costs the Python thread); ``peak_memory`` (MiB
  one call allocates, CUDA); ``relerr`` (relay against SDPA, relative Frobenius norm).

``--tune`` first times the kernel ``VARIANTS`` (``KernelConfig`` overrides) on ``TUNE_CASES`` and sweeps with the
fastest.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from pathlib import Path

import torch

from relay_hf import relay_attention
from relay_hf.kernels import PrefixGroups
from relay_hf.kernels.reference import merge_partials

from .common import (
    DATA,
    KERNEL_FIELDS,
    device_us,
    environment,
    host_us,
    peak_extra_mib,
    progress,
    say,
    summary,
    sweep,
)

# KernelConfig overrides that ``--tune`` times before the sweep (relay_hf/kernels/triton_relay.py documents each
# field; tile tables map the padded head dim to a row); the fastest by geometric mean over TUNE_CASES is used.
VARIANTS = {
    "default": {},
    "one_launch": dict(separate_rows=(0, -1)),
    "separate_always": dict(separate_rows=(1, 1 << 30)),
    "fp32_partials": dict(partial_half=False),
    "no_fused_merge": dict(fused_merge_slots=0),
    "fused_merge_8": dict(fused_merge_slots=8),
    "no_pdl": dict(pdl=False),
    "pointer_loads": dict(prefix_tma=False),
    "separate_waves4": dict(separate_split=(4, 2)),
    "suffix_64x4x2": dict(suffix_tiles=((64, (64, 4, 2)), (128, (64, 4, 2)), (256, (32, 8, 2)))),
    "prefix_waves2": dict(split_waves=2, partial_budget=4),
    "stages2": dict(tiles=((64, (64, 4, 2)), (128, (64, 4, 2)), (256, (32, 8, 2)))),
    "n32": dict(tiles=((64, (32, 4, 3)), (128, (32, 4, 3)), (256, (32, 8, 2)))),
    "merge8x1": dict(merge_tile=(8, 1)),
}
TUNE_CASES = [(4096, 32), (16384, 32), (4096, 64), (4096, 128), (1024, 8)]


def decode_inputs(S: int, B: int, H_q: int, H_kv: int, D: int, L_s: int, dtype: torch.dtype, device: torch.device,
                  groups: int = 1):
    """A decode step: ``q [B, H_q, 1, D]``, prefix K/V ``[1, H_kv, groups * S, D]`` (``groups`` system prompts of
    ``S`` tokens, packed), suffix K/V ``[B, H_kv, L_s, D]``."""
    g = torch.Generator(device=device).manual_seed(S + B)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)  # noqa: E731
    return (rnd(B, H_q, 1, D), rnd(1, H_kv, groups * S, D), rnd(1, H_kv, groups * S, D), rnd(B, H_kv, L_s, D),
            rnd(B, H_kv, L_s, D))


def row_groups(S: int, B: int, groups: int) -> PrefixGroups | None:
    """``groups`` prompts of ``S`` tokens, row ``b`` under prompt ``b * groups // B`` (sizes differ by at most one);
    ``None`` for one prompt (the ungrouped call)."""
    if groups == 1:
        return None
    return PrefixGroups([S] * groups, [(b * groups // B,) for b in range(B)])


def naive_relay(q, pk, pv, sk, sv, scale):
    """Two flash-attention calls with their LSE (batch folded into the prefix query length) and a PyTorch merge:
    the relay a PyTorch-only implementation gets (CUDA, fp16/bf16, no padding)."""
    B, H_q, _, D = q.shape
    H_kv = sk.shape[1]
    G = H_q // H_kv
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    qp = q.view(B, H_kv, G, D).transpose(0, 1).reshape(1, H_kv, B * G, D)  # [1, H_kv, B*G, D]
    out_p, lse_p = flash(qp, pk, pv, scale=scale)[:2]
    out_s, lse_s = flash(q.view(B, H_kv, G, D), sk, sv, scale=scale)[:2]
    out_p = out_p.view(H_kv, B, G, D).transpose(0, 1)
    lse_p = lse_p.view(H_kv, B, G).transpose(0, 1)
    out, _ = merge_partials(out_p.float(), lse_p, out_s.float(), lse_s)
    return out.to(q.dtype).reshape(B, H_q, 1, D)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (CUDA)."""
    import triton.testing

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def _relay_fn(inputs, scale: float, config, groups: PrefixGroups | None = None):
    """The relay call timed: the Triton kernel with ``config`` on CUDA, the public op elsewhere."""
    if config is None:
        return lambda: relay_attention(*inputs, scale=scale, prefix_groups=groups)
    from relay_hf.kernels.triton_relay import relay_attention_triton

    return lambda: relay_attention_triton(*inputs, scale=scale, config=config, prefix_groups=groups)


def tune(device: torch.device, H_q=32, H_kv=8, D=128, L_s=256, dtype=torch.bfloat16):
    """Time every ``VARIANTS`` entry on ``TUNE_CASES``; return ``(name, config)`` of the best geometric mean."""
    from relay_hf.kernels.triton_relay import DEFAULT_CONFIG

    configs = {name: dataclasses.replace(DEFAULT_CONFIG, **overrides) for name, overrides in VARIANTS.items()}
    scores = {}
    for name, config in progress(configs.items(), "tune"):
        times = []
        for S, B in TUNE_CASES:
            inputs = decode_inputs(S, B, H_q, H_kv, D, L_s, dtype, device)
            times.append(summary(device_us(_relay_fn(inputs, D ** -0.5, config), device))["median"])
        scores[name] = math.prod(times) ** (1 / len(times))
        say(f"tune {name:>16}: " + "  ".join(f"S={S},B={B}: {t:6.1f} us" for (S, B), t in zip(TUNE_CASES, times)))
    best = min(scores, key=scores.get)
    print(f"tune: using {best} {VARIANTS[best]}")
    return best, configs[best]


def bytes_moved(B, H_q, H_kv, S, L_s, D, itemsize, groups: int = 1) -> tuple[int, int]:
    """(bytes relay must move, bytes stock must move) for one decode step: relay reads each of the ``groups``
    prefixes' K/V once and each row's suffix; stock reads its prefix once per row. Both read q and write the
    output."""
    qo = 2 * B * H_q * D * itemsize
    relay = qo + 2 * H_kv * (groups * S + B * L_s) * D * itemsize
    stock = qo + 2 * B * H_kv * (S + L_s) * D * itemsize
    return relay, stock


def kernel_point(S: int, B: int, args, device: torch.device, bw: float | None, config=None, note: str = "",
                 groups: int = 1):
    """The CSV rows (without the run's fields) of one (S, B, groups) point: ``groups`` system prompts of ``S``
    tokens each, the ``B`` rows split evenly between them."""
    H_q, H_kv = args.heads
    D, L_s, dtype = args.head_dim, args.suffix_len, getattr(torch, args.dtype)
    q, pk, pv, sk, sv = inputs = decode_inputs(S, B, H_q, H_kv, D, L_s, dtype, device, groups)
    layout = row_groups(S, B, groups)
    scale = D ** -0.5
    which = torch.arange(B, device=device) * groups // B  # each row's prompt
    k_rows = pk.view(H_kv, groups, S, D).transpose(0, 1)[which]  # [B, H_kv, S, D]: each row's prompt, copied
    v_rows = pv.view(H_kv, groups, S, D).transpose(0, 1)[which]
    k_full = torch.cat([k_rows, sk], 2)  # [B, H_kv, S + L_s, D]: the prefix copied per row, as stock holds it
    v_full = torch.cat([v_rows, sv], 2)
    del k_rows, v_rows
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k_full, v_full, scale=scale,  # noqa: E731
                                                                    enable_gqa=True)
    relay = _relay_fn(inputs, scale, config, layout)
    ref = sdpa().float()
    relerr = float((relay().float() - ref).norm() / ref.norm())
    providers = {"relay": relay, "sdpa": sdpa}
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and groups == 1:
        providers["naive"] = lambda: naive_relay(q, pk, pv, sk, sv, scale)
    shape = dict(dtype=args.dtype, H_q=H_q, H_kv=H_kv, D=D, L_s=L_s, S=S, B=B, groups=groups, note=note)
    row = lambda provider, metric, unit, values: dict(shape, provider=provider, metric=metric, unit=unit,  # noqa: E731
                                                      **values)
    single = lambda value: dict(median=value, n=1)  # noqa: E731
    rows, times = [], {}
    for name, fn in providers.items():
        times[name] = summary(device_us(fn, device, reps=args.reps))
        rows.append(row(name, "time", "us", times[name]))
    relay_bytes, stock_bytes = bytes_moved(B, H_q, H_kv, S, L_s, D, dtype.itemsize, groups)
    if bw is not None:
        rows.append(row("floor_relay", "time", "us", single(relay_bytes / bw * 1e6)))
        rows.append(row("floor_stock", "time", "us", single(stock_bytes / bw * 1e6)))
    rows.append(row("relay", "bandwidth", "GB/s", single(relay_bytes / times["relay"]["median"] / 1e3)))
    for name in ("relay", "sdpa"):
        rows.append(row(name, "host", "us", summary(host_us(providers[name], device, calls=args.host_calls))))
    if device.type == "cuda":
        for name in ("relay", "sdpa"):
            rows.append(row(name, "peak_memory", "MiB", single(peak_extra_mib(providers[name], device))))
    rows.append(row("relay", "relerr", "1", single(relerr)))
    return rows


def _line(rows: list[dict]) -> dict:
    """One printed line per point: the medians that matter, gpt-fast style."""
    get = {(r["provider"], r["metric"]): r["median"] for r in rows}
    relay, sdpa = get[("relay", "time")], get[("sdpa", "time")]
    line = dict(S=rows[0]["S"], B=rows[0]["B"], groups=rows[0]["groups"], relay_us=relay, sdpa_us=sdpa,
                speedup=sdpa / relay,
                naive_us=get.get(("naive", "time"), float("nan")), GBps=get[("relay", "bandwidth")],
                over_floor=relay / get.get(("floor_relay", "time"), float("nan")),
                host_relay_us=get[("relay", "host")], host_sdpa_us=get[("sdpa", "host")],
                peak_MiB=get.get(("relay", "peak_memory"), float("nan")), relerr=get[("relay", "relerr")])
    say(f"S={line['S']} B={line['B']} groups={line['groups']}: relay {relay:.1f} us ({line['GBps']:,.0f} GB/s, "
        f"{line['over_floor']:.2f}x floor), SDPA {sdpa:.1f} us ({line['speedup']:.2f}x), eager host "
        f"{line['host_relay_us']:.1f} us, peak +{line['peak_MiB']:.1f} MiB")
    return line


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel", description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-len", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--groups", type=int, nargs="+", default=[1],
                        help="system prompts per batch (each of --prefix-len tokens, the rows split evenly)")
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("H_Q", "H_KV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--suffix-len", type=int, default=256, help="suffix tokens per row (L_s)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per provider off CUDA (CUDA: 10 replays)")
    parser.add_argument("--host-calls", type=int, default=300, help="eager calls per host-time sample")
    parser.add_argument("--tune", action="store_true", help="time the KernelConfig VARIANTS first, use the fastest")
    parser.add_argument("--note", default="", help="free text stored with every row")
    parser.add_argument("--csv", type=Path, default=DATA / "kernel.csv", help="append the rows here")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env = environment(device)
    print(f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}, triton {env['triton']}, "
          f"commit {env['commit']}")
    bw = copy_bandwidth(device) if device.type == "cuda" else None
    rows, config, note = [], None, args.note
    if bw is not None:
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
        rows.append(dict(dtype="bfloat16", provider="copy", metric="bandwidth", unit="GB/s", median=bw / 1e9, n=1,
                         note=args.note))
    if args.tune:
        if device.type != "cuda":
            parser.error("--tune times the Triton kernel: it needs CUDA")
        name, config = tune(device, *args.heads, args.head_dim, args.suffix_len, getattr(torch, args.dtype))
        note = " ".join(filter(None, [args.note, f"tuned: {name}"]))
    grid = [(S, B, g) for S, B, g in itertools.product(args.prefix_len, args.batch, args.groups) if g <= B]
    return sweep(grid, lambda S, B, groups: kernel_point(S, B, args, device, bw, config, note, groups), _line, "kernel",
                 env, args.csv, KERNEL_FIELDS, rows)


if __name__ == "__main__":
    main()
