"""What both benchmarks share: the CSV schema and its append-only writer, the run's environment, timers, output.

Every benchmark result is one CSV row: who measured (commit, library versions, device, time), the shape of the
point, what was measured (``provider`` or ``mode``, ``metric``, ``unit``) and its value (``median``) with its spread
(``lo``, ``hi`` over ``n`` samples; ``spread_of`` says which samples). benchmarks/README.md documents the columns.
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "benchmarks" / "data"

# columns every row starts with: who measured, on what
RUN_FIELDS = ["timestamp", "commit", "torch", "transformers", "triton", "device"]
# columns every row ends with: the value and its spread
VALUE_FIELDS = ["median", "lo", "hi", "n", "spread_of"]
KERNEL_FIELDS = [*RUN_FIELDS, "dtype", "H_q", "H_kv", "D", "L_s", "S", "B", "groups", "provider", "metric", "unit",
                 *VALUE_FIELDS, "note"]
GENERATE_FIELDS = [*RUN_FIELDS, "model", "dtype", "S", "U", "B", "groups", "new_tokens", "mode", "metric", "unit",
                   *VALUE_FIELDS, "relay_used", "relay_loop", "note"]
SERVE_FIELDS = [*RUN_FIELDS, "model", "dtype", "S", "U", "R", "groups", "new_tokens", "mode", "arrival", "metric",
                "unit", *VALUE_FIELDS, "relay_used", "note"]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _commit() -> str:
    """Short commit of the checkout, ``+dirty`` when relay_hf/ or benchmarks/ differ from it; ``unknown`` outside
    git (``RELAY_HF_COMMIT`` overrides both)."""
    if os.environ.get("RELAY_HF_COMMIT"):
        return os.environ["RELAY_HF_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "relay_hf", "benchmarks"], cwd=REPO,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {os.cpu_count()} threads)"


def environment(device: torch.device) -> dict:
    """The ``RUN_FIELDS`` of this run."""
    return dict(timestamp=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                commit=_commit(), torch=torch.__version__, transformers=_version("transformers"),
                triton=_version("triton"), device=device_name(device))


def summary(samples: Iterable[float]) -> dict:
    """``median``, ``lo`` / ``hi`` (20th / 80th percentile) and ``n`` of one process's timed repetitions."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("no samples")
    if len(xs) == 1:
        return dict(median=xs[0], lo=xs[0], hi=xs[0], n=1, spread_of="reps")
    lo, hi = (statistics.quantiles(xs, n=10, method="inclusive")[i] for i in (1, 7))
    return dict(median=statistics.median(xs), lo=lo, hi=hi, n=len(xs), spread_of="reps")


def scaled(values: dict, factor: float) -> dict:
    """``summary`` values times ``factor`` (a unit change); a negative factor would swap lo and hi, so none."""
    assert factor > 0
    return {k: (v * factor if k in ("median", "lo", "hi") else v) for k, v in values.items()}


def append_rows(path: Path, fields: list[str], rows: list[dict]) -> None:
    """Append ``rows`` to the CSV at ``path`` (created with a header if missing). The file is append-only: a header
    that differs from ``fields`` raises ``ValueError`` instead of mixing two schemas in one file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        if set(row) - set(fields):
            raise ValueError(f"{path}: columns {sorted(set(row) - set(fields))} are not in the schema")
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if header != fields:
            raise ValueError(f"{path} has columns {header}, this benchmark writes {fields}: use another --csv")
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerows({k: _cell(row.get(k, "")) for k in fields} for row in rows)


def _cell(value):
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_s(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def device_us(fn: Callable[[], object], device: torch.device, reps: int = 10) -> list[float]:
    """Microseconds per call of ``fn``. CUDA: ``triton.testing.do_bench_cudagraph`` (calls unrolled into one CUDA
    graph, so no launch gaps; 10 replays of that graph), elsewhere the wall time of ``reps`` synchronous calls."""
    if device.type == "cuda":
        import triton.testing

        return [ms * 1e3 for ms in triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="all")]
    fn()  # warm-up
    return [wall_s(fn, device) * 1e6 for _ in range(reps)]


def host_us(fn: Callable[[], object], device: torch.device, calls: int = 300, reps: int = 5) -> list[float]:
    """Host microseconds per eager call: ``calls`` calls back to back under a host timer, with no synchronisation
    between them (what launching costs the Python thread), ``reps`` times."""
    fn()
    sync(device)
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls * 1e6)
        sync(device)
    return out


def peak_extra_mib(fn: Callable[[], object], device: torch.device) -> float:
    """MiB that one call of ``fn`` allocates at its peak beyond what was allocated before it (CUDA; NaN elsewhere)."""
    if device.type != "cuda":
        return float("nan")
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    sync(device)
    del out
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A plain text table of ``columns`` (missing cells blank)."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def sweep(grid, measure: Callable[..., list[dict]], line: Callable[[list[dict]], dict], desc: str, env: dict,
          path: Path, fields: list[str], first_rows: list[dict] = ()) -> list[dict]:
    """Measure each point of ``grid`` (``measure(*point)``: its rows), print one ``line(rows)`` per point and then the
    table of them, and append ``first_rows`` and the points' rows, with the run's ``env``, to ``path``."""
    rows, lines = list(first_rows), []
    for point in progress(grid, desc):
        got = measure(*point)
        rows += got
        lines.append(line(got))
    print_table(lines, list(lines[0]))
    append_rows(path, fields, [dict(env, **r) for r in rows])
    print(f"appended {len(rows)} rows to {path}")
    return rows


def progress(items, desc: str):
    """``tqdm`` over ``items`` (benchmarks depend on it through the ``bench`` extra)."""
    from tqdm import tqdm

    return tqdm(items, desc=desc)


def say(line: str) -> None:
    """Print a line without breaking a progress bar that is being drawn."""
    from tqdm import tqdm

    tqdm.write(line)
