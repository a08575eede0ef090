"""benchmarks/bench_s3.py and bench_s3_clients.py still run: ``--smoke`` starts its own SeaweedFS, saves and loads
a tiny state with cpuckpt and the installed peers (checked bit-exact by the script), prints its table and stops
the server (asserting no speed)."""

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


def _run(module: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return subprocess.run([sys.executable, "-m", module, "--smoke", "--out", str(tmp_path), "--dir", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)


def test_bench_s3_smoke(tmp_path: Path) -> None:
    proc = _run("benchmarks.bench_s3", tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    results = json.loads((tmp_path / "bench_s3.json").read_text())["results"]
    assert {"raw", "cpuckpt", "s3torchconnector"} <= set(results), results  # dcp+s3fs: where s3fs >= 2023 is
    assert "cpuckpt save / best peer" in proc.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("bench-s3-")], "the server's directory stayed"


def test_bench_s3_clients_smoke(tmp_path: Path) -> None:
    proc = _run("benchmarks.bench_s3_clients", tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = json.loads((tmp_path / "bench_s3_clients.json").read_text())["rows"]
    assert [r["client"] for r in rows][:1] == ["boto3"], rows
