"""``python -m benchmarks.bench_blocksum --smoke`` runs: on the CPU its device reduction equals the definition's
blocksum32 over every chunk (the instrument measures the code it claims to). No timing is asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark's smoke run: on with CPUCKPT_SLOW=1 (tests/conftest.py)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_bench_blocksum_smoke(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_blocksum", "--smoke"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "the reduction equals blocksum32" in proc.stdout, proc.stdout
