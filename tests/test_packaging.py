"""The wheel and the sdist, built from this tree and installed into a fresh virtual environment."""

import os
import re
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO


def _require_setuptools_77():
    """Building needs setuptools' PEP 517 backend at >= 77 (SPDX license strings); the test extra requires it. Where
    it is missing (tests run outside that extra) the test is skipped, except under CI, where a skip would let a broken
    package land unnoticed."""
    try:
        import setuptools

        found = setuptools.__version__
    except ImportError:
        found = None
    if found is not None and tuple(int(p) for p in re.findall(r"\d+", found)[:2]) >= (77, 0):
        return
    reason = f"building the wheel needs setuptools >= 77 (SPDX license strings); found {found or 'none'}"
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{reason}; the test extra installs it", pytrace=False)
    pytest.skip(reason)


def _build(kind: str, out) -> str:
    """``build_wheel`` / ``build_sdist`` of setuptools' PEP 517 backend, run in the repository (no network)."""
    code = f"import setuptools.build_meta as b; print(b.build_{kind}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def _running_environment_paths() -> list[str]:
    """Where this interpreter finds torch and transformers (a venv's site-packages, a user site, PYTHONPATH), but not
    the repository itself, whose relay_hf would stand in for the installed one. A venv made with
    ``system_site_packages=True`` would see the base interpreter's packages instead, not those of the venv the tests
    run in."""
    paths = []
    for entry in sys.path:
        path = Path(entry or ".").resolve()
        if path.is_dir() and path != REPO and REPO not in path.parents and str(path) not in paths:
            paths.append(str(path))
    return paths


def test_wheel_and_sdist_install_and_carry_what_they_should(tmp_path):
    _require_setuptools_77()
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    wheel = tmp_path / _build("wheel", tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "relay_hf/py.typed" in names and "relay_hf/policy.py" in names
    kernel = "relay_hf/flash_kernel/build/torch-universal/"
    assert {kernel + "metadata.json", kernel + "relay_flash3/__init__.py", kernel + "relay_flash3/paged.py"} <= set(
        names)
    assert not any(n.startswith(("benchmarks/", "tests/")) for n in names)  # the library only
    assert any(n.endswith("licenses/LICENSE") for n in names)
    sdist = tarfile.open(tmp_path / _build("sdist", tmp_path))
    root = sdist.getnames()[0].split("/")[0]
    for path in ("LICENSE", "tests/helpers.py", "tests/conftest.py", "examples/system_prompt.md", "pyproject.toml"):
        assert f"{root}/{path}" in sdist.getnames(), path
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # Plain path lines: appended after the venv's own site-packages, so the installed wheel is found first; the
    # running environment's own .pth files (an editable install's finder among them) are not run.
    (Path(site) / "running_environment.pth").write_text("\n".join(_running_environment_paths()) + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # the flash kernel loads from the installed files (transformers finds it there by its id, LOCAL_KERNELS)
    probe = ("import relay_hf, relay_hf.flash as f; assert callable(f.load_kernel().flash_attn_with_kvcache); "
             "print(relay_hf.__version__, relay_hf.__file__)")
    done = subprocess.run([python, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # e.g. torch or transformers not found from the venv
    installed, where = done.stdout.split()
    assert installed == version and Path(where).resolve().is_relative_to(Path(site).resolve())
