"""``cpuckpt.load_latest``: a restart falls back past a damaged newest checkpoint, on every rank together.

Real 2-rank gloo runs save three checkpoints (a sharded DTensor, a replicated tensor, non-tensor
values) under one root; then one byte of a data file is flipped in place (size unchanged, so
``find_latest`` still calls the checkpoint complete: only the crc32c the load checks sees it).
``load_latest`` must load the second newest bit-exact and return its path on both ranks, also when
only rank 1's file is damaged (rank 0 alone would not notice). One process: when every checkpoint
is damaged, a clear ``CheckpointCorrupt`` naming them, not a silent fresh start.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import _helpers as H
import pytest
import torch

import cpuckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CFG = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 60}
SHAPE = (300, 257)  # ~150 KB per rank's shard: several 64 KiB chunks


def _flip(file: Path) -> None:
    """Flip one byte in the middle of ``file`` (tensor data), in place."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _state(mesh, k: int | None) -> dict:
    """The state saved at step ``k``; ``k=None``: poison of the same shapes (what a load must overwrite)."""
    from torch.distributed.tensor import Shard

    full = H.make_full("w", SHAPE, torch.float32, seed=k or 0)
    b = H.make_full("b", (5, 7), torch.bfloat16, seed=k or 0)
    return {"w": H.make_dtensor(full, mesh, [Shard(0)], poisoned=k is None),
            "b": H.poison(b) if k is None else b,
            "step": -1 if k is None else k,
            "meta": {"k": -1 if k is None else k}}


def _check(sd: dict, mesh, k: int) -> None:
    from torch.distributed.tensor import Shard

    H.assert_dtensor(sd["w"], H.make_full("w", SHAPE, torch.float32, seed=k), mesh, [Shard(0)], f"step {k}: w")
    H.assert_bitexact(sd["b"], H.make_full("b", (5, 7), torch.bfloat16, seed=k), f"step {k}: b")
    assert sd["step"] == k and sd["meta"] == {"k": k}, (sd["step"], sd["meta"])


def rank_fall_back(root: str, damaged_file: str) -> str:
    """Save steps 1..3, rank 0 damages ``damaged_file`` of step 3; load_latest on every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    root_p = Path(root)
    for k in (1, 2, 3):
        cpuckpt.save(_state(mesh, k), root_p / f"step_{k}", CFG, step=k)
    dist.barrier()
    if dist.get_rank() == 0:
        _flip(root_p / "step_3" / damaged_file)
    dist.barrier()
    assert cpuckpt.find_latest(root_p) == root_p / "step_3"  # sizes are intact: "complete"
    sd = _state(mesh, None)
    loaded = cpuckpt.load_latest(sd, root_p, CFG)
    _check(sd, mesh, 2)
    return str(loaded)


@pytest.mark.parametrize("damaged_file", ["__0_0.distcp", "__1_0.distcp"])
def test_damaged_newest_falls_back_on_both_ranks(run_ranks, tmp_path, damaged_file):
    root = tmp_path / "root"
    results = run_ranks(2, rank_fall_back, str(root), damaged_file, timeout_s=180)
    assert results == [str(root / "step_2")] * 2


def _save_one(root: Path, k: int) -> Path:
    path = root / f"step_{k}"
    cpuckpt.save({"w": H.make_full("w", (200, 100), torch.float32, seed=k), "step": k}, path, CFG, step=k)
    return path


def test_every_checkpoint_damaged_is_a_clear_error(tmp_path):
    paths = [_save_one(tmp_path, k) for k in (1, 2)]
    for p in paths:
        _flip(p / "__0_0.distcp")
    sd = {"w": torch.zeros(200, 100), "step": None}
    with pytest.raises(cpuckpt.CheckpointCorrupt) as info:
        cpuckpt.load_latest(sd, tmp_path, CFG)
    msg = str(info.value)
    assert all(str(p) in msg for p in paths) and "do not train" in msg, msg


def test_fallback_is_logged_and_can_be_turned_off(tmp_path, caplog):
    _save_one(tmp_path, 1)
    _flip(_save_one(tmp_path, 2) / "__0_0.distcp")
    sd = {"w": torch.zeros(200, 100), "step": None}
    with caplog.at_level(logging.WARNING, logger="cpuckpt.restart"):
        assert cpuckpt.load_latest(sd, tmp_path, CFG) == tmp_path / "step_1"
    assert any("step_2" in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records)
    H.assert_bitexact(sd["w"], H.make_full("w", (200, 100), torch.float32, seed=1), "w")
    assert sd["step"] == 1
    with pytest.raises(cpuckpt.CheckpointCorrupt):
        cpuckpt.load_latest(sd, tmp_path, CFG, fallback_on_corrupt=False)


def test_a_newest_checkpoint_damaged_since_its_commit_is_never_loaded_past_with_fallback_off(tmp_path, caplog):
    """A newest checkpoint whose data file was cut short after its commit: skipped with a WARNING, and with
    ``fallback_on_corrupt=False`` raised (it was skipped either way: the switch only covered checksum failures)."""
    _save_one(tmp_path, 1)
    data = _save_one(tmp_path, 2) / "__0_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    sd = {"w": torch.zeros(200, 100), "step": None}
    with caplog.at_level(logging.WARNING, logger="cpuckpt.restart"):
        assert cpuckpt.load_latest(sd, tmp_path, CFG) == tmp_path / "step_1"
    assert any("step_2" in r.getMessage() and "committed, but incomplete now" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(cpuckpt.CheckpointCorrupt, match=r"step_2: committed, but incomplete now .*fallback_on_corrupt"):
        cpuckpt.load_latest(sd, tmp_path, CFG, fallback_on_corrupt=False)
    _save_one(tmp_path, 3)  # an older damaged one does not stop the newest loading
    assert cpuckpt.load_latest(sd, tmp_path, CFG, fallback_on_corrupt=False) == tmp_path / "step_3"


def test_empty_root_loads_nothing_and_a_url_is_refused(tmp_path):
    assert cpuckpt.load_latest({"w": torch.zeros(1)}, tmp_path / "none", CFG) is None
    with pytest.raises(cpuckpt.ConfigError, match="gs://"):  # s3:// roots work (tests/s3/test_s3_roots.py)
        cpuckpt.load_latest({"w": torch.zeros(1)}, "gs://bucket/run", CFG)


def rank_listing_fails_on_rank_0(root: str) -> str:
    """Rank 0 cannot list the root (an I/O error there only); every rank calls load_latest."""
    import errno
    import time

    import torch.distributed as dist

    import cpuckpt.restart as restart

    cpuckpt.save({"w": torch.ones(4)}, Path(root) / "step_1", CFG, step=1)
    if dist.get_rank() == 0:
        def fail(root):
            raise cpuckpt.StorageIOError("cannot list", path=str(root), errno_=errno.EIO)

        restart.list_checkpoints = fail
    t0 = time.monotonic()
    try:
        cpuckpt.load_latest({"w": torch.zeros(4)}, root, CFG)
    except cpuckpt.CpuckptError as e:
        return f"{type(e).__name__}: {e} ({time.monotonic() - t0 < 20})"
    return "loaded"


def test_a_listing_that_fails_on_rank_0_fails_every_rank_alike_and_promptly(run_ranks, tmp_path):
    """Rank 0 raised while the other ranks waited in the broadcast of its listing until the group's timeout (and
    then raised another error)."""
    results = run_ranks(2, rank_listing_fails_on_rank_0, str(tmp_path), timeout_s=120)
    assert results[0] == results[1] and "cannot list" in results[0] and results[0].endswith("(True)"), results
