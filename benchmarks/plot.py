"""The plots of docs/performance.md, drawn from the benchmark CSVs (the latest run of every point).

    python -m benchmarks.plot                      # benchmarks/data/*.csv -> docs/img/{kernel,generate}.png
    python -m benchmarks.plot --device "NVIDIA H200" --out /tmp/plots

* ``kernel.png``: for each prefix length S and batch B of the Llama-3-8B-shaped decode layer (bf16, 256-token
  suffixes), relay's speedup over SDPA on the expanded prefix and its time over the bandwidth floor, both taken from
  the latest run that measured the point.
* ``generate.png``: the decode step of ``generate`` against the batch size, one panel per system-prompt length, one
  line per mode (the latest ``step`` row of each point).
* ``groups.png``: several system prompts per batch (``--groups`` sweeps): one decode layer's time and its bandwidth
  floor, and ``generate``'s decode step per mode, against the number of prompts the rows are split between.

The first two figures show one system prompt per batch (``groups`` 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import DATA, REPO, read_rows

KERNEL_SHAPE = dict(dtype="bfloat16", H_q="32", H_kv="8", D="128", L_s="256")
# (line style, colour): in every panel
MODE_STYLE = {"stock": (":", "C0"), "prefix_reuse": ("--", "C1"), "static": ("--", "C2"), "relay": ("-.", "C3"),
              "relay_compiled": ("-", "C4"), "relay_eager": (":", "C5"), "relay_graph": ("--", "C6")}


def _device(rows: list[dict], device: str | None) -> str:
    devices = [r["device"] for r in rows]
    if device is None:
        device = "NVIDIA H200" if "NVIDIA H200" in devices else devices[-1]
    if device not in devices:
        raise SystemExit(f"no rows for device {device!r}; the CSV has {sorted(set(devices))}")
    return device


def _run(row: dict) -> tuple[str, str]:
    return row["timestamp"], row["commit"]


def kernel_points(rows: list[dict], device: str | None = None, shape: dict | None = None) -> list[dict]:
    """Per (S, B): speedup over SDPA and time over the floor, from the latest run with both relay and SDPA times
    (rows are appended in time order, so the last run in the file wins)."""
    device = _device(rows, device)
    shape = KERNEL_SHAPE if shape is None else shape
    sel = [r for r in rows if r["device"] == device and r["metric"] == "time" and r["S"]
           and r["groups"] in ("", "1") and all(r[k] == v for k, v in shape.items())]
    times: dict = {}
    for r in sel:  # later rows overwrite earlier runs' values only within their own run's entry
        times.setdefault((int(r["S"]), int(r["B"])), {}).setdefault(_run(r), {})[r["provider"]] = float(r["median"])
    points = []
    for (S, B), runs in sorted(times.items()):
        complete = [(run, t) for run, t in runs.items() if "relay" in t and "sdpa" in t]
        if not complete:
            continue
        run, t = complete[-1]
        floor = t.get("floor_relay")
        points.append(dict(S=S, B=B, relay_us=t["relay"], sdpa_us=t["sdpa"], speedup=t["sdpa"] / t["relay"],
                           over_floor=t["relay"] / floor if floor else float("nan"), commit=run[1]))
    return points


def generate_points(rows: list[dict], device: str | None = None, model: str = "llama3-8b",
                    dtype: str = "bfloat16") -> list[dict]:
    """The latest ``step`` row of every (mode, S, B) point."""
    device = _device(rows, device)
    latest = {}
    for r in rows:
        if (r["device"] == device and r["model"] == model and r["dtype"] == dtype and r["metric"] == "step"
                and r["groups"] in ("", "1")):
            latest[(r["mode"], int(r["S"]), int(r["B"]))] = r
    return [dict(mode=m, S=S, B=B, step_ms=float(r["median"]), commit=r["commit"])
            for (m, S, B), r in sorted(latest.items())]


def group_points(kernel_rows: list[dict], generate_rows: list[dict], device: str | None = None,
                 shape: dict | None = None, model: str = "llama3-8b") -> tuple[list[dict], list[dict]]:
    """``(kernel, generate)`` points of the ``--groups`` sweeps: per (S, B, groups) relay's time and floor from the
    latest kernel run that measured both, and per (mode, S, B, groups) the latest decode step (only the (S, B)
    points measured at more than one prompt)."""
    shape = KERNEL_SHAPE if shape is None else shape
    kernel: dict = {}
    for r in kernel_rows:
        if (r["device"] == _device(kernel_rows, device) and r["metric"] == "time" and r["S"]
                and all(r[k] == v for k, v in shape.items())):
            kernel.setdefault((int(r["S"]), int(r["B"]), int(r["groups"] or 1)), {}).setdefault(
                _run(r), {})[r["provider"]] = float(r["median"])
    ks = []
    for (S, B, g), runs in sorted(kernel.items()):
        complete = [t for t in runs.values() if "relay" in t and "floor_relay" in t]
        if complete:
            ks.append(dict(S=S, B=B, groups=g, relay_us=complete[-1]["relay"], floor_us=complete[-1]["floor_relay"]))
    steps: dict = {}
    for r in generate_rows:
        if (r["device"] == _device(generate_rows, device) and r["model"] == model and r["metric"] == "step"
                and r["dtype"] == shape["dtype"]):
            steps[(r["mode"], int(r["S"]), int(r["B"]), int(r["groups"] or 1))] = float(r["median"])
    gs = [dict(mode=m, S=S, B=B, groups=g, step_ms=v) for (m, S, B, g), v in sorted(steps.items())]
    swept = lambda points: {(p["S"], p["B"]) for p in points if p["groups"] > 1}  # noqa: E731
    return ([p for p in ks if (p["S"], p["B"]) in swept(ks)], [p for p in gs if (p["S"], p["B"]) in swept(gs)])


def plot_groups(kernel: list[dict], steps: list[dict], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for S, B in sorted({(p["S"], p["B"]) for p in kernel}):
        sel = [p for p in kernel if (p["S"], p["B"]) == (S, B)]
        line = axes[0].plot([p["groups"] for p in sel], [p["relay_us"] for p in sel], marker="o",
                            label=f"relay, S={S}, B={B}")[0]
        axes[0].plot([p["groups"] for p in sel], [p["floor_us"] for p in sel], linestyle=":", color=line.get_color(),
                     label="its bandwidth floor")
    axes[0].set(xlabel="system prompts in the batch", ylabel="one decode attention layer (µs)",
                title="each prompt read once per batch")
    for mode, S, B in sorted({(p["mode"], p["S"], p["B"]) for p in steps}):
        sel = [p for p in steps if (p["mode"], p["S"], p["B"]) == (mode, S, B)]
        style, colour = MODE_STYLE.get(mode, ("-", None))
        axes[1].plot([p["groups"] for p in sel], [p["step_ms"] for p in sel], marker="o", linestyle=style,
                     color=colour, label=f"{mode}, S={S}, B={B}")
    axes[1].set(xlabel="system prompts in the batch", ylabel="decode step (ms)", yscale="log",
                title="generate: decode step")
    for ax, points in zip(axes, (kernel, steps)):
        ax.set_xticks(sorted({p["groups"] for p in points}) or [1])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_kernel(points: list[dict], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for B in sorted({p["B"] for p in points}):
        sel = [p for p in points if p["B"] == B]
        axes[0].plot([p["S"] for p in sel], [p["speedup"] for p in sel], marker="o", label=f"B={B}")
        axes[1].plot([p["S"] for p in sel], [p["over_floor"] for p in sel], marker="o", label=f"B={B}")
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set(xscale="log", yscale="log", xlabel="shared prefix tokens S", ylabel="speedup over SDPA on the "
                "expanded prefix", title="relay attention vs stock (one decode layer)")
    axes[1].set(xscale="log", xlabel="shared prefix tokens S", ylabel="relay time / bandwidth floor",
                title="relay attention vs its bandwidth floor")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_generate(points: list[dict], path: Path, title: str) -> None:
    plt = _pyplot()
    lengths = sorted({p["S"] for p in points})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 4), sharey=True, squeeze=False)
    for ax, S in zip(axes[0], lengths):
        for mode in [m for m in MODE_STYLE if any(p["mode"] == m and p["S"] == S for p in points)]:
            sel = [p for p in points if p["mode"] == mode and p["S"] == S]
            style, colour = MODE_STYLE[mode]
            ax.plot([p["B"] for p in sel], [p["step_ms"] for p in sel], marker="o", linestyle=style, color=colour,
                    label=mode)
        ax.set(xscale="log", yscale="log", xlabel="rows B", title=f"system prompt S = {S}")
        ax.set_xticks(sorted({p["B"] for p in points if p["S"] == S}))
        ax.set_xticklabels([str(b) for b in sorted({p["B"] for p in points if p["S"] == S})])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("decode step (ms)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__.splitlines()[0])
    parser.add_argument("--kernel-csv", type=Path, default=DATA / "kernel.csv")
    parser.add_argument("--generate-csv", type=Path, default=DATA / "generate.csv")
    parser.add_argument("--device", default=None, help='rows of this device (default "NVIDIA H200" if present)')
    parser.add_argument("--model-shape", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kernel-shape", nargs=4, type=int, default=None, metavar=("H_Q", "H_KV", "D", "L_S"),
                        help="shape of the kernel points (default: Llama-3-8B, 32 8 128 256)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    if args.kernel_csv.exists():
        shape = KERNEL_SHAPE if args.kernel_shape is None else dict(
            dtype=args.dtype, **dict(zip(("H_q", "H_kv", "D", "L_s"), map(str, args.kernel_shape))))
        rows = read_rows(args.kernel_csv)
        points = kernel_points(rows, args.device, shape)
        if points:
            path = args.out / "kernel.png"
            plot_kernel(points, path, f"{_device(rows, args.device)}, {shape['dtype']}, H_q={shape['H_q']}, "
                        f"H_kv={shape['H_kv']}, D={shape['D']}, L_s={shape['L_s']}; latest run of each point")
            written.append(path)
    if args.generate_csv.exists():
        rows = read_rows(args.generate_csv)
        points = generate_points(rows, args.device, args.model_shape, args.dtype)
        if points:
            path = args.out / "generate.png"
            plot_generate(points, path, f"{_device(rows, args.device)}, {args.model_shape}-shaped random model, "
                          f"{args.dtype}; latest run of each point")
            written.append(path)
    if args.kernel_csv.exists() and args.generate_csv.exists():
        kernel_rows, generate_rows = read_rows(args.kernel_csv), read_rows(args.generate_csv)
        kernel, steps = group_points(kernel_rows, generate_rows, args.device, None, args.model_shape)
        if kernel or steps:
            path = args.out / "groups.png"
            plot_groups(kernel, steps, path, f"{_device(kernel_rows, args.device)}, bf16, {args.model_shape} shapes; "
                        "the rows split evenly between the prompts; latest run of each point")
            written.append(path)
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
