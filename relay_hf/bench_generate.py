"""``python -m relay_hf.bench generate``: end-to-end greedy ``generate`` on a random-init model (no download).

Workload (same as ``shared/anchors/h200_stock_hf_e2e.json``): a system prompt of S tokens + a 64-token user prompt
per row, B rows, greedy. Per mode: time to first token (TTFT, prefill included), median decode step (timed per token
through a streamer), generated tok/s, peak memory.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0),
}


def build_model(shape: str, device: str, dtype: torch.dtype, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_positions, pad_token_id=0, eos_token_id=None,
                         attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


class _Clock(BaseStreamer):
    """Timestamps every ``put``: generate puts the prompt, then each new token (after a device->host copy, so the
    timestamps follow the device)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _clocked(model, ids, new_tokens: int) -> tuple[float, float]:
    """(time to first token in s, median decode step in s) of one greedy generate call."""
    clock = _Clock()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, streamer=clock)
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    return clock.times[1] - start, statistics.median(steps)


def generate_case(model, mode: str, S: int, B: int, user: int = 64, new_tokens: int = 24) -> dict:
    """One (mode, S, B) point. ``mode`` is ``stock`` or ``relay``."""
    import relay_hf

    g = torch.Generator().manual_seed(S * 131 + B)
    system = torch.randint(10, model.config.vocab_size, (1, S), generator=g)
    ids = torch.cat([system.expand(B, -1), torch.randint(10, model.config.vocab_size, (B, user), generator=g)], 1)
    ids = ids.to(model.device)
    relay_hf.unpatch(model)
    if mode == "relay":
        relay_hf.patch(model, min_prefix_length=1)
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = dict(mode=mode, S=S, B=B)
    try:
        with torch.no_grad():
            _clocked(model, ids, 3)  # warm-up (kernels, allocator)
            ttft, step = _clocked(model, ids, new_tokens)
    except torch.OutOfMemoryError:
        return dict(row, ttft_s=float("nan"), step_ms=float("nan"), tok_per_s=float("nan"), peak_GiB=float("inf"),
                    relay_used=False)
    decision = getattr(model, "relay_last_decision", None)
    return dict(row, ttft_s=ttft, step_ms=step * 1e3, tok_per_s=B / step,
                peak_GiB=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
                relay_used=bool(decision and decision.used))


def plot_generate(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (mode, B), group in itertools.groupby(sorted(rows, key=lambda r: (r["mode"], r["B"], r["S"])),
                                              key=lambda r: (r["mode"], r["B"])):
        group = list(group)
        ax.plot([r["S"] for r in group], [r["tok_per_s"] for r in group], marker="o",
                linestyle="-" if mode == "relay" else "--", label=f"{mode} B={B}")
    ax.set(xscale="log", yscale="log", xlabel="system prompt length S", ylabel="generated tok/s",
           title="decode throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_generate(args) -> None:
    from .bench import print_table, write_outputs

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model_shape, device, dtype, max(args.prefix_len) + 256)
    grid = list(itertools.product(args.modes, args.prefix_len, args.batch))
    rows = [generate_case(model, mode, S, B, new_tokens=args.new_tokens)
            for mode, S, B in tqdm(grid, desc="generate")]
    print_table(rows)
    name = f"generate_{args.model_shape}_{'_'.join(args.modes)}"
    write_outputs(rows, args.out, name)
    plot_generate(rows, args.out / f"{name}.png")


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="end-to-end generate: stock vs relay on a random-init model")
    p.add_argument("--model-shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--prefix-len", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--modes", nargs="+", default=["stock", "relay"], choices=["stock", "relay"])
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.set_defaults(func=run_generate)
