"""Memory saves overlap: one in flight per slot (a save every step does not wait for the commit before it).

Single process, real RAM-root files, no writer process (persist_every 0). The first save's commit is held at its
``.metadata`` rename (a fault point); saves into the other slots start meanwhile, and the save that reuses the first
slot waits for it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import cpuckpt
from cpuckpt import faultpoint
from cpuckpt.tier.memory import MemoryTier
from cpuckpt.tools.verification import verify_checkpoint


def _cfg(tmp_path: Path, max_in_flight: int) -> dict:
    return {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 30,
            "async": {"max_in_flight": max_in_flight},
            "memory": {"root": str(tmp_path / "ram"), "persist_every": 0, "slots": 3, "headroom_bytes": 0}}


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 129, generator=g), "b": torch.randn(77, generator=g), "step": step}


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("max_in_flight", [1, 8])  # the slots bound memory saves, whatever async.max_in_flight says
def test_saves_into_other_slots_start_while_an_older_commit_is_held_and_a_reused_slot_waits(tmp_path, max_in_flight):
    held, release = threading.Event(), threading.Event()
    commits = []

    def hold_first_commit(stage: str) -> None:
        if stage == "before-rename:.metadata":
            commits.append(stage)
            if len(commits) == 1:
                held.set()
                assert release.wait(30), "never released"

    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, max_in_flight))
    previous = faultpoint.set_handler(hold_first_commit)
    try:
        first = tier.save(_state(1), 1)
        assert held.wait(30), "the first save never reached its commit"
        handles = [first]
        for step in (2, 3):  # slots 1 and 2: neither waits for the held commit of slot 0
            t, out = _in_thread(lambda step=step: tier.save(_state(step), step))
            t.join(20)
            assert not t.is_alive(), f"the save of step {step} waited for the held commit of step 1"
            assert "error" not in out, out
            handles.append(out["result"])
            out["result"].staged.wait()
        assert not first.done() and release.is_set() is False
        fourth, out = _in_thread(lambda: tier.save(_state(4), 4))  # slot 0 again: waits for step 1's save
        fourth.join(0.5)
        assert fourth.is_alive(), "the save reusing slot 0 did not wait for the save still in it"
        release.set()
        fourth.join(30)
        assert not fourth.is_alive() and "error" not in out, out
        handles.append(out["result"])
        for h in handles:
            h.wait(30)
        latest = tier.find_latest()
        assert latest == tier.slots[0], latest
        # slot 0 holds step 4 whole: its own .metadata and manifest, not step 1's commit over step 4's bytes
        report = verify_checkpoint(latest)
        assert report.ok and report.kind == "cpuckpt" and report.chunks, report
        loaded = {"w": torch.empty(256, 129), "b": torch.empty(77), "step": -1}
        cpuckpt.load(loaded, latest)
        want = _state(4)
        assert loaded["step"] == 4 and torch.equal(loaded["w"], want["w"]) and torch.equal(loaded["b"], want["b"])
    finally:
        release.set()
        faultpoint.set_handler(previous)
        tier.close(persist_newest=False)
