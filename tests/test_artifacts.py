"""The compiled decode step's artifacts kept across processes (relay_hf/artifacts.py): where they live, what keys
them, and that reading or writing them never fails a call."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from relay_hf import artifacts
from tests.helpers import REPO, tiny_model


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAY_HF_CACHE_DIR", str(tmp_path / "explicit"))
    assert artifacts.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("RELAY_HF_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert artifacts.cache_dir() == tmp_path / "xdg" / "relay_hf"


def test_the_key_is_the_model_shape_dtype_and_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAY_HF_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    path = artifacts.artifact_path(model, "regional a")
    assert path.parent == tmp_path / "compiled" and path == artifacts.artifact_path(tiny_model("llama"), "regional a")
    assert path != artifacts.artifact_path(model, "regional b")
    assert path != artifacts.artifact_path(tiny_model("llama", num_hidden_layers=3), "regional a")
    assert path != artifacts.artifact_path(tiny_model("llama").to(torch.bfloat16), "regional a")


def test_a_missing_or_damaged_file_is_ignored(tmp_path):
    assert not artifacts.load(tmp_path / "missing.bin")
    damaged = tmp_path / "damaged.bin"
    damaged.write_bytes(b"not torch's cache artifacts")
    assert not artifacts.load(damaged)
    assert not artifacts.load(damaged)  # tried once per process


def test_a_file_that_cannot_be_written_fails_nothing(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    artifacts.save(blocker / "compiled" / "x.bin")  # its directory cannot be made: logged, not raised
    assert not (blocker / "compiled").exists()


@pytest.mark.long  # two inductor compiles on CPU (~35 s on 2 cores)
def test_what_one_process_compiles_another_loads(tmp_path):
    """A process that compiled with inductor writes the file; a second process loads it before compiling."""
    script = textwrap.dedent(f"""
        import sys, torch
        from pathlib import Path
        from relay_hf import artifacts
        path = Path({str(tmp_path / "step.bin")!r})
        loaded = artifacts.load(path)
        f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
        f(torch.randn(8))
        artifacts.save(path)
        print("loaded" if loaded else "compiled", path.exists() and path.stat().st_size > 0)
    """)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(REPO)}

    def run() -> str:
        import os

        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                              env={**os.environ, **env}, cwd=REPO)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()[-2:]

    assert run() == ["compiled", "True"]
    assert run() == ["loaded", "True"]


def test_a_config_that_does_not_serialise_keeps_nothing_and_fails_nothing():
    model = tiny_model("llama")
    model.config.tags_as_a_set = {"a", "b"}  # json cannot write a set
    assert artifacts.artifact_path(model, "regional") is None


def test_without_a_home_directory_the_cache_is_under_the_temp_directory(monkeypatch):
    import tempfile

    monkeypatch.delenv("RELAY_HF_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr("os.path.expanduser", lambda path: path)  # what it returns with no home to expand to
    assert artifacts.cache_dir().is_relative_to(tempfile.gettempdir())


def test_a_regional_step_loads_its_prefills_file_and_a_compiled_prefill_writes_it(monkeypatch, tmp_path):
    """A step compiled by regions with inductor loads its own file and its compiled prefills' before anything
    compiles; a prefill recorded through its layer writes the second (the first is written once per process, before
    any prefill compiles). A step compiled whole keeps no prefill file: its prefills run the model's forward."""
    from transformers import CompileConfig

    import relay_hf
    from relay_hf.regional import decoder_layers
    from relay_hf.state import relay_state
    from relay_hf.step import DEFAULT_DECODE, DecodeStep
    from tests.helpers import shared_prefix_batch

    monkeypatch.setenv("RELAY_HF_CACHE_DIR", str(tmp_path))
    loaded, saved = [], []
    monkeypatch.setattr(artifacts, "load", lambda path: loaded.append(path) or False)
    monkeypatch.setattr(artifacts, "save", saved.append)
    model = relay_hf.patch(tiny_model("llama"), min_prefix_length=8, decode="graph")
    ids, mask, _ = shared_prefix_batch(suffix_lens=(3, 9), seed=75)
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    cache = relay_state(model).idle_static().cache
    step = DecodeStep(model, cache, 2, CompileConfig(), ("key",), DEFAULT_DECODE, decoder_layers(model))
    assert step.prefill_artifacts.parent == step.artifacts.parent == tmp_path / "compiled"
    assert step.prefill_artifacts != step.artifacts and loaded == [step.artifacts, step.prefill_artifacts]
    assert step.prefill_runner is None  # off CUDA the step is never captured: its prefills stay the model's
    step.keep_prefill_compiled()
    assert saved == [step.prefill_artifacts]
    whole = DecodeStep(model, cache, 2, CompileConfig(), ("key",), DEFAULT_DECODE, None)
    assert whole.artifacts is not None and whole.prefill_artifacts is None
    whole.keep_prefill_compiled()
    assert saved == [step.prefill_artifacts]
