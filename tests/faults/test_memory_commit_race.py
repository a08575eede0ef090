"""A memory save reports committed only with every chunk's checksum computed (issue 27 A).

The bug (in the memory tier's own save job, since merged into the one save engine): when every chunk's
copy had ended before ``ImageJob.start()`` reached its ``finally``, that
block queued the checksum tasks one by one with the job no longer marked as submitting; the first
checksum task to end dropped the pending count to 0 and finished the job. ``h.wait()`` reported the
checkpoint committed in memory with crc32c 0 for the chunks not yet checksummed, and loading it raised
``CheckpointCorrupt`` ("stored 0"). It happened on first saves of fresh processes with CPU tensors; a
saving thread descheduled for a few ms after each task submission makes it happen every time, which
is what this test does (in the test, never in the product).
"""

from __future__ import annotations

import time
from pathlib import Path

import _helpers as H
import pytest
import torch

pytestmark = pytest.mark.timeout(120)


class _SlowSubmitter:
    """An executor whose ``submit`` returns 20 ms late: the submitting thread is descheduled after each task."""

    def __init__(self, executor) -> None:
        self._executor = executor

    def submit(self, fn, *args, **kwargs):
        fut = self._executor.submit(fn, *args, **kwargs)
        time.sleep(0.02)
        return fut

    def __getattr__(self, name):
        return getattr(self._executor, name)


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(96, 1024, generator=g), "b": torch.randn(7000, generator=g), "step": 3}


def test_a_memory_save_committed_while_its_checksums_were_queued_verifies(tmp_path: Path, monkeypatch) -> None:
    import cpuckpt
    from cpuckpt.tier.memory import MemoryTier
    from cpuckpt.tools.verification import verify_checkpoint
    from cpuckpt.transfer import save_job

    real = save_job.shared_executor
    monkeypatch.setattr(save_job, "shared_executor", lambda *a, **kw: _SlowSubmitter(real(*a, **kw)))
    cfg = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"},
           "memory": {"root": str(tmp_path / "ram"), "persist_every": 0, "slots": 1, "headroom_bytes": 0},
           "timeout_s": 30}
    tier = MemoryTier(tmp_path / "durable", cfg)
    try:
        state = _state()
        tier.save(state, 3).wait()  # committed in memory: from here it must verify
        path = tier.find_latest()
        assert path is not None
        out = {"w": torch.empty(96, 1024), "b": torch.empty(7000), "step": -1}
        cpuckpt.load(out, path)  # the reader checks every chunk's crc32c from the manifest
        assert out["step"] == 3
        H.assert_bitexact(out["w"], state["w"], "w")
        H.assert_bitexact(out["b"], state["b"], "b")
        assert verify_checkpoint(path).ok, "cpuckpt verify refuses the committed memory checkpoint"
    finally:
        tier.close(persist_newest=False)
