"""``relay_hf.bench``: the parts that run without a GPU."""

from relay_hf import bench
from relay_hf.kernels import triton_relay


def test_tune_variants_only_name_kernel_settings_that_exist():
    """``bench kernel --tune`` sets these on ``triton_relay``; a renamed setting would silently tune nothing."""
    for name, variant in bench.VARIANTS.items():
        for key, value in variant.items():
            assert hasattr(triton_relay, key), f"variant {name!r}: triton_relay has no {key}"
            assert type(value) is type(getattr(triton_relay, key)), f"variant {name!r}: {key} changes type"


def test_generate_cli_writes_every_point(tmp_path):
    """``python -m relay_hf.bench generate`` end to end on the CPU (SmolLM2's shape, random init, tiny workload): one
    CSV row per (mode, S, B) point with finite times, relay really used for the relay mode, and the plot."""
    import csv
    import math

    bench.main(["generate", "--model-shape", "smollm2-135m", "--prefix-len", "32", "--batch", "2", "--modes", "stock",
                "relay", "--new-tokens", "3", "--reps", "1", "--device", "cpu", "--dtype", "float32",
                "--out", str(tmp_path)])
    with open(tmp_path / "generate_smollm2-135m_stock_relay.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["S"], r["B"]) for r in rows] == [("stock", "32", "2"), ("relay", "32", "2")]
    assert all(math.isfinite(float(r["step_ms"])) and float(r["step_ms"]) > 0 for r in rows)
    assert [r["relay_used"] for r in rows] == ["False", "True"]
    assert (tmp_path / "generate_smollm2-135m_stock_relay.png").stat().st_size > 0


def test_generate_step_clock_marks_every_token_on_both_loops():
    """The per-step decode time is the median of times between marks: one mark per generated token, from
    transformers' loop (a stopping criterion) and from relay_hf's loop (``decode.STEP_HOOK``) alike, and the stopping
    criterion must not push a relay call off relay_hf's loop."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import relay_hf
    from relay_hf import bench_generate, decode

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, pad_token_id=0, eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    ids = torch.cat([torch.randint(3, 100, (1, 20)).expand(3, -1), torch.randint(3, 100, (3, 5))], 1)
    cases = (False, {}, False), (True, {}, False), (True, {"cache_implementation": "static"}, True)
    for patched, kwargs, fast in cases:
        relay_hf.unpatch(model)
        if patched:
            relay_hf.patch(model, min_prefix_length=1)
        with torch.no_grad():
            make_kwargs = dict(kwargs).copy
            bench_generate._timed_generate(model, ids, 1, make_kwargs)  # the call before picks the hook
            clock = bench_generate._StepClock(cuda=False)
            bench_generate._timed_generate(model, ids, 6, make_kwargs, clock)
        assert bool(getattr(model, "relay_last_decision", None) and model.relay_last_decision.fast_decode) is fast
        assert len(clock.marks) == 6 and all(t > 0 for t in clock.steps_s())
        assert decode.STEP_HOOK is None
