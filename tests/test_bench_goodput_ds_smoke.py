"""benchmarks/bench_goodput_ds.py still runs: ``--smoke`` (CPU, gloo, a tiny GPT) makes whole DeepSpeed runs without
and with memory checkpoints, reads their iteration lines and prints the goodput table (asserting no speed); the memory
variant (a save every iteration, ``+u1``: each committed before the next line) killed as iteration 6's line arrives
(the kill lands a little later on a loaded box) resumes from the save before the last line it logged, or from that
line's own, and logs the losses of the run without checkpoints; both runs' trainers sampled (``--sample``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

# A benchmark's smoke run: off in CI (its 10-minute budget), on with CPUCKPT_SLOW=1 — run them before a device
# call (README: "The two commands").
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_bench_goodput_ds_smoke(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_goodput_ds", "--smoke", "--variants",
                           "none,mem1+ahead+u1", "--kill", "mem1+ahead+u1", "--kill-after-log", "6", "--sample",
                           "none,mem1+ahead+u1", "--out", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    results = json.loads((tmp_path / "bench_goodput_ds.json").read_text())
    summary = results["summary"]
    assert [s["variant"] for s in summary] == ["none", "mem1+ahead+u1"]
    assert all(s["rc"] == 0 and s["iters"] == 8 for s in summary), summary  # iterations 2..10 of the window
    assert summary[1]["saves"] == 8 and summary[1].get("ratio") is not None, summary[1]
    assert "wall x none" in proc.stdout
    kill = results["kill"]["mem1+ahead+u1"]
    # at most one lost: the tiny save of the logged iteration itself may commit before the kill lands (then none)
    assert kill["killed"] and 6 <= kill["last_logged"] < 10 and kill["iterations_lost"] in (0, 1), kill
    assert kill["relaunch_rc"] == 0 and kill["values_equal"] and kill["compared"] == 10 - kill["resumed_from"], kill
    assert kill["before_kill_equal"] and kill["before_kill_compared"] >= 6, kill  # the control: the same run up to it
    assert (tmp_path / "ds_mem1_ahead_u1_resumed.log").is_file()  # no "+" in names (the device hands those back)
    # --sample: the trainers' main threads inside their loops, read and removed; the killed runs and our writer
    # processes (whose command lines hold --train... but not "--train --variant") sampled nothing
    samples = results["samples"]
    assert sorted(samples) == ["mem1+ahead+u1", "none"], samples.keys()
    assert all(s["in_loop"] > 0 and s["inclusive_ms"].get("bench_goodput_ds.py:_train_loop", 0) > 0
               for s in samples.values()), samples
    assert not list(tmp_path.glob("samples_*")), list(tmp_path.glob("samples_*/*"))
    assert "trainer main thread, sampled" in proc.stdout


def test_slots_modifier_sets_the_memory_slots() -> None:
    """``+slots<N>``: the memory tier's slots (3 without it); one at most, on a memory variant only."""
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks.bench_goodput_ds import check_variant, settings
    finally:
        sys.path.remove(str(REPO))
    assert settings("mem8+ahead+snap+copyproc+slots2", "/ram", 64)["memory"]["slots"] == 2
    assert settings("mem8+ahead", "/ram", 64)["memory"]["slots"] == 3
    assert check_variant("mem8+ahead+snap+copyproc+slots2") is None
    assert "memory variant" in check_variant("none+slots2")
    assert "one +slots<N>" in check_variant("mem8+slots2+slots3")
    assert "modifiers are" in check_variant("mem8+slots1")
