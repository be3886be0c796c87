"""End-to-end ``generate`` on a random-init model (no download): stock transformers vs a patched model.

    python -m benchmarks.generate --prefix-len 4096 --batch 64 --modes prefix_reuse relay relay_eager
    python -m benchmarks.generate --model-shape tiny --device cpu --dtype float32 --prefix-len 32 --batch 2 \\
        --new-tokens 4 --reps 1                                    # the CPU smoke run (a few seconds)

Workload: a system prompt of S tokens shared by B rows (``--groups g``: g system prompts of S tokens, the rows split
evenly between them), each followed by its own U-token user prompt; no EOS (the model's ``eos_token_id`` is unset),
so every call makes exactly ``max_new_tokens`` tokens. Modes:

* ``stock``: ``model.generate(**inputs, max_new_tokens=N)`` (DynamicCache, eager).
* ``prefix_reuse``: transformers' documented prefix-caching recipe: the system prompt prefilled once into a
  DynamicCache (not timed), per call a deep copy expanded to the batch (timed) passed to ``generate`` (one system
  prompt only: the recipe has no way to give rows different ones).
* ``static``: ``generate(..., cache_implementation="static")``: transformers' compiled decode.
* ``relay``: ``relay_hf.patch(model)``, then plain ``generate`` (on CUDA: relay_hf's loop, CUDA graphs of the step,
  whose decoder layer is compiled for fp16 / bf16).
* ``relay_graph``: ``relay_hf.patch(model, decode="graph")``, then plain ``generate`` (relay_hf's loop, CUDA graphs
  of the eager step).
* ``relay_eager``: ``relay_hf.patch(model, decode="eager")``, then plain ``generate`` (transformers' loop).
* ``relay_compiled``: ``relay_hf.patch(model)``, then ``generate(..., cache_implementation="static")`` (relay_hf's
  loop with the forward compiled by inductor).

Every number is the wall time of whole ``generate`` calls, the device synchronised around each call; nothing is
hooked inside relay_hf or transformers. Per (mode, S, B) point, in this order:

* ``patch`` (s, relay modes): ``relay_hf.patch(model)`` (its probe included; at a process's first point, the
  fresh process's).
* ``cold_first_call`` (s): the first N-token call at this point (compilation and graph capture of a new shape).
* ``ttft`` (s): a warm 1-token call (prefill and the first token; relay modes: the system prompt kept by an earlier
  call, ``patch(model, prefix_cache_bytes=...)``); ``ttft_new_prompt`` (s, relay modes): the same call with the
  system prompt prefilled again (``relay_hf.clear_prefixes`` before it); ``ttft_one_row`` (s): a warm 1-token call of
  the first row alone (a chat turn under the kept system prompt, after an N-token turn of that row).
* ``step`` (ms): warm greedy decode step, ``(wall(N) - wall(M)) / (N - M)`` with M = ``--short-tokens`` (N/4, at
  least 2): both calls run the same decode loop, so its per-call setup cancels and only the N - M extra steps
  remain. ``tok_per_s`` = B / step; ``bandwidth`` (GB/s) = the weights plus the KV the mode reads in the middle
  step, over the step; ``peak_memory`` (GiB, CUDA) over the greedy calls.
* ``streamed_step`` (ms): the same N-token call with a streamer that notes when each new token reaches it:
  ``(last - first) / (N - 1)``, the steps alone, whatever the prefill costs (on the CPU a long prefill's spread
  swamps the difference of two calls). relay_hf's loop hands tokens over 16 at a time on CUDA, so there it counts
  whole chunks.
* ``sample_step`` (ms): the same with ``do_sample=True, top_p=0.9, temperature=0.7`` (its first call, which may
  compile another loop, is ``sample_first_call``).
* ``new_batch_first_call`` (s): then the first N-token call at another batch size (``--new-batch``, 3/4 of B).
* ``longer_prompt_call`` (s): then the first N-token call at B rows with user prompts twice as long.
* ``kv_memory`` (MiB): the KV the call holds when it ends, summed over the distinct storages of the cache a
  ``return_dict_in_generate=True`` call hands back (prefix and suffix buffers of a ``RelayCache``; every row's
  keys and values of stock's cache).
* ``host`` (µs, relay modes on CUDA): one eager ``relay_hf.relay_attention`` call at this point's decode shape (one
  query per row, ``U + N`` suffix positions), timed over 300 calls with no synchronisation; ``host_layer`` (µs): one
  eager decode attention layer call as transformers' loop makes it, through the seam (``relay_attention_forward`` on
  the ``RelayKV`` of a ``RelayCache`` of the first system prompt forked for B rows: the module's options, the step's
  plan and the launch).

Medians over ``--reps`` repetitions; ``lo`` / ``hi`` are their 20th / 80th percentiles.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import time
from pathlib import Path

import torch

import relay_hf

from .common import (
    DATA,
    GENERATE_FIELDS,
    append_rows,
    environment,
    host_us,
    print_table,
    progress,
    say,
    summary,
    sync,
    wall_s,
)

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "qwen2-7b": dict(config="Qwen2Config", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    # Gemma 3 270M's shape: five sliding-window layers (512 tokens) to one global layer
    "gemma3-270m": dict(config="Gemma3TextConfig", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                        sliding_window=512, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3),
    # Gemma 2 9B's shape: logit softcapping, sliding-window (4096) and global layers alternating; transformers runs
    # softcapping in eager attention only
    "gemma2-9b": dict(config="Gemma2Config", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                      sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      query_pre_attn_scalar=256, attn_implementation="eager"),
    # Phi-3-mini's shape: head dim 96 (a size the kernels meet nowhere else), 32 KV heads; full attention
    "phi3-mini": dict(config="Phi3Config", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, rope_theta=10000.0,
                      sliding_window=None),
}
# what a point measures (``--only`` picks some: a slow stock baseline need not run every call)
METRIC_GROUPS = ("ttft", "step", "streamed", "sampling", "new_batch", "longer_prompt", "kv_memory", "host")
MODES = ("stock", "prefix_reuse", "static", "relay", "relay_graph", "relay_eager", "relay_compiled")
SAMPLING = dict(do_sample=True, top_p=0.9, temperature=0.7)


def build_model(shape: str, device: torch.device, dtype: torch.dtype, max_positions: int):
    """A random-init causal LM of ``SHAPES[shape]`` (a ``LlamaConfig`` unless the shape names its config class) with
    no EOS token (calls never stop early)."""
    import transformers

    spec = dict(SHAPES[shape])
    config = getattr(transformers, spec.pop("config", "LlamaConfig"))(
        **{"attn_implementation": "sdpa", **spec}, max_position_embeddings=max_positions, pad_token_id=0,
        bos_token_id=None, eos_token_id=None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _kwargs_for(model, mode: str, system: torch.Tensor, stock_prefill_chunk: int | None = None):
    """Patch or unpatch ``model`` for ``mode``; return ``B -> generate kwargs`` (called inside the timed region: the
    prefix-reuse copy belongs to the call). ``stock_prefill_chunk``: stock's own chunked prefill
    (``prefill_chunk_size``) for the stock mode, where a whole batch's eager-attention prefill does not fit."""
    from transformers import DynamicCache

    from relay_hf._compat import cache_kwarg_name

    relay_hf.unpatch(model)  # also drops the static cache and captured step of an earlier point
    if mode.startswith("relay"):
        relay_hf.patch(model, decode={"relay_eager": "eager", "relay_graph": "graph"}.get(mode, "auto"))
    if mode in ("static", "relay_compiled"):
        return lambda B: dict(cache_implementation="static")
    if mode == "stock" and stock_prefill_chunk:
        return lambda B: dict(prefill_chunk_size=stock_prefill_chunk)
    if mode == "prefix_reuse":
        name = cache_kwarg_name(model)
        prefilled = DynamicCache()
        with torch.no_grad():
            model(input_ids=system, use_cache=True, **{name: prefilled})

        def reuse(B):
            cache = copy.deepcopy(prefilled)
            cache.batch_repeat_interleave(B)
            return {name: cache}

        return reuse
    return lambda B: {}


def _inputs(system: torch.Tensor, B: int, U: int, vocab: int, seed: int) -> dict:
    """``B`` rows: row ``b`` under system prompt ``b * g // B`` of ``system [g, S]``, then ``U`` tokens of its own."""
    g = torch.Generator().manual_seed(seed)
    user = torch.randint(10, vocab, (B, U), generator=g).to(system.device)
    which = torch.arange(B, device=system.device) * system.shape[0] // B
    ids = torch.cat([system[which], user], 1)  # [B, S + U]
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def kv_bytes(cache) -> int:
    """Bytes of the distinct storages behind a returned cache's tensors (a ``RelayCache``'s prefix and suffix buffers,
    or every layer's keys and values)."""
    seen, total = set(), 0
    for layer in getattr(cache, "layers", []):
        for name in ("prefix_keys", "prefix_values", "_kbuf", "_vbuf", "keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.numel():
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def _step_bytes(model, decision, S: int, U: int, B: int, tokens: float, groups: int = 1) -> int:
    """Bytes one decode step reads: every weight but the input embedding (a gather), and the KV the mode holds
    after ``tokens`` generated tokens: one copy of each of the ``groups`` prefixes plus B suffixes when relay served
    the call, else B rows."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if not c.tie_word_embeddings:
        weights -= embedding.numel() * embedding.element_size()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize
    kv_tokens = groups * S + B * (U + tokens) if decision is not None and decision.used else B * (S + U + tokens)
    return int(weights + per_token * kv_tokens)


def generate_point(model, mode: str, S: int, B: int, U: int, N: int, M: int, reps: int, new_batch: int | None,
                   sampling: bool = True, seed: int = 0, groups: int = 1, only=METRIC_GROUPS,
                   stock_prefill_chunk: int | None = None) -> list[dict]:
    """The CSV rows (without the run's fields) of one (mode, S, B, groups) point; ``mode`` is one of ``MODES``;
    ``only``: the ``METRIC_GROUPS`` to measure (the cold first call always)."""
    device = model.device
    vocab = model.config.vocab_size
    system = torch.randint(10, vocab, (groups, S), generator=torch.Generator().manual_seed(seed * 131 + S)).to(device)
    inputs = _inputs(system, B, U, vocab, seed * 7 + B)
    cuda = device.type == "cuda"
    started = time.perf_counter()
    make_kwargs = _kwargs_for(model, mode, system, stock_prefill_chunk)
    if cuda:
        torch.cuda.synchronize(device)
    patch_s = time.perf_counter() - started  # relay modes: ``relay_hf.patch``, its probe included
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def call(n: int, rows: dict = inputs, **extra) -> float:
        return wall_s(lambda: model.generate(**rows, max_new_tokens=n, **make_kwargs(rows["input_ids"].shape[0]),
                                             **extra), device)

    def decision():
        d = getattr(model, "relay_last_decision", None)
        return dict(relay_used=bool(d and d.used), relay_loop=bool(d and d.fast_decode))

    base = dict(S=S, U=U, B=B, groups=groups, new_tokens=N, mode=mode)
    rows = []

    def add(metric: str, unit: str, values: dict, flags: dict, note: str = ""):
        rows.append(dict(base, metric=metric, unit=unit, **values, **flags, note=note))

    def steps(**extra) -> list[float]:
        """ms per decode step of ``reps`` (M-token, N-token) call pairs."""
        return [(call(N, **extra) - call(M, **extra)) / (N - M) * 1e3 for _ in range(reps)]

    def streamed() -> list[float]:
        """ms per decode step as a streamer sees the tokens arrive, over ``reps`` N-token calls."""
        out = []
        for _ in range(reps):
            clock = _Clock()
            call(N, streamer=clock)
            out.append((clock.times[-1] - clock.times[0]) / max(1, len(clock.times) - 1) * 1e3)
        return out

    with torch.no_grad():
        if mode.startswith("relay"):
            add("patch", "s", dict(median=patch_s, n=1), dict(relay_used=False, relay_loop=False))
        add("cold_first_call", "s", dict(median=call(N), n=1), decision())
        call(M)  # warm-up: every call shape compiled and captured before the timed calls
        if "ttft" in only:
            call(1)
            add("ttft", "s", summary(call(1) for _ in range(reps)), decision())
            if relay_hf.is_patched(model):  # the same call with the system prompt prefilled again
                def new_prompt() -> float:
                    relay_hf.clear_prefixes(model)
                    return call(1)
                add("ttft_new_prompt", "s", summary(new_prompt() for _ in range(reps)), decision())
            one = {k: v[:1] for k, v in inputs.items()}  # a chat turn: one row under the (kept) system prompt
            call(N, rows=one)  # a whole earlier turn, as a chat's turns come (its step compiled and captured)
            call(1, rows=one)  # (the prefill recorded through the compiled step: DecodeConfig.compiled_prefill)
            add("ttft_one_row", "s", summary(call(1, rows=one) for _ in range(reps)), decision())
        if "step" in only:
            step = summary(steps())
            greedy = decision()
            relay_decision = getattr(model, "relay_last_decision", None)
            add("step", "ms", step, greedy)
            rate = lambda ms: B / ms * 1e3 if ms > 0 else float("nan")  # noqa: E731 (noise can make it <= 0)
            add("tok_per_s", "tok/s", dict(median=rate(step["median"]), lo=rate(step["hi"]), hi=rate(step["lo"]),
                                           n=step["n"], spread_of=step["spread_of"]), greedy)
            nbytes = _step_bytes(model, relay_decision, S, U, B, (M + N) / 2, groups)
            add("bandwidth", "GB/s", dict(median=nbytes / step["median"] / 1e6, n=step["n"]), greedy)
            if cuda:
                sync(device)
                add("peak_memory", "GiB", dict(median=torch.cuda.max_memory_allocated(device) / 2**30, n=1), greedy)
        if "streamed" in only and N > 1:
            add("streamed_step", "ms", summary(streamed()), decision())
        if "kv_memory" in only:
            held = model.generate(**inputs, max_new_tokens=N, return_dict_in_generate=True,
                                  **make_kwargs(inputs["input_ids"].shape[0]))
            cache = held.get("cache") if held.get("cache") is not None else held.get("past_key_values")
            add("kv_memory", "MiB", dict(median=kv_bytes(cache) / 2**20, n=1), decision())
            del held, cache
        if "sampling" in only and sampling:
            add("sample_first_call", "s", dict(median=call(N, **SAMPLING), n=1), decision())
            call(M, **SAMPLING)
            add("sample_step", "ms", summary(steps(**SAMPLING)), decision())
        if "new_batch" in only and new_batch:
            other = _inputs(system, new_batch, U, vocab, seed * 7 + new_batch)
            add("new_batch_first_call", "s", dict(median=call(N, other), n=1), decision(), note=f"B={new_batch}")
        if "longer_prompt" in only:
            longer = _inputs(system, B, 2 * U, vocab, seed * 7 + B + 1)
            add("longer_prompt_call", "s", dict(median=call(N, longer), n=1), decision(), note=f"U={2 * U}")
        if "host" in only and cuda and mode.startswith("relay"):
            add("host", "us", summary(host_us(_attention_call(model, S, B, U + N), device)), decision())
            add("host_layer", "us", summary(host_us(_layer_call(model, system[0], B, U + N), device)), decision())
    return rows


class _Clock:
    """A streamer that notes when each generated token arrives (the prompt's put is not a token)."""

    def __init__(self):
        self.times, self.prompt = [], True

    def put(self, value):
        if self.prompt:
            self.prompt = False
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _attention_call(model, S: int, B: int, L_s: int):
    """One eager ``relay_attention`` call at the model's decode shape: ``[B, H_q, 1, D]`` queries over an S-token
    prefix and ``L_s`` suffix positions per row."""
    c = model.config
    D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    make = lambda *shape: torch.randn(*shape, device=model.device, dtype=model.dtype)  # noqa: E731
    q, pk, pv = make(B, c.num_attention_heads, 1, D), make(1, c.num_key_value_heads, S, D), \
        make(1, c.num_key_value_heads, S, D)
    sk, sv = make(B, c.num_key_value_heads, L_s, D), make(B, c.num_key_value_heads, L_s, D)
    return lambda: relay_hf.relay_attention(q, pk, pv, sk, sv)


def _layer_call(model, prefix_ids: torch.Tensor, B: int, L_s: int):
    """One eager decode attention layer call through the seam: layer 0's attention module over a ``RelayCache`` of
    ``prefix_ids`` forked for ``B`` rows holding ``L_s`` suffix positions (``[B, H_q, 1, D]`` queries)."""
    from relay_hf.attention import relay_attention_forward
    from relay_hf.cache import RelayCache

    c = model.config
    D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn = next(m for m in model.modules() if getattr(m, "layer_idx", None) == 0 and hasattr(m, "scaling"))
    make = lambda *shape: torch.randn(*shape, device=model.device, dtype=model.dtype)  # noqa: E731
    with torch.no_grad():
        fork = RelayCache.from_prefix(model, prefix_ids).fork(suffix_padding=torch.zeros(B, dtype=torch.int32))
        fork.update(make(B, c.num_key_value_heads, L_s - 1, D), make(B, c.num_key_value_heads, L_s - 1, D), 0)
        key, value = fork.update(make(B, c.num_key_value_heads, 1, D), make(B, c.num_key_value_heads, 1, D), 0)
    query = make(B, c.num_attention_heads, 1, D)
    return lambda: relay_attention_forward(attn, query, key, value, None, scaling=attn.scaling)


def _line(rows: list[dict]) -> dict:
    """The printed summary of one point, gpt-fast style."""
    get = {r["metric"]: r["median"] for r in rows}
    r0 = rows[0]
    step = next((r for r in rows if r["metric"] == "step"), rows[0])
    nan = float("nan")
    line = dict(mode=r0["mode"], S=r0["S"], B=r0["B"], groups=r0["groups"], step_ms=get.get("step", nan),
                streamed_step_ms=get.get("streamed_step", nan), tok_per_s=get.get("tok_per_s", nan),
                GBps=get.get("bandwidth", nan), sample_step_ms=get.get("sample_step", nan), ttft_s=get.get("ttft", nan),
                peak_GiB=get.get("peak_memory", float("nan")), kv_MiB=get.get("kv_memory", float("nan")),
                first_call_s=get["cold_first_call"],
                new_batch_s=get.get("new_batch_first_call", float("nan")),
                longer_prompt_s=get.get("longer_prompt_call", float("nan")), host_us=get.get("host", float("nan")),
                host_layer_us=get.get("host_layer", float("nan")),
                relay=step["relay_used"],
                loop=step["relay_loop"])
    say(f"{line['mode']} S={line['S']} B={line['B']} groups={line['groups']}: step {line['step_ms']:.2f} ms (streamed "
        f"{line['streamed_step_ms']:.2f} ms; {line['tok_per_s']:,.0f} tok/s, "
        f"{line['GBps']:,.0f} GB/s), sampling step {line['sample_step_ms']:.2f} ms, first token "
        f"{line['ttft_s']:.3f} s, peak {line['peak_GiB']:.2f} GiB, KV {line['kv_MiB']:.1f} MiB; first call "
        f"{line['first_call_s']:.2f} s, at a new batch size {line['new_batch_s']:.2f} s, with longer prompts "
        f"{line['longer_prompt_s']:.2f} s; eager attention host {line['host_us']:.1f} us (a layer call "
        f"{line['host_layer_us']:.1f} us); relay used: {line['relay']}, relay_hf loop: {line['loop']}")
    return line


def _raise_recompile_limit(points: int) -> None:
    """Every point is a new static shape for the compiled modes: let dynamo keep them all instead of falling back to
    eager after its default recompile limit and timing that."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 4 * points))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--prefix-len", type=int, nargs="+", default=[1024, 4096, 8192], help="S")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64], help="B")
    parser.add_argument("--groups", type=int, nargs="+", default=[1],
                        help="system prompts per batch (each of --prefix-len tokens, the rows split evenly)")
    parser.add_argument("--user-len", type=int, default=64, help="U: tokens of each row's own prompt")
    parser.add_argument("--modes", nargs="+", default=["prefix_reuse", "relay"], choices=MODES)
    parser.add_argument("--new-tokens", type=int, default=128, help="N: tokens of the long timed call")
    parser.add_argument("--short-tokens", type=int, default=None, help="M: tokens of the short call (N/4, >= 2)")
    parser.add_argument("--reps", type=int, default=3, help="timed call pairs per point")
    parser.add_argument("--new-batch", type=int, default=None, help="batch of the new-batch call (3/4 of B)")
    parser.add_argument("--no-sampling", action="store_true", help="skip the sampling calls")
    parser.add_argument("--only", nargs="+", default=list(METRIC_GROUPS), choices=METRIC_GROUPS,
                        help="what to measure besides the cold first call (default: everything)")
    parser.add_argument("--stock-prefill-chunk", type=int, default=None,
                        help="stock mode: transformers' chunked prefill (prefill_chunk_size), for batches whose "
                             "eager-attention prefill does not fit at once")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--note", default="", help="free text stored with every row")
    parser.add_argument("--csv", type=Path, default=DATA / "generate.csv", help="append the rows here")
    args = parser.parse_args(argv)
    N = args.new_tokens
    M = args.short_tokens or max(2, N // 4)
    if not 1 <= M < N:
        parser.error(f"need 1 <= --short-tokens < --new-tokens, got {M} and {N}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env = environment(device)
    print(f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}, triton {env['triton']}, "
          f"commit {env['commit']}")
    model = build_model(args.model_shape, device, getattr(torch, args.dtype),
                        max(args.prefix_len) + 2 * args.user_len + N + 256)
    grid = [(mode, S, B, g) for mode, S, B, g in itertools.product(args.modes, args.prefix_len, args.batch, args.groups)
            if g <= B and not (g > 1 and mode == "prefix_reuse")]
    _raise_recompile_limit(len(grid))
    lines = []
    for mode, S, B, groups in progress(grid, "generate"):
        new_batch = args.new_batch or (B * 3 // 4 if B >= 4 else B + 1)
        try:
            point = generate_point(model, mode, S, B, args.user_len, N, M, args.reps, max(new_batch, groups),
                                   sampling=not args.no_sampling, groups=groups, only=set(args.only),
                                   stock_prefill_chunk=args.stock_prefill_chunk)
        except torch.OutOfMemoryError:
            say(f"{mode} S={S} B={B} groups={groups}: out of memory")
            continue
        finally:
            relay_hf.unpatch(model)
        rows = [{**env, "model": args.model_shape, "dtype": args.dtype, **r,
                 "note": " ".join(filter(None, [args.note, r["note"]]))} for r in point]
        append_rows(args.csv, GENERATE_FIELDS, rows)  # after every point: a stopped run keeps what it measured
        lines.append(_line(point))
    if lines:
        print_table(lines, list(lines[0]))
    print(f"appended to {args.csv}")
    return lines


if __name__ == "__main__":
    main()
