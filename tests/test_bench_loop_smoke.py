"""benchmarks/bench_loop.py still runs: ``--smoke`` (CPU, a tiny state) goes through every variant, MemoryTier
saves every iteration included, prints its table and leaves nothing in /dev/shm (asserting no speed)."""

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


def test_bench_loop_smoke(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_loop", "--smoke", "--out", str(tmp_path),
                           "--dir", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    runs = json.loads((tmp_path / "bench_loop.json").read_text())["runs"]
    assert [r["variant"] for r in runs] == ["none", "mem", "mem+nocrc", "memsnap", "memcopy"]
    assert all(r["iterations"] == 3 for r in runs), runs
    assert "mean x none" in proc.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("cpuckpt-bench-loop-")], "the RAM root stayed"
