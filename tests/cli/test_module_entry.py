"""``python -m cpuckpt`` exits with the command's status, as the ``cpuckpt`` console script does.

Regression: ``cpuckpt/__main__.py`` called ``main()``, which catches click's ``SystemExit`` and returns
the code, and dropped it: ``python -m cpuckpt verify <damaged>`` printed ``DAMAGED ...`` and exited 0,
so a script or CI step that checked a checkpoint that way was told it was fine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import cpuckpt

CFG = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}}


def _module(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUCKPT_")}
    return subprocess.run([sys.executable, "-m", "cpuckpt", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_python_m_cpuckpt_verify_exits_nonzero_on_a_damaged_checkpoint(tmp_path):
    ckpt = tmp_path / "step_1"
    cpuckpt.save({"w": torch.randn(200, 100, generator=torch.Generator().manual_seed(0)), "step": 1}, ckpt, CFG)
    ok = _module("verify", ckpt, cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("OK "), ok.stdout + ok.stderr

    data = ckpt / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped bit pattern inside the tensor bytes: sizes stay intact
    data.write_bytes(bytes(raw))
    bad = _module("verify", ckpt, cwd=tmp_path)
    assert "DAMAGED" in bad.stdout, bad.stdout + bad.stderr
    assert bad.returncode == 1, f"exit status {bad.returncode}: {bad.stdout}{bad.stderr}"


def test_python_m_cpuckpt_usage_error_exits_2(tmp_path):
    """click's usage errors keep their status (2) through the module entry too."""
    res = _module("verify", tmp_path / "missing", "--no-such-option", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
