"""The replica benchmark still runs: ``python -m benchmarks.bench_replica --smoke`` exits 0 and prints its tables.

Asserts nothing about speed (benchmarks are never timed tests), only that the three paths (raw, gloo,
replica) moved every byte, that the stall part measured both configurations and every replica landed, and
that the scratch directory is gone. The repository root is put on PYTHONPATH, the cwd is a scratch directory.
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


@pytest.mark.timeout(200)
def test_bench_replica_smoke(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_replica", "--smoke", "--dir", str(tmp_path), "--out",
         str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=190,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "cpuckpt replica throughput" in proc.stdout, proc.stdout
    result = json.loads((tmp_path / "out" / "bench_replica.json").read_text())
    assert result["nbytes"] >= 8 << 20
    assert {k: len(v) for k, v in result["gbps"].items()} == {"raw": 2, "gloo": 2, "replica": 2}
    assert all(x > 0 for v in result["gbps"].values() for x in v)
    assert set(result["ratios"]) == {"replica/gloo", "replica/raw"}
    assert "cpuckpt replica save stall" in proc.stdout, proc.stdout
    stall = result["stall"]["summary"]
    for k in ("replicas=0", "replicas=1"):
        assert stall[k]["stall"]["n"] == 2 and stall[k]["commit"]["median"] > 0, stall
    assert all(r["ok"] for rank in result["stall"]["ranks"] for r in rank["replica_outcomes"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("cpuckpt-bench-")] == []  # cleaned up
