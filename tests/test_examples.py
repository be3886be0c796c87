"""The example scripts and the docs' examples: what they report, and that they show progress."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from examples.chat_batch import savings
from tests.helpers import REPO
from tests.test_docs import BLOCKS

EXAMPLES = sorted((REPO / "examples").glob("*.py"))


def _generate_batch_calls() -> list[tuple[str, ast.Call]]:
    """Every ``<something>.generate_batch(...)`` call of the docs' Python blocks and of the example scripts."""
    sources = [(f"{page.relative_to(REPO)}:{line}", code) for page, line, code in BLOCKS]
    sources += [(str(path.relative_to(REPO)), path.read_text()) for path in EXAMPLES]
    return [(where, node) for where, code in sources for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "generate_batch"]


def test_every_generate_batch_example_shows_progress():
    """``generate_batch`` prints nothing until every request has finished: an example shows its bar of finished
    requests (``progress_bar=True``, on transformers 5.17 and newer) so a reader sees it working."""
    calls = _generate_batch_calls()
    assert calls, "no example calls generate_batch"
    silent = [where for where, call in calls
              if not any(k.arg == "progress_bar" and isinstance(k.value, ast.Constant) and k.value.value is True
                         for k in call.keywords)]
    assert not silent, f"generate_batch without progress_bar=True: {silent}"


def test_savings_lines_say_stock_relay_and_the_ratio():
    lines = savings((300 * 2**20, 75 * 2**20), (120.0, 60.0), (90.0, 30.0), kv_what="kv-what", wall_what="wall-what")
    assert len(lines) == 3
    kv, wall, cpu = lines
    assert re.search(r"^KV memory +stock +300\.0 MiB +relay +75\.0 MiB \(4\.0x less; kv-what\)$", kv), kv
    assert re.search(r"^wall time +stock +120\.00 s +relay +60\.00 s +\(2\.00x\) wall-what$", wall), wall
    assert re.search(r"^CPU time +stock +90\.00 s +relay +30\.00 s +\(3\.00x\) ", cpu), cpu


@pytest.mark.slow
@pytest.mark.long  # loads the embedded model in a fresh process and runs the job twice (plain transformers, relay)
def test_dataset_job_says_what_relay_saved_against_plain_transformers():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "examples/dataset_job.py", "--questions", "3", "--batch-size", "2",
                           "--max-new-tokens", "6", "--device", "cpu"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert out.count("Q: ") == 3 and out.count("A: ") == 3, out
    assert "relay used: True (relay)" in out and "3 questions in 2 batches of up to 2" in out, out
    # the second batch reads the system prompt the first one prefilled
    assert re.search(r"system prompt prefilled once: 1 later batches read it from the kept prefixes \([1-9]\d* ",
                     out), out
    kv = re.search(r"^KV memory +stock +([\d.]+) MiB +relay +([\d.]+) MiB \(", out, re.M)
    assert kv and float(kv[2]) < float(kv[1]), out  # the prefix once per batch instead of once per row
    assert re.search(r"^wall time +stock +[\d.]+ s +relay +[\d.]+ s +\([\d.]+x\) the whole job", out, re.M), out
    assert re.search(r"^CPU time +stock +[\d.]+ s +relay +[\d.]+ s +\([\d.]+x\)", out, re.M), out
    assert "answers identical to plain transformers': True" in out, out
    for bar in ("plain transformers", "relay"):  # tqdm's bars, on stderr: both runs reach their last question
        assert re.search(rf"{bar}: 100%\|[^\n\r]*\| 3/3 ", done.stderr), done.stderr[-4000:]
