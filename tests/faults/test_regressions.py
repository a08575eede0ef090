"""Regressions found in review; each docstring is the bug report."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cpuckpt

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def test_failed_fsync_is_reported_not_timed_out(tmp_path):
    """A failing fsync at the end of a save used to leave ``done`` unset: the StorageIOError turned
    into a CheckpointTimeoutError after timeout_s."""
    cfg = {"io": {"backend": "fault:EIO@fsync"}, "timeout_s": 60}
    t0 = time.monotonic()
    with pytest.raises(cpuckpt.StorageIOError, match=r"fsync failed on .*__0_0\.distcp"):
        cpuckpt.save({"a": torch.arange(10)}, tmp_path / "ck", cfg)
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "ck" / ".metadata").exists()


def test_conjugate_and_negative_views_save_their_values(tmp_path):
    """``flat_bytes`` viewed lazily-conjugated tensors as bytes: saving ``z.conj()`` raised."""
    z = torch.randn(4, 3, dtype=torch.complex64)
    sd = {"conj": z.conj(), "neg": torch._neg_view(z)}
    cpuckpt.save(sd, tmp_path / "ck")
    out = {"conj": torch.zeros_like(z), "neg": torch.zeros_like(z)}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path / "ck")))
    assert torch.equal(out["conj"], z.conj().resolve_conj())
    assert torch.equal(out["neg"], -z)


def test_stock_save_over_a_cpuckpt_checkpoint_still_loads(tmp_path):
    """After a stock FileSystemWriter save into a directory that held a cpuckpt checkpoint, the old
    manifest described other files and cpuckpt's reader raised CheckpointCorrupt."""
    path = tmp_path / "ck"
    cpuckpt.save({"a": torch.zeros(1000), "b": torch.ones(3)}, path)
    new = {"a": torch.randn(1000), "b": torch.randn(3)}
    dcp.save(new, storage_writer=dcp.FileSystemWriter(str(path)))
    out = {"a": torch.empty(1000), "b": torch.empty(3)}
    cpuckpt.load(out, path)
    assert torch.equal(out["a"], new["a"]) and torch.equal(out["b"], new["b"])
