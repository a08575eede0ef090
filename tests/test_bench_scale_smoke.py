"""The scale benchmark still runs: ``python -m benchmarks.bench_scale --smoke`` (world sizes 1 and 2) exits 0.

Asserts nothing about speed (benchmarks are never timed tests): the table is printed, the JSON holds both world
sizes, the counted collectives are the same on every rank, a warm ``async_save`` reused its plan, every
checkpoint has one data file per rank plus ``.metadata`` and the manifest, and the scratch directory is gone.
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
def test_bench_scale_smoke(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_scale", "--smoke", "--dir", str(tmp_path), "--out",
         str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "cpuckpt scale" in proc.stdout, proc.stdout
    results = json.loads((tmp_path / "out" / "bench_scale.json").read_text())["results"]
    assert [r["world"] for r in results] == [1, 2]
    for r in results:
        w = r["world"]
        for kind in ("async_first", "async_warm", "sync", "tier_warm", "load"):
            assert r[kind]["collectives"] >= 1, (w, kind, r[kind])
            assert r[kind]["collectives_min_rank"] == r[kind]["collectives_max_rank"], (w, kind, r[kind])
        assert r["async_planned"][0] == "dcp" and set(r["async_planned"][1:]) == {"reused"}, r["async_planned"]
        assert r["async_warm"]["collectives"] < r["async_first"]["collectives"]
        for where in ("async", "sync", "tier"):
            sizes = r["sizes"][where]
            assert sizes["files"] == w + 2, (w, where, sizes)
            assert sizes["metadata_bytes"] > 0 and sizes["manifest_bytes"] > 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("cpuckpt-bench-scale-")] == []  # cleaned up
