"""Memory saves overlap, each in its own slot, up to ``slots - 1`` in flight (a save every step does not wait for
the commit before it, and one slot always holds a committed checkpoint).

Single process, real RAM-root files, no writer process (persist_every 0). The first save's commit is held at its
``.metadata`` rename (a fault point); the save into the next slot starts meanwhile, and the one after it (which would
leave no slot with a committed checkpoint, were the job killed then) waits for it.
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
def test_a_save_into_another_slot_starts_while_an_older_commit_is_held_and_one_more_waits(tmp_path, max_in_flight):
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
        second, out2 = _in_thread(lambda: tier.save(_state(2), 2))  # slot 1: does not wait for step 1's commit
        second.join(20)
        assert not second.is_alive(), "the save of step 2 waited for the held commit of step 1"
        assert "error" not in out2, out2
        out2["result"].staged.wait()
        third, out3 = _in_thread(lambda: tier.save(_state(3), 3))  # slot 2: three uncommitted would be every slot
        third.join(0.5)
        assert third.is_alive(), "a third save started with both others uncommitted: no slot would hold a commit"
        assert not first.done()
        release.set()
        third.join(30)
        assert not third.is_alive() and "error" not in out3, out3
        fourth = tier.save(_state(4), 4)  # slot 0 again, step 1's
        handles = [first, out2["result"], out3["result"], fourth]
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


def test_the_slot_of_the_only_committed_save_changes_only_after_a_newer_save_committed(tmp_path):
    """Two slots: step 1 committed, step 2's commit held. The save of step 3 reuses step 1's slot, the only one
    holding a committed checkpoint: its ``before_fill`` (an adapter clearing the slot) must not run before step 2
    is committed, or a kill then would leave no memory checkpoint (the bound once waited only after it)."""
    held, release = threading.Event(), threading.Event()
    commits = []

    def hold_second_commit(stage: str) -> None:
        if stage == "before-rename:.metadata":
            commits.append(stage)
            if len(commits) == 2:
                held.set()
                assert release.wait(30), "never released"

    cfg = _cfg(tmp_path, 1)
    cfg["memory"]["slots"] = 2
    tier = MemoryTier(tmp_path / "durable", cfg)
    previous = faultpoint.set_handler(hold_second_commit)
    filled: list[str] = []
    try:
        tier.save(_state(1), 1).wait(30)
        second = tier.save(_state(2), 2)
        assert held.wait(30), "the second save never reached its commit"
        third, out = _in_thread(lambda: tier.save(_state(3), 3, before_fill=lambda slot: filled.append(slot.name)))
        third.join(0.5)
        assert third.is_alive() and filled == [], "the slot of the only committed save changed while step 2 was not"
        assert tier.find_latest() == tier.slots[0], "step 1 is no longer a complete checkpoint"
        release.set()
        third.join(30)
        assert not third.is_alive() and "error" not in out, out
        assert filled == ["slot-0"]
        second.wait(30)
        out["result"].wait(30)
        assert tier.find_latest() == tier.slots[0]
    finally:
        release.set()
        faultpoint.set_handler(previous)
        tier.close(persist_newest=False)
