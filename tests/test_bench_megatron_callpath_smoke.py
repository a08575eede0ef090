"""The Megatron call-path benchmark still runs: ``python -m benchmarks.bench_megatron_callpath --smoke`` exits 0, its
last save loads bit-exact through stock megatron-core (the saves it times are real), and it leaves nothing behind.

Asserts nothing about speed (BENCHMARKING.md). The installed cpuckpt comes first on PYTHONPATH (its
``cpuckpt.integrations``), then the repository root (``benchmarks``); the cwd is a scratch directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
# A benchmark's smoke run: off in CI (its 10-minute budget), on with CPUCKPT_SLOW=1.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_bench_megatron_callpath_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    env["PYTHONPATH"] = os.pathsep.join([sysconfig.get_paths()["purelib"], str(REPO),
                                         *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_megatron_callpath", "--smoke", "--dir",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "verified: iter_0000006 loads bit-exact (52 tensors)" in proc.stdout, proc.stdout
    for part in ("build", "save", "top"):
        assert f"  {part} " in proc.stdout, proc.stdout
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # its directory and RAM root removed
