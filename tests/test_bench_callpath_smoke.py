"""The call-path benchmark still runs: ``python -m benchmarks.bench_callpath --smoke`` exits 0 and prints its table.

Asserts nothing about speed (BENCHMARKING.md: benchmarks are never timed tests), only that every variant
ran on the path it claims to measure. The repository root is put on PYTHONPATH, the cwd is a scratch directory.
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


@pytest.mark.timeout(120)
def test_bench_callpath_smoke(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_callpath", "--smoke", "--dir", str(tmp_path), "--out",
         str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "cpuckpt save call path" in proc.stdout, proc.stdout
    summary = json.loads((tmp_path / "out" / "bench_callpath.json").read_text())["summary"]
    assert {k: v["paths"] for k, v in summary.items()} == {
        "pool, cached": ["reused/cached"], "pool, plan reuse": ["reused/planner"],
        "images, cached": ["reused/cached"], "images, plan reuse": ["reused/planner"]}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("cpuckpt-bench-")] == []  # cleaned up
