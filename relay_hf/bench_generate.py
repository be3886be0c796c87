"""``python -m relay_hf.bench generate``: end-to-end greedy ``generate`` on a random-init model (no download).

Workload (same as ``shared/anchors/h200_stock_hf_e2e.json``): a system prompt of S tokens + a 64-token user prompt
per row, B rows, greedy. Per mode: time to first token (TTFT: a 1-token call, prefill included), decode step (the
median over every step of the timed calls, each step timed between CUDA events; ``step_mean_ms`` is the older
estimate, a ``new_tokens`` call minus the 1-token call over ``new_tokens - 1``), generated tok/s (B / median step),
peak memory. Modes:

* ``stock``: plain ``generate`` (DynamicCache, eager).
* ``prefix_reuse``: the documented transformers recipe: the system prompt prefilled once into a DynamicCache
  (not timed), then per call a deepcopy expanded to the batch (timed) and ``generate``.
* ``static``: ``cache_implementation="static"``: transformers' compiled decode path (``--compile-backend``).
* ``relay``: ``relay_hf.patch``, eager.
* ``relay_compiled``: ``relay_hf.patch`` + ``cache_implementation="static"``: a static RelayCache, decoded by
  relay_hf's loop (the step compiled and captured as one CUDA graph, no host sync per token).

Each point runs warm-up calls (compilation, CUDA-graph capture, allocator) before the timed calls.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

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


MODES = ("stock", "prefix_reuse", "static", "relay", "relay_compiled")
_LINESTYLE = {"relay": "-.", "relay_compiled": "-"}  # stock modes dashed


def compile_config(backend: str):
    from transformers import CompileConfig

    return CompileConfig(fullgraph=True, backend=backend, mode="reduce-overhead" if backend == "inductor" else None)


class _StepClock:
    """Marks between decode steps, read after the call: CUDA events on the GPU (recording adds no host sync),
    wall time on the CPU (where every op is synchronous anyway). ``relay_hf``'s loop marks through
    ``decode.STEP_HOOK``; transformers' loop through a stopping criterion, which it calls after every token."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def mark(self) -> None:
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def steps_s(self) -> list[float]:
        """Seconds of each decode step: the time between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    def criteria(self):
        from transformers import StoppingCriteria, StoppingCriteriaList

        clock = self

        class MarkEveryToken(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                clock.mark()
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        return StoppingCriteriaList([MarkEveryToken()])


def _timed_generate(model, ids, new_tokens: int, make_kwargs, clock: _StepClock | None = None) -> float:
    """Seconds of one greedy generate call making exactly ``new_tokens`` tokens; ``make_kwargs()`` runs inside the
    timed region (the prefix-reuse copy belongs to the call). ``clock`` (if given) gets a mark after every token:
    through relay_hf's loop hook when the model's last call ran that loop, else as a stopping criterion."""
    from . import decode

    extra = {}
    if clock is not None:
        decision = getattr(model, "relay_last_decision", None)
        if decision is not None and decision.fast_decode:
            decode.STEP_HOOK = clock.mark
        else:
            extra["stopping_criteria"] = clock.criteria()
    start = time.perf_counter()
    try:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, **extra, **make_kwargs())
        if ids.is_cuda:
            torch.cuda.synchronize()
    finally:
        decode.STEP_HOOK = None
    return time.perf_counter() - start


def _clocked(model, ids, new_tokens: int, make_kwargs, reps: int = 1) -> tuple[float, float, float]:
    """(time to first token in s, median decode step in s, mean decode step in s). The first token is a 1-token
    call (prefill included). The median step is over every step of ``reps`` ``new_tokens`` calls, each step timed
    on its own (``_StepClock``). The mean step is the older estimate: (a ``new_tokens`` call − a 1-token call) /
    (``new_tokens`` − 1), medians of ``reps`` alternating pairs; it also carries any difference between the two
    calls' prefills, which at S = 8192 moves it by tenths of a millisecond a step. No streamer: a per-token host
    sync would itself be part of what is measured."""
    pairs, steps = [], []
    for _ in range(reps):
        clock = _StepClock(ids.is_cuda)
        pairs.append((_timed_generate(model, ids, 1, make_kwargs),
                      _timed_generate(model, ids, new_tokens, make_kwargs, clock)))
        steps += clock.steps_s()
    first, total = (statistics.median(p[i] for p in pairs) for i in (0, 1))
    return first, statistics.median(steps) if steps else float("nan"), (total - first) / (new_tokens - 1)


def _mode_kwargs(model, mode: str, system: torch.Tensor, B: int, backend: str):
    """A function giving ``generate``'s extra kwargs for ``mode`` (patching / unpatching ``model`` as needed)."""
    import copy

    from transformers import DynamicCache

    import relay_hf

    from ._compat import cache_kwarg_name

    relay_hf.unpatch(model)
    if mode.startswith("relay"):
        relay_hf.patch(model, min_prefix_length=1)
    if mode in ("static", "relay_compiled"):
        return lambda: dict(cache_implementation="static", compile_config=compile_config(backend))
    if mode == "prefix_reuse":
        name = cache_kwarg_name(model)
        prefilled = DynamicCache()
        with torch.no_grad():
            model(input_ids=system, use_cache=True, **{name: prefilled})

        def reuse():
            cache = copy.deepcopy(prefilled)
            cache.batch_repeat_interleave(B)
            return {name: cache}

        return reuse
    return dict


def generate_case(model, mode: str, S: int, B: int, user: int = 64, new_tokens: int = 24, reps: int = 3,
                  backend: str = "inductor") -> dict:
    """One (mode, S, B) point; ``mode`` is one of ``MODES``."""
    g = torch.Generator().manual_seed(S * 131 + B)
    system = torch.randint(10, model.config.vocab_size, (1, S), generator=g)
    ids = torch.cat([system.expand(B, -1), torch.randint(10, model.config.vocab_size, (B, user), generator=g)], 1)
    ids, system = ids.to(model.device), system.to(model.device)
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = dict(mode=mode, S=S, B=B)
    try:
        make_kwargs = _mode_kwargs(model, mode, system, B, backend)
        with torch.no_grad():
            start = time.perf_counter()
            _clocked(model, ids, new_tokens, make_kwargs)  # warm-up: compile (both cache sizes), capture, allocator
            warmup = time.perf_counter() - start
            ttft, step, step_mean = _clocked(model, ids, new_tokens, make_kwargs, reps)
    except torch.OutOfMemoryError:
        nan = float("nan")
        return dict(row, ttft_s=nan, step_ms=nan, step_mean_ms=nan, tok_per_s=nan, peak_GiB=float("inf"), warmup_s=nan,
                    relay_used=False, relay_loop=False)
    decision = getattr(model, "relay_last_decision", None)
    return dict(row, ttft_s=ttft, step_ms=step * 1e3, step_mean_ms=step_mean * 1e3, tok_per_s=B / step,
                peak_GiB=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"), warmup_s=warmup,
                relay_used=bool(decision and decision.used), relay_loop=bool(decision and decision.fast_decode))


def plot_generate(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (mode, B), group in itertools.groupby(sorted(rows, key=lambda r: (r["mode"], r["B"], r["S"])),
                                              key=lambda r: (r["mode"], r["B"])):
        group = list(group)
        ax.plot([r["S"] for r in group], [r["tok_per_s"] for r in group], marker="o",
                linestyle=_LINESTYLE.get(mode, "--"), label=f"{mode} B={B}")
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
    # every point is a new static shape for the compiled modes: let dynamo keep them all instead of falling back to
    # eager after its default recompile limit (8) and timing that
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(grid))
    name = f"generate_{args.model_shape}_{'_'.join(args.modes)}"
    rows = []
    for mode, S, B in (bar := tqdm(grid, desc="generate")):
        bar.set_postfix_str(f"{mode} S={S} B={B}")
        rows.append(generate_case(model, mode, S, B, new_tokens=args.new_tokens, reps=args.reps,
                                  backend=args.compile_backend))
        write_outputs(rows, args.out, name)  # after every point: a stopped run keeps what it measured
    print_table(rows)
    plot_generate(rows, args.out / f"{name}.png")


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="end-to-end generate: stock / prefix reuse / static vs relay (eager, compiled)")
    p.add_argument("--model-shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--prefix-len", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--modes", nargs="+", default=["stock", "relay"], choices=MODES)
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled modes")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--reps", type=int, default=3, help="timed (1-token, new-tokens) call pairs per point; medians")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.set_defaults(func=run_generate)
