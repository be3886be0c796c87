"""``relay_hf.bench``: the parts that run without a GPU."""

from relay_hf import bench
from relay_hf.kernels import triton_relay


def test_tune_variants_only_name_kernel_settings_that_exist():
    """``bench kernel --tune`` sets these on ``triton_relay``; a renamed setting would silently tune nothing."""
    for name, variant in bench.VARIANTS.items():
        for key, value in variant.items():
            assert hasattr(triton_relay, key), f"variant {name!r}: triton_relay has no {key}"
            assert type(value) is type(getattr(triton_relay, key)), f"variant {name!r}: {key} changes type"
