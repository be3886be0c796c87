"""The wheel and the sdist, built from this tree and installed into a fresh virtual environment."""

import re
import subprocess
import sys
import tarfile
import venv
import zipfile

import pytest

from tests.helpers import REPO

setuptools = pytest.importorskip("setuptools")


def _build(kind: str, out) -> str:
    """``build_wheel`` / ``build_sdist`` of setuptools' PEP 517 backend, run in the repository (no network)."""
    code = f"import setuptools.build_meta as b; print(b.build_{kind}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(tuple(int(p) for p in setuptools.__version__.split(".")[:2]) < (77, 0),
                    reason="SPDX license strings need setuptools >= 77")
def test_wheel_and_sdist_install_and_carry_what_they_should(tmp_path):
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    wheel = tmp_path / _build("wheel", tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "relay_hf/py.typed" in names and "relay_hf/policy.py" in names
    assert not any(n.startswith(("benchmarks/", "tests/")) for n in names)  # the library only
    assert any(n.endswith("licenses/LICENSE") for n in names)
    sdist = tarfile.open(tmp_path / _build("sdist", tmp_path))
    root = sdist.getnames()[0].split("/")[0]
    for path in ("LICENSE", "tests/helpers.py", "tests/conftest.py", "examples/system_prompt.md", "pyproject.toml"):
        assert f"{root}/{path}" in sdist.getnames(), path
    env = tmp_path / "venv"
    venv.create(env, system_site_packages=True, with_pip=True)  # torch and transformers come from this environment
    python = env / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    probe = "import relay_hf, pathlib; print(relay_hf.__version__, relay_hf.__file__)"
    installed, where = subprocess.run([python, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                                      check=True).stdout.split()
    assert installed == version and str(env) in where
