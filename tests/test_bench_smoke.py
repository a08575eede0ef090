"""The CPU benchmark still runs: ``python -m benchmarks.bench_cpu --smoke`` exits 0 and prints its table.

Asserts nothing about speed (BENCHMARKING.md: benchmarks are never timed tests). The benchmarks are a
package run as modules; the repository root is put on PYTHONPATH, the cwd is a scratch directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A benchmark's smoke run: off in CI (its 10-minute budget), on with CPUCKPT_SLOW=1 — run them before a device
# call (README: "The two commands").
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return env


@pytest.mark.timeout(120)
def test_bench_cpu_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_cpu", "--smoke", "--quiet",
         "--shm-dir", str(tmp_path / "shm"), "--disk-dir", str(tmp_path / "disk"), "--json", str(out_json)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    assert "cpuckpt CPU benchmark" in out
    for needle in ("floor pwrite", "floor pread", "DCP FileSystemWriter thread_count=1", "cpuckpt default",
                   "DCP FileSystemReader", "cpuckpt verify=always", "cpuckpt verify=off",
                   "DCP planning only", "same shapes", "distinct shapes"):
        assert needle in out, f"{needle!r} missing from the table:\n{out}"
    assert "WRONG" not in out and "FAILURES" not in out, out
    results = json.loads(out_json.read_text())
    assert set(results["targets"]) == {"shm", "disk"}
    assert not results["failures"]
    # every run directory is removed afterwards
    leftovers = [p for d in ("shm", "disk") for p in (tmp_path / d).glob("cpuckpt-bench-*")]
    assert not leftovers, leftovers
