"""SIGTERM during an async save: finished within the grace period, or left recognisably incomplete.

Real rank processes send themselves a real SIGTERM while an ``async_save`` is in flight (held at
the ``.metadata`` rename by a ``sleep`` stage action of ``cpuckpt.testing.faults``, so it is surely in
flight).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

import cpuckpt
from cpuckpt.testing import faults

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CFG = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 30}


def state(k: int) -> dict:
    g = torch.Generator().manual_seed(k)
    return {"w": torch.randn(50_000, generator=g), "step": k}


def _loads_as(path: Path, k: int) -> bool:
    out = {"w": torch.zeros(50_000), "step": None}
    cpuckpt.load(out, path, CFG)
    return torch.equal(out["w"], state(k)["w"]) and out["step"] == k


def rank_sigterm(root: str, grace_s: float, chain: bool, hook: str) -> dict:
    """Save step 1, start async step 2 (held by ``hook``), SIGTERM ourselves; report what handlers saw."""
    root_p = Path(root)
    cpuckpt.save(state(1), root_p / "step_0001", CFG, step=1)
    faults.install(hook)
    calls: list[tuple[str, float]] = []
    if chain:
        signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(
            ("trainer", time.monotonic(), cpuckpt.find_latest(root_p).name)))
    cpuckpt.install_sigterm_handler(grace_s)
    t0 = time.monotonic()
    h = cpuckpt.async_save(state(2), root_p / "step_0002", CFG, step=2)
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, on the main thread
    return {"calls": [(c[0], c[1] - t0, c[2]) for c in calls], "done": h.done(), "elapsed": time.monotonic() - t0}


def test_sigterm_waits_for_the_save_then_chains(run_ranks, tmp_path):
    root = tmp_path / "root"
    (res,) = run_ranks(1, rank_sigterm, str(root), 30.0, True, "before-rename:.metadata=sleep:1.5", timeout_s=120)
    assert res["done"], "the handler returned before the in-flight save committed"
    assert [c[0] for c in res["calls"]] == ["trainer"], "the trainer's own SIGTERM handler did not run"
    assert res["calls"][0][2] == "step_0002", "the trainer's handler ran before the save committed"
    assert 1.0 < res["elapsed"] < 25
    assert cpuckpt.find_latest(root) == root / "step_0002"
    assert _loads_as(root / "step_0002", 2) and _loads_as(root / "step_0001", 1)


def test_sigterm_grace_expires_and_the_save_stays_incomplete(run_ranks, tmp_path):
    root = tmp_path / "root"
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as ei:  # RankError: the process ended by SIGTERM (default action)
        run_ranks(1, rank_sigterm, str(root), 0.5, False, "before-rename:.metadata=sleep:20", timeout_s=120,
                  grace_s=1)
    assert "exit code -15" in str(ei.value), ei.value
    assert time.monotonic() - t0 < 15, "SIGTERM waited for the whole save, not the grace period"
    assert not (root / "step_0002" / ".metadata").exists()
    info = {i.path.name: i for i in cpuckpt.list_checkpoints(root)}
    assert not info["step_0002"].complete
    assert cpuckpt.find_latest(root) == root / "step_0001"
    assert _loads_as(root / "step_0001", 1)
