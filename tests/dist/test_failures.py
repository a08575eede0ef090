"""A write failure on one rank fails the save on every rank, promptly, and never commits.

The failure is real: rank 1 (or the coordinator, rank 0) writes through cpuckpt's built-in
``io.backend: "fault:ENOSPC@<bytes>"`` backend, whose ``pwrite`` raises ``OSError(ENOSPC)`` once
that many bytes went through it. DCP gathers the failure to the coordinator and raises a
``CheckpointException`` (a ``BaseException``) everywhere; ``cpuckpt.save`` must turn it into a
``cpuckpt.CpuckptError`` naming the file / ENOSPC on *both* ranks. Afterwards no ``.metadata``
exists (stock DCP and cpuckpt both see an incomplete checkpoint), an older complete checkpoint in
another directory still loads bit-exact, and a complete checkpoint that a failing save overwrote is
left without ``.metadata``.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import torch


import _helpers as H  # noqa: E402 - tests/dist is on sys.path (conftest and the rank bootstrap)

GOOD = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 60}


def _fault(spec: str) -> dict:
    return {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": spec}, "timeout_s": 60}


def _state_dict(mesh, *, poisoned: bool = False) -> dict:
    from torch.distributed.tensor import Shard

    # Each rank writes ~155 KB of the DTensor: past the 100000-byte fault threshold.
    big = H.make_full("big", (300, 257), torch.float32)
    small = H.make_full("small", (5, 7), torch.bfloat16)
    return {
        "big": H.make_dtensor(big, mesh, [Shard(0)], poisoned=poisoned),
        "small": H.poison(small) if poisoned else small,
        "step": -1 if poisoned else 5,
    }


def _check(sd: dict, mesh, what: str) -> None:
    from torch.distributed.tensor import Shard

    H.assert_dtensor(sd["big"], H.make_full("big", (300, 257), torch.float32), mesh, [Shard(0)], f"{what}: big")
    H.assert_bitexact(sd["small"], H.make_full("small", (5, 7), torch.bfloat16), f"{what}: small")
    assert sd["step"] == 5, what


def _failing_save(sd: dict, path: Path, cfg: dict) -> dict:
    """Run a save that must fail; describe the exception this rank got."""
    import cpuckpt

    t0 = time.monotonic()
    try:
        cpuckpt.save(sd, path, cfg)
    except cpuckpt.CpuckptError as e:  # a CheckpointException (BaseException) would escape this
        return {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
                "is_storage_io": isinstance(e, cpuckpt.StorageIOError), "errno": getattr(e, "errno", None),
                "seconds": time.monotonic() - t0}
    raise AssertionError(f"save into {path} succeeded on rank although a rank's writes fail")


def rank_fail_on_one_rank(root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import cpuckpt
    from cpuckpt.backend.committed import is_complete

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    root_p = Path(root)
    older, overwritten, fresh, coord = (root_p / n for n in ("older", "overwritten", "fresh", "coord_fails"))
    sd = _state_dict(mesh)
    cpuckpt.save(sd, older, GOOD, step=1)
    cpuckpt.save(sd, overwritten, GOOD, step=1)
    dist.barrier()
    assert is_complete(older) and is_complete(overwritten)

    out = {}
    # 1. rank 1 runs out of space ~100 KB into its file, in a fresh directory.
    out["fresh"] = _failing_save(sd, fresh, _fault("fault:ENOSPC@100000") if rank == 1 else GOOD)
    dist.barrier()
    out["fresh_listing"] = H.checkpoint_listing(fresh)
    # 2. the same failure while overwriting a complete checkpoint.
    out["overwritten"] = _failing_save(sd, overwritten, _fault("fault:ENOSPC@100000") if rank == 1 else GOOD)
    dist.barrier()
    out["overwritten_listing"] = H.checkpoint_listing(overwritten)
    # 3. the coordinator's very first write fails.
    out["coord"] = _failing_save(sd, coord, _fault("fault:ENOSPC@0") if rank == 0 else GOOD)
    dist.barrier()
    out["coord_listing"] = H.checkpoint_listing(coord)

    # Incomplete checkpoints are recognised as such, by cpuckpt and by stock DCP.
    for path in (fresh, overwritten, coord):
        assert not is_complete(path), path
        try:
            cpuckpt.load(_state_dict(mesh, poisoned=True), path)
        except cpuckpt.IntegrityError as e:
            assert ".metadata" in str(e), str(e)
        else:
            raise AssertionError(f"cpuckpt.load of the incomplete {path} succeeded")
        try:
            dcp.FileSystemReader(path).read_metadata()
        except FileNotFoundError:
            pass
        else:
            raise AssertionError(f"stock FileSystemReader found .metadata in the incomplete {path}")

    # The older complete checkpoint is untouched: loads bit-exact through both readers.
    dest = _state_dict(mesh, poisoned=True)
    cpuckpt.load(dest, older)
    _check(dest, mesh, "cpuckpt load of the older checkpoint")
    dest = _state_dict(mesh, poisoned=True)
    dcp.load(dest, storage_reader=dcp.FileSystemReader(older))
    _check(dest, mesh, "stock load of the older checkpoint")

    # And the group is still healthy: a good save into the failed directory commits and loads.
    cpuckpt.save(sd, fresh, GOOD, step=2)
    dest = _state_dict(mesh, poisoned=True)
    cpuckpt.load(dest, fresh)
    _check(dest, mesh, "load after a good save over a failed one")
    dist.barrier()
    return out


def _names_the_failure(info: dict, failing_rank: int) -> bool:
    msg = info["message"]
    return f"__{failing_rank}_0.distcp" in msg and ("errno 28" in msg or os.strerror(errno.ENOSPC) in msg
                                                     or "ENOSPC" in msg)


def test_write_failure_on_one_rank_fails_every_rank(run_ranks, tmp_path):
    root = tmp_path / "ckpts"
    t0 = time.monotonic()
    results = run_ranks(2, rank_fail_on_one_rank, str(root), timeout_s=120)
    elapsed = time.monotonic() - t0
    assert elapsed < 60, f"failing saves took {elapsed:.0f} s"
    for rank, out in enumerate(results):
        for case, failing_rank in (("fresh", 1), ("overwritten", 1), ("coord", 0)):
            info = out[case]
            assert _names_the_failure(info, failing_rank), (rank, case, info)
            assert info["seconds"] < 30, (rank, case, info)
            assert ".metadata" not in out[f"{case}_listing"], (rank, case, out[f"{case}_listing"])
            assert ".cpuckpt.json" not in out[f"{case}_listing"], (rank, case, out[f"{case}_listing"])
    # On disk, from the parent: the older checkpoint is complete, the overwritten one is not
    # (its data files may remain, but without .metadata no reader takes it for a checkpoint).
    H.assert_committed_layout(root / "older", world=2)
    assert not (root / "overwritten" / ".metadata").exists()
    assert not (root / "coord_fails" / ".metadata").exists()
    H.assert_committed_layout(root / "fresh", world=2)  # re-saved successfully at the end
