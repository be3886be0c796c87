"""``benchmarks/``: the CPU smoke runs of both benchmarks, the tuning variants, the CSV schema and the plot script."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks import common, generate, kernel, paged, plot


@pytest.fixture
def one_thread():
    """Tiny shapes on one thread: on a busy 2-core machine, OpenMP workers waiting for a core make each tiny op
    ~50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tune_variants_override_existing_kernel_config_fields():
    """``kernel --tune`` builds each variant with ``dataclasses.replace(DEFAULT_CONFIG, **overrides)``: a renamed
    field must fail here, not on the GPU, and a variant must not change a field's type."""
    from relay_hf.kernels.triton_relay import DEFAULT_CONFIG

    fields = {f.name for f in dataclasses.fields(DEFAULT_CONFIG)}
    for name, overrides in kernel.VARIANTS.items():
        assert set(overrides) <= fields, f"variant {name!r}: no config field {sorted(set(overrides) - fields)}"
        config = dataclasses.replace(DEFAULT_CONFIG, **overrides)
        for key, value in overrides.items():
            assert type(value) is type(getattr(DEFAULT_CONFIG, key)), f"variant {name!r}: {key} changes type"
            assert getattr(config, key) == value


def test_paged_tune_variants_override_existing_tiles_fields():
    """``paged --tune`` builds each variant with ``dataclasses.replace(paged.TILES, **overrides)``: a renamed
    ``Tiles`` field must fail here, not on the GPU."""
    _, paged_module = paged._modules()
    fields = {f.name for f in dataclasses.fields(paged_module.TILES)}
    for name, overrides in paged.VARIANTS.items():
        assert set(overrides) <= fields, f"variant {name!r}: no Tiles field {sorted(set(overrides) - fields)}"
        tiles = dataclasses.replace(paged_module.TILES, **overrides)
        assert all(getattr(tiles, key) == value for key, value in overrides.items())


def test_kernel_cpu_smoke_run_appends_exact_relay_rows(tmp_path, one_thread):
    """The kernel benchmark's CPU path on tiny shapes: every row in the schema, times for relay and SDPA, and relay's
    output equal to SDPA's over the expanded prefix (fp32)."""
    path = tmp_path / "kernel.csv"
    kernel.main(["--device", "cpu", "--dtype", "float32", "--heads", "4", "2", "--head-dim", "16", "--suffix-len",
                 "8", "--prefix-len", "64", "--batch", "1", "3", "--reps", "3", "--host-calls", "5", "--csv",
                 str(path)])
    rows = common.read_rows(path)
    assert list(rows[0]) == common.KERNEL_FIELDS
    assert {(r["S"], r["B"]) for r in rows} == {("64", "1"), ("64", "3")}
    got = {(r["B"], r["provider"], r["metric"]): float(r["median"]) for r in rows}
    for B in ("1", "3"):
        for provider in ("relay", "sdpa"):
            for metric in ("time", "host"):
                assert got[(B, provider, metric)] > 0
        assert got[(B, "relay", "bandwidth")] > 0
        assert got[(B, "relay", "relerr")] < 1e-5
    assert all(r["commit"] and r["torch"] and r["timestamp"] and r["device"].startswith("cpu") for r in rows)


def test_paged_cpu_smoke_run_times_every_provider_and_the_kernel_is_exact(tmp_path, one_thread):
    """The paged kernel benchmark on tiny shapes (Triton's interpreter): rows in the kernel schema, a time for the
    shared, first-layer and unshared calls, and the kernel equal to its PyTorch path."""
    path = tmp_path / "kernel.csv"
    paged.main(["--device", "cpu", "--dtype", "float32", "--heads", "4", "2", "--head-dim", "16", "--prefix-len",
                "32", "--own-len", "8", "--requests", "3", "--groups", "1", "2", "--page-size", "16", "--reps", "1",
                "--csv", str(path)])
    rows = common.read_rows(path)
    assert list(rows[0]) == common.KERNEL_FIELDS
    got = {(r["groups"], r["provider"], r["metric"]): float(r["median"]) for r in rows}
    for groups in ("1", "2"):
        for provider in ("paged", "paged_first", "paged_unshared"):
            assert got[(groups, provider, "time")] > 0
        assert got[(groups, "paged", "relerr")] < 1e-5


def test_paged_inputs_share_pages_only_when_asked_and_hold_the_same_keys():
    q, kc, vc, k, v, table, seqlens = paged.paged_inputs(4, 32, 8, 2, 4, 2, 16, 16, torch.float32, torch.device("cpu"))
    copy = paged.paged_inputs(4, 32, 8, 2, 4, 2, 16, 16, torch.float32, torch.device("cpu"), shared=False)
    assert torch.equal(table[0, :2], table[1, :2]) and not torch.equal(table[1, :2], table[2, :2])
    assert len(set(copy[5][:, :2].flatten().tolist())) == 8
    assert torch.equal(kc[table[:, :2].long()], copy[1][copy[5][:, :2].long()])
    assert seqlens.tolist() == [40] * 4
    with pytest.raises(ValueError, match="whole pages"):
        paged.paged_inputs(4, 30, 8, 1, 4, 2, 16, 16, torch.float32, torch.device("cpu"))


def test_generate_cpu_smoke_run_measures_every_column(tmp_path, one_thread):
    """The generate benchmark's CPU path on a tiny random model: for every mode the cold first call, first token,
    greedy and sampling steps, the new-batch and longer-prompt first calls, and relay used exactly by the relay modes
    (off CUDA the static and graph ones on relay_hf's loop, greedy and sampling; the others on transformers' loop)."""
    path = tmp_path / "generate.csv"
    generate.main(["--model-shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prefix-len", "32", "--batch",
                   "2", "--new-tokens", "3", "--reps", "1", "--modes", *generate.MODES, "--csv", str(path)])
    rows = common.read_rows(path)
    assert list(rows[0]) == common.GENERATE_FIELDS
    expected = {"cold_first_call", "ttft", "step", "tok_per_s", "bandwidth", "sample_first_call", "sample_step",
                "new_batch_first_call", "longer_prompt_call", "streamed_step", "kv_memory"}
    for mode in generate.MODES:
        got = {r["metric"]: r for r in rows if r["mode"] == mode}
        relay = mode.startswith("relay")  # relay modes also time patch, and the first token with a new prompt
        assert set(got) == expected | {"ttft_one_row"} | ({"ttft_new_prompt", "patch"} if relay else set()), mode
        step = float(got["step"]["median"])  # a difference of two wall times: on tiny shapes it can be <= 0
        for metric, r in got.items():
            if metric != "tok_per_s" or step > 0:
                assert math.isfinite(float(r["median"])), (mode, metric)
        if step > 0:
            assert float(got["tok_per_s"]["median"]) == pytest.approx(2 / step * 1e3, rel=1e-4)
        assert got["step"]["relay_used"] == str(relay) and got["sample_step"]["relay_used"] == str(relay)
        on_loop = mode in ("relay_compiled", "relay_graph")
        assert got["step"]["relay_loop"] == got["sample_step"]["relay_loop"] == str(on_loop)
        assert got["new_batch_first_call"]["note"] == "B=3" and got["longer_prompt_call"]["note"] == "U=128"
    assert {r["new_tokens"] for r in rows} == {"3"}


def test_generate_groups_sweep_measures_what_is_asked_and_relay_holds_less_kv(tmp_path, one_thread):
    """``--groups``: system prompts per batch (prefix reuse has no way to give rows different ones: skipped);
    ``--only``: just those metrics; relay holds each prompt once."""
    path = tmp_path / "generate.csv"
    generate.main(["--model-shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prefix-len", "32", "--batch",
                   "4", "--groups", "1", "2", "--user-len", "8", "--new-tokens", "3", "--reps", "1", "--modes",
                   "stock", "relay", "prefix_reuse", "--only", "step", "kv_memory", "--csv", str(path)])
    rows = common.read_rows(path)
    points = {(r["mode"], r["groups"]) for r in rows}
    assert points == {("stock", "1"), ("stock", "2"), ("relay", "1"), ("relay", "2"), ("prefix_reuse", "1")}
    assert {r["metric"] for r in rows} == {"patch", "cold_first_call", "step", "tok_per_s", "bandwidth", "kv_memory"}
    assert {r["mode"] for r in rows if r["metric"] == "patch"} == {"relay"}
    kv = {(r["mode"], r["groups"]): float(r["median"]) for r in rows if r["metric"] == "kv_memory"}
    assert kv[("relay", "2")] < kv[("stock", "2")] and kv[("relay", "1")] < kv[("relay", "2")]
    assert all(r["relay_used"] == str(r["mode"] == "relay") for r in rows if r["metric"] != "patch")


def test_append_rows_keeps_one_schema_per_file(tmp_path):
    path = tmp_path / "x.csv"
    common.append_rows(path, ["a", "b"], [dict(a=1, b=2.5)])
    common.append_rows(path, ["a", "b"], [dict(a=3, b=float("nan"))])
    assert common.read_rows(path) == [dict(a="1", b="2.5"), dict(a="3", b="")]
    with pytest.raises(ValueError, match="columns"):
        common.append_rows(path, ["a", "c"], [dict(a=1)])
    with pytest.raises(ValueError, match="not in the schema"):
        common.append_rows(path, ["a", "b"], [dict(a=1, d=2)])


def test_summary_gives_median_and_20_80_percentiles():
    s = common.summary([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median"], s["n"], s["spread_of"]) == (3.0, 5, "reps")
    assert 1.0 < s["lo"] < s["median"] < s["hi"] < 5.0


@pytest.mark.parametrize("name, fields", [("kernel.csv", common.KERNEL_FIELDS),
                                          ("generate.csv", common.GENERATE_FIELDS)])
def test_published_data_follows_the_schema(name, fields):
    """benchmarks/data/*.csv: the schema's header, a number in every median, one unit per metric."""
    rows = common.read_rows(common.DATA / name)
    assert rows and list(rows[0]) == fields
    units = {}
    for r in rows:
        float(r["median"])
        units.setdefault(r["metric"], set()).add(r["unit"])
        assert r["spread_of"] in ("", "reps", "runs")
    assert all(len(u) == 1 for u in units.values()), units


def test_plot_draws_both_figures_from_the_published_data(tmp_path):
    written = plot.main(["--out", str(tmp_path)])
    assert sorted(p.name for p in written) == ["generate.png", "groups.png", "kernel.png"]
    assert all(p.stat().st_size > 10_000 for p in written)
    points = plot.kernel_points(common.read_rows(common.DATA / "kernel.csv"))
    assert all(p["speedup"] == p["sdpa_us"] / p["relay_us"] for p in points)


def test_kept_check_cpu_smoke_run_prints_the_call_and_the_check(capsys, one_thread):
    from benchmarks import kept_check

    kept_check.main(["--model-shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prefix-len", "32",
                     "--batch", "2", "--user-len", "4", "--new-tokens", "3", "--reps", "1"])
    out = capsys.readouterr().out
    assert "generate under the kept prompt:" in out and "% of the call)" in out and "the structure" in out


def test_the_host_layer_call_is_the_seam_s_relay_attention(one_thread):
    """``host_layer`` times layer 0's attention through the seam on a forked ``RelayCache``: relay attention over the
    stored prefix and the rows' suffix (here on the CPU, the reference; on CUDA the step's plan)."""
    import relay_hf
    from tests.helpers import tiny_model

    model = relay_hf.patch(tiny_model("llama"), min_prefix_length=8)
    out, weights = generate._layer_call(model, torch.arange(10, 30), 3, 5)()
    c = model.config
    assert out.shape == (3, 1, c.num_attention_heads, c.head_dim) and weights is None and torch.isfinite(out).all()


def test_serve_cpu_smoke_run_measures_every_mode(tmp_path, one_thread):
    """The serving benchmark's CPU path on a tiny random model: offline (kept managers) and online rows for stock
    continuous batching, the patched model and relay's flash kernel by its id, each mode's tokens served."""
    from benchmarks import serve
    from relay_hf import _compat

    modes = ["stock_cb", "relay_cb"] + (["flash_cb"] if _compat.kernels_available() else [])
    path = tmp_path / "serve.csv"
    serve.main(["--model-shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "4", "--prefix-len",
                "32", "--new-tokens", "4", "--page-size", "8", "--num-blocks", "64", "--max-batch-tokens", "64",
                "--rates", "4", "--persistent", "--modes", *modes, "--csv", str(path)])
    rows = common.read_rows(path)
    assert list(rows[0]) == common.SERVE_FIELDS
    got = {(r["mode"], r["arrival"], r["metric"]): r for r in rows}
    for mode in modes:
        for arrival in ("offline persistent", "poisson 4/s"):
            assert float(got[(mode, arrival, "throughput")]["median"]) > 0
        assert float(got[(mode, "offline persistent", "first_call")]["median"]) > 0
        assert got[(mode, "offline persistent", "throughput")]["relay_used"] == str(mode != "stock_cb")


def test_serve_measures_relay_generates_step_and_takes_other_batching_options(tmp_path, one_thread):
    """``relay_generate``'s decode step beside continuous batching's time per token; a ``--cb-option`` reaches
    transformers' config and the rows name it, as they name ``--gc-freeze``; a field transformers lacks is refused
    before any model is built."""
    import gc

    from benchmarks import serve

    path = tmp_path / "serve.csv"
    try:
        serve.main(["--model-shape", "tiny", "--device", "cpu", "--dtype", "float32", "--requests", "4",
                    "--prefix-len", "32", "--new-tokens", "4", "--num-blocks", "64", "--max-batch-tokens", "64",
                    "--fixed-batch", "4", "--modes", "relay_cb", "relay_generate", "--cb-option",
                    "use_async_batching=False", "--gc-freeze", "--csv", str(path)])
    finally:
        gc.unfreeze()
    got = {(r["mode"], r["metric"]): r for r in common.read_rows(path)}
    assert float(got[("relay_generate", "step")]["median"]) > 0 and ("relay_cb", "step") not in got
    assert float(got[("relay_cb", "tpot_p50")]["median"]) > 0
    assert {r["note"] for r in got.values()} == {"cb:use_async_batching=False gc-freeze"}
    def config(*options):
        return serve.cb_config(SimpleNamespace(page_size=None, max_batch_tokens=None, num_blocks=None,
                                               cb_option=list(options)))

    assert config("use_async_batching=False").use_async_batching is False
    assert config("scheduler_type=prefill_first").scheduler_type == "prefill_first"  # a bare word: a string
    tiny = ["--model-shape", "tiny", "--device", "cpu", "--csv", str(tmp_path / "never.csv")]
    with pytest.raises(ValueError, match="no field 'no_such_field'"):
        serve.main(["--cb-option", "no_such_field=1", *tiny])
    with pytest.raises(ValueError, match="expected FIELD=VALUE"):
        serve.main(["--cb-option", "use_async_batching", *tiny])
    assert not (tmp_path / "never.csv").exists()


def test_profile_cpu_smoke_run_profiles_every_call_and_the_batching_thread(capsys, one_thread):
    """The profile benchmark on a tiny random model: each call timed, its host profile printed, and for continuous
    batching the profile reaches into the manager's thread (where the steps run), not only the caller's wait."""
    from benchmarks import profile

    walls = profile.main(["--model-shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prefix-len", "32",
                          "--batch", "2", "--user-len", "4", "--new-tokens", "3", "--step-tokens", "3",
                          "--requests", "3", "--num-blocks", "64", "--max-batch-tokens", "64", "--reps", "1",
                          "--top", "400", "--calls", *profile.CALLS])
    assert set(walls) == set(profile.CALLS) and all(w > 0 for w in walls.values())
    out = capsys.readouterr().out
    assert out.count("function calls") == len(profile.CALLS)  # one host profile per call
    assert "relay_generate" in out  # the patched generate, inside the generate calls' profiles
    assert "probe_reason" in out.split("=== relay_hf.patch")[1].split("===")[0]  # patch's own profile holds its probe
    assert "_generation_step" in out.split("generate_batch, 3 requests")[1]  # the manager thread's steps
