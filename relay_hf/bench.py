"""Benchmarks. ``python -m relay_hf.bench kernel`` (one decode attention layer) and
``python -m relay_hf.bench generate`` (end-to-end ``generate``; see ``relay_hf.bench_generate``).

Each prints a table and writes CSV + a matplotlib PNG under ``--out``. Kernel timings are
``triton.testing.do_bench_cudagraph`` medians (CUDA graphs remove launch gaps); every ratio comes from one run.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
from pathlib import Path

import torch
from tqdm import tqdm

from .bench_generate import add_generate_parser
from .dispatch import relay_pays
from .kernels import triton_relay
from .kernels.reference import merge_partials
from .kernels.triton_relay import bytes_moved, relay_attention_triton

# Tile/split variants `kernel --tune` times before the sweep; the fastest is used and printed.
VARIANTS = {
    "default": {},
    "one_launch": dict(SEPARATE_ROWS=(0, -1)),
    "separate_always": dict(SEPARATE_ROWS=(1, 1 << 30)),
    "fp32_partials": dict(PARTIAL_HALF=False),
    "no_fused_merge": dict(FUSED_MERGE_SLOTS=0),
    "fused_merge_8": dict(FUSED_MERGE_SLOTS=8),
    "no_pdl": dict(PDL=False),
    "pointer_loads": dict(PREFIX_TMA=False),
    "separate_waves4": dict(SEPARATE_SPLIT=(4, 2)),
    "suffix_64x4x2": dict(SUFFIX_TILES={64: (64, 4, 2), 128: (64, 4, 2), 256: (32, 8, 2)}),
    "prefix_waves2": dict(SPLIT_WAVES=2, PARTIAL_BUDGET=4),
    "stages2": dict(TILES={64: (64, 4, 2), 128: (64, 4, 2), 256: (32, 8, 2)}),
    "n32": dict(TILES={64: (32, 4, 3), 128: (32, 4, 3), 256: (32, 8, 2)}),
    "merge8x1": dict(MERGE_TILE=(8, 1)),
}
TUNE_CASES = [(4096, 32), (16384, 32), (4096, 64), (4096, 128), (1024, 8)]


def copy_bandwidth(device="cuda", nbytes=2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import triton.testing

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def _flash_lse(q, k, v, scale):
    """SDPA's flash kernel with its LSE (natural log, fp32) — what a PyTorch-only relay can use."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
    return out, lse


def naive_relay(q, pk, pv, sk, sv, scale):
    """Two SDPA calls + a PyTorch LSE merge (decode, no padding): the baseline the kernel must beat."""
    B, H_q, _, D = q.shape
    H_kv = sk.shape[1]
    G = H_q // H_kv
    qp = q.view(B, H_kv, G, D).transpose(0, 1).reshape(1, H_kv, B * G, D)  # batch folded into query length
    out_p, lse_p = _flash_lse(qp, pk, pv, scale)
    out_s, lse_s = _flash_lse(q.view(B, H_kv, G, D), sk, sv, scale)
    out_p = out_p.view(H_kv, B, G, D).transpose(0, 1)
    lse_p = lse_p.view(H_kv, B, G).transpose(0, 1)
    out, _ = merge_partials(out_p.float(), lse_p, out_s.float(), lse_s)
    return out.to(q.dtype).reshape(B, H_q, 1, D)


def decode_inputs(S: int, B: int, H_q=32, H_kv=8, D=128, L_s=256, dtype=torch.bfloat16):
    """Llama-3-8B-like decode step: q [B, H_q, 1, D], prefix [1, H_kv, S, D], suffix [B, H_kv, L_s, D]."""
    g = torch.Generator(device="cuda").manual_seed(S + B)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=dtype)  # noqa: E731
    return rnd(B, H_q, 1, D), rnd(1, H_kv, S, D), rnd(1, H_kv, S, D), rnd(B, H_kv, L_s, D), rnd(B, H_kv, L_s, D)


def tune() -> str:
    """Time every VARIANTS entry on TUNE_CASES; keep the one with the best geometric-mean time."""
    import triton.testing

    defaults = {k: getattr(triton_relay, k) for v in VARIANTS.values() for k in v}
    scores = {}
    for name, variant in VARIANTS.items():
        for k, v in {**defaults, **variant}.items():
            setattr(triton_relay, k, v)
        times = []
        for S, B in TUNE_CASES:
            inputs = decode_inputs(S, B)
            times.append(triton.testing.do_bench_cudagraph(lambda a=inputs: relay_attention_triton(*a),
                                                           rep=50, return_mode="median"))
        scores[name] = math.prod(times) ** (1 / len(times))
        print(f"tune {name:>18}: " + "  ".join(f"S={S},B={B}: {t * 1e3:6.1f} us" for (S, B), t in
                                               zip(TUNE_CASES, times)))
    best = min(scores, key=scores.get)
    for k, v in {**defaults, **VARIANTS[best]}.items():
        setattr(triton_relay, k, v)
    print(f"tune: using {best} {VARIANTS[best]}")
    return best


def kernel_case(S: int, B: int, H_q=32, H_kv=8, D=128, L_s=256, dtype=torch.bfloat16, bw: float = 4.2e12) -> dict:
    import triton.testing

    q, pk, pv, sk, sv = decode_inputs(S, B, H_q, H_kv, D, L_s, dtype)
    k_full = torch.cat([pk.expand(B, -1, -1, -1), sk], 2)  # what stock HF holds: the prefix copied per row
    v_full = torch.cat([pv.expand(B, -1, -1, -1), sv], 2)
    scale = D ** -0.5
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k_full, v_full, scale=scale,  # noqa: E731
                                                                    enable_gqa=True)
    relay = lambda: relay_attention_triton(q, pk, pv, sk, sv, scale=scale)  # noqa: E731
    naive = lambda: naive_relay(q, pk, pv, sk, sv, scale)  # noqa: E731
    ref = sdpa().float()
    err = float((relay().float() - ref).norm() / ref.norm())
    t = {name: triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
         for name, fn in (("sdpa", sdpa), ("relay", relay), ("naive", naive))}
    nbytes = bytes_moved(B, H_q, H_kv, 1, S, L_s, D, q.element_size())
    floor_ms = nbytes / bw * 1e3
    floor_std_ms = dtype.itemsize * 2 * B * H_kv * (S + L_s) * D / bw * 1e3
    dispatched = t["sdpa"] if relay_pays(B, S, q.device, 1) else t["relay"]
    return dict(S=S, B=B, sdpa_ms=t["sdpa"], naive_ms=t["naive"], relay_ms=t["relay"], dispatched_ms=dispatched,
                floor_relay_ms=floor_ms,
                floor_std_ms=floor_std_ms, speedup_vs_sdpa=t["sdpa"] / t["relay"],
                speedup_vs_naive=t["naive"] / t["relay"], relay_over_floor=t["relay"] / floor_ms,
                relay_GBps=nbytes / t["relay"] / 1e6, relerr=err)


def write_outputs(rows: list[dict], out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    print(" | ".join(f"{k:>14}" for k in keys))
    for r in rows:
        print(" | ".join(f"{r[k]:>14.4g}" if isinstance(r[k], float) else f"{r[k]:>14}" for k in keys))


def plot_kernel(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for B in sorted({r["B"] for r in rows}):
        sel = [r for r in rows if r["B"] == B]
        axes[0].plot([r["S"] for r in sel], [r["speedup_vs_sdpa"] for r in sel], marker="o", label=f"B={B}")
        axes[1].plot([r["S"] for r in sel], [r["relay_over_floor"] for r in sel], marker="o", label=f"B={B}")
    axes[0].set(xscale="log", yscale="log", xlabel="prefix length S", ylabel="speedup vs SDPA over expanded KV",
                title="relay kernel vs stock attention (decode, bf16)")
    axes[1].set(xscale="log", xlabel="prefix length S", ylabel="relay time / bandwidth floor",
                title="relay kernel vs its bandwidth floor")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_kernel(args) -> None:
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {torch.cuda.get_device_name()}")
    if args.tune:
        tune()
    grid = list(itertools.product(args.prefix_len, args.batch))
    rows = [kernel_case(S, B, bw=bw) for S, B in tqdm(grid, desc="kernel")]
    print_table(rows)
    write_outputs(rows, args.out, "kernel")
    plot_kernel(rows, args.out / "kernel_speedup.png")
    print(f"wrote {args.out / 'kernel.csv'} and {args.out / 'kernel_speedup.png'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m relay_hf.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernel", help="one decode attention layer: relay kernel vs SDPA vs naive relay vs floor")
    k.add_argument("--prefix-len", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    k.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    k.add_argument("--out", type=Path, default=Path("bench_out"))
    k.add_argument("--tune", action="store_true", help="time the tile/split VARIANTS first and use the fastest")
    k.set_defaults(func=run_kernel)
    add_generate_parser(sub)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
