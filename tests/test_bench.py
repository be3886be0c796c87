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
