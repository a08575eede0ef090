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

import _helpers as H
import torch

from cpuckpt.testing import faults

faults.install()  # io.backend "fault:...", in this process and in every rank (they load this module)

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


# ----------------------------------------------------------------- the same error on every rank


def _error_contract(e: BaseException) -> dict:
    import cpuckpt

    return {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
            "is_cpuckpt": isinstance(e, cpuckpt.CpuckptError), "is_oserror": isinstance(e, OSError),
            "errno": getattr(e, "errno", None), "rank": getattr(e, "rank", None),
            "path": getattr(e, "path", None), "filename": getattr(e, "filename", None),
            "failures": sorted((getattr(e, "failures", None) or {}).keys()),
            "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None}


def rank_enospc_contract(root: str) -> dict:
    """ENOSPC on rank 1 only: sync save and async_save().wait() raise the same error on both ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import cpuckpt

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = _state_dict(mesh)
    cfg = _fault("fault:ENOSPC@100000") if rank == 1 else GOOD
    out: dict = {}
    for kind in ("sync", "async"):
        path = Path(root) / kind
        try:
            if kind == "sync":
                cpuckpt.save(sd, path, cfg)
            else:
                cpuckpt.async_save(sd, path, cfg).wait()
        except BaseException as e:  # any class (even a BaseException) is recorded; the test checks it
            out[kind] = _error_contract(e)
        else:
            raise AssertionError(f"rank {rank}: {kind} save into {path} succeeded although rank 1 is out of space")
        dist.barrier()
        out[f"{kind}_listing"] = H.checkpoint_listing(path)
    return out


def test_enospc_on_one_rank_is_the_same_oserror_on_every_rank(run_ranks, tmp_path):
    root = tmp_path / "ckpts"
    results = run_ranks(2, rank_enospc_contract, str(root), timeout_s=120)
    for kind in ("sync", "async"):
        infos = [out[kind] for out in results]
        # Same class and message on both ranks: no rank takes a different `except` branch.
        assert infos[0]["type"] == infos[1]["type"] == "cpuckpt.errors.StorageIOError", (kind, infos)
        assert infos[0]["message"] == infos[1]["message"], (kind, infos)
        for rank, info in enumerate(infos):
            assert info["is_cpuckpt"] and info["is_oserror"], (kind, rank, info)
            assert info["errno"] == errno.ENOSPC, (kind, rank, info)
            assert info["rank"] == 1, (kind, rank, info)
            assert info["failures"] == [1], (kind, rank, info)
            assert info["path"] and "__1_" in Path(info["path"]).name, (kind, rank, info)
            assert info["filename"] == info["path"], (kind, rank, info)
            assert "rank 1" in info["message"] and "__1_0.distcp" in info["message"], (kind, rank, info)
            assert ".metadata" not in results[rank][f"{kind}_listing"], (kind, rank, results[rank])
        assert not (root / kind / ".metadata").exists(), kind
    # The original is chained on the rank where it happened (the async error, raised from the handle).
    assert results[1]["async"]["cause"] is not None, results[1]["async"]
    assert results[0]["async"]["cause"] is None, results[0]["async"]


# ------------------------------------- a rank whose checkpoint directory cannot be used (issue 27.2)


def rank_blocked_directory(root: str) -> dict:
    """Rank 1's checkpoint path is unusable (a file; a ``.metadata`` that is a directory), rank 0's is fine
    (per-node paths): save, async_save and load raise the same error on both ranks."""
    import torch.distributed as dist

    import cpuckpt

    rank = dist.get_rank()
    root_p = Path(root)
    good = root_p / "good"
    cpuckpt.save({"w": torch.arange(10)}, good, GOOD)
    if rank == 1:
        (root_p / "a_file").write_bytes(b"not a directory")
        (root_p / "broken" / ".metadata").mkdir(parents=True)
    dist.barrier()
    cfg = {**GOOD, "timeout_s": 30}
    out: dict = {}
    for kind in ("sync", "async", "load"):
        target = root_p / "a_file" if rank == 1 else root_p / f"fine_{kind}"
        t0 = time.monotonic()
        try:
            if kind == "sync":
                cpuckpt.save({"w": torch.ones(3)}, target, cfg)
            elif kind == "async":
                cpuckpt.async_save({"w": torch.ones(3)}, target, cfg).wait()
            else:
                cpuckpt.load({"w": torch.zeros(10, dtype=torch.int64)}, root_p / "broken" if rank == 1 else good,
                             cfg)
        except BaseException as e:  # any class is recorded; the test checks it
            out[kind] = {**_error_contract(e), "seconds": time.monotonic() - t0}
        else:
            raise AssertionError(f"rank {rank}: {kind} succeeded although rank 1's path is unusable")
        dist.barrier()
    return out


def test_unusable_directory_on_one_rank_is_the_same_error_on_every_rank(run_ranks, tmp_path):
    results = run_ranks(2, rank_blocked_directory, str(tmp_path / "ckpts"), timeout_s=90, grace_s=20)
    for kind, want in (("sync", (errno.EEXIST,)), ("async", (errno.EEXIST,)), ("load", (errno.EISDIR,))):
        infos = [out[kind] for out in results]
        assert infos[0]["type"] == infos[1]["type"] == "cpuckpt.errors.StorageIOError", (kind, infos)
        # The same cause on both (each rank's message starts with its own path: the ranks' paths differ here).
        causes = [info["message"].split(" failed on rank 1: ", 1)[-1] for info in infos]
        assert causes[0] == causes[1] and causes[0] != infos[0]["message"], (kind, infos)
        for rank, info in enumerate(infos):
            assert info["is_cpuckpt"] and info["is_oserror"], (kind, rank, info)
            assert info["errno"] in want, (kind, rank, info)
            assert info["rank"] == 1 and info["failures"] == [1], (kind, rank, info)
            assert info["path"] and ("a_file" in info["path"] or "broken" in info["path"]), (kind, rank, info)
            assert "rank 1" in info["message"], (kind, rank, info)
            assert info["seconds"] < 20, (kind, rank, info)  # agreed at once, not after a peer's timeout


def rank_metadata_read_fails_once_on_one_rank(root: str) -> dict:
    """``dcp.load`` through cpuckpt's reader, ``.metadata`` unreadable once on rank 1 only (an injected EIO)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import cpuckpt
    from cpuckpt.backend import reader

    path = Path(root) / "ck"
    cpuckpt.save({"w": torch.arange(100.0)}, path, GOOD)
    if dist.get_rank() == 1:
        real, calls = reader.read_metadata_bytes, []

        def flaky(p: Path) -> bytes:
            calls.append(p)
            if len(calls) == 1:
                raise cpuckpt.StorageIOError("injected: .metadata unreadable once", path=str(p), errno_=errno.EIO)
            return real(p)

        reader.read_metadata_bytes = flaky
    t0 = time.monotonic()
    try:
        dcp.load({"w": torch.zeros(100)}, storage_reader=cpuckpt.StorageReader(path, GOOD))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        return {"raised": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"raised": None, "seconds": time.monotonic() - t0}


def test_a_metadata_read_failing_on_one_rank_fails_the_load_on_every_rank_at_once(run_ranks, tmp_path):
    """DCP retries a failed ``.metadata`` read with ``read_metadata(rank=r)``; cpuckpt's reader answered it with the
    global ``.metadata``, so that rank loaded without collectives while the other waited in one: both hung until
    the group's timeout (30 min by default), and the first error was lost."""
    results = run_ranks(2, rank_metadata_read_fails_once_on_one_rank, str(tmp_path), timeout_s=120)
    for rank, r in enumerate(results):
        assert r["raised"] is not None and r["seconds"] < 30, (rank, r)
        assert "injected: .metadata unreadable once" in r["message"], (rank, r)


def rank_from_rank(root: str) -> dict:
    """``from_rank`` from rank 1: its value on every rank; its failure raised on every rank at once, the ranks in step
    after it."""
    import datetime

    import torch.distributed as dist

    from cpuckpt.backend.collectives import from_every_rank, from_rank

    rank = dist.get_rank()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    out: dict = {"value": from_rank(lambda: {"from": rank}, group, "a value", src=1)}

    def fail() -> None:
        raise OSError(errno.EIO, "Input/output error", str(Path(root) / "common.pt"))

    t0 = time.monotonic()
    try:
        from_rank(fail, group, "reading common.pt on rank 1", src=1)
    except Exception as e:
        out["error"] = (type(e).__name__, str(e), getattr(e, "errno", None))
    out["error_s"] = time.monotonic() - t0
    out["after"] = from_rank(lambda: rank, group, "a value after the failure")  # from rank 0
    out["every"] = from_every_rank(lambda: rank * 10, group, "every rank's value")
    t0 = time.monotonic()
    try:
        from_every_rank(lambda: fail() if rank == 1 else rank, group, "writing common.pt on every rank")
    except Exception as e:
        out["every_error"] = (type(e).__name__, str(e))
    out["every_error_s"] = time.monotonic() - t0
    out["every_after"] = from_every_rank(lambda: rank, group, "every rank's value after the failure")
    import threading

    try:  # a value that cannot be pickled fails where it is made, and every rank hears of it
        from_rank(threading.Lock, group, "a lock", src=1)
    except Exception as e:
        out["unpicklable"] = type(e).__name__, str(e)
    out["unpicklable_after"] = from_rank(lambda: rank, group, "a value after the lock", src=1)

    def interrupted() -> None:
        raise KeyboardInterrupt

    # Ctrl-C on the computing rank: raised there as itself, a failure naming it on the others, the ranks in step after
    for name, call in (("interrupt", lambda: from_rank(interrupted, group, "reading on rank 1", src=1)),
                       ("every_interrupt", lambda: from_every_rank(lambda: interrupted() if rank == 1 else rank, group,
                                                                   "reading on every rank"))):
        try:
            call()
            out[name] = "returned"
        except KeyboardInterrupt:
            out[name] = "KeyboardInterrupt"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    out["interrupt_after"] = from_every_rank(lambda: rank, group, "every rank's value after the interrupts")
    return out


def test_from_rank_and_from_every_rank_give_every_rank_the_values_or_the_failure_at_once(run_ranks, tmp_path):
    results = run_ranks(2, rank_from_rank, str(tmp_path), timeout_s=120)
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors  # the same error on every rank
    kind, message, code = errors.pop()
    assert kind == "StorageIOError" and code == errno.EIO, (kind, code)
    assert "reading common.pt on rank 1" in message and "common.pt" in message, message
    for r in results:
        assert r["value"] == {"from": 1} and r["after"] == 0, r
        assert r["error_s"] < 20, r  # not the group's 60 s timeout
        assert r["every"] == [0, 10] and r["every_after"] == [0, 1], r
        assert r["every_error"][0] == "StorageIOError" and "writing common.pt on every rank" in r["every_error"][1], r
        assert r["every_error_s"] < 20, r
    assert results[0]["every_error"] == results[1]["every_error"]
    assert results[0]["unpicklable"] == results[1]["unpicklable"] and "a lock" in results[0]["unpicklable"][1]
    assert [r["unpicklable_after"] for r in results] == [1, 1]
    for key, what in (("interrupt", "reading on rank 1"), ("every_interrupt", "reading on every rank")):
        assert results[1][key] == "KeyboardInterrupt", results[1][key]
        assert results[0][key].startswith("Cpuckpt") and what in results[0][key] and "KeyboardInterrupt" in \
            results[0][key], results[0][key]
    assert [r["interrupt_after"] for r in results] == [[0, 1], [0, 1]]


def rank_agreement_among_one(_: int) -> tuple[bool, int, str, list]:
    """Agreements on a gloo group (cpuckpt's): (whether the group holds this rank alone, collectives made, the error
    a failure on rank 0 raised here, what from_rank, from_every_rank and gather_failures gave)."""
    import torch.distributed as dist

    from cpuckpt.backend.collectives import (
        agree_or_raise,
        checkpoint_group,
        from_every_rank,
        from_rank,
        gather_failures,
        peers,
    )
    from cpuckpt.errors import CpuckptError

    group = checkpoint_group()
    rank = dist.get_rank()
    with H.counting_collectives() as made:
        agree_or_raise(None, rank, group, "nothing failed")
        try:
            agree_or_raise(OSError(errno.ENOSPC, "No space left on device") if rank == 0 else None, rank, group,
                           "async save of /ckpt/step_1")
        except CpuckptError as e:
            message = str(e)
        else:
            message = ""
        values = [from_rank(lambda: f"rank {rank}'s", group, "a listing"),
                  from_every_rank(lambda: rank * 10, group, "the slots"), gather_failures(None, rank, group)]
    return peers(group) is None, sum(made.values()), message, values


def test_an_agreement_among_one_rank_makes_no_collective_and_raises_the_same_error(run_ranks):
    """A job of one process agrees with itself: no all-reduce (each costs ~0.2-0.4 ms, six or more per memory save
    every iteration), and a failure is raised as across two ranks, naming the rank and the save."""
    alone = run_ranks(1, rank_agreement_among_one, 1, timeout_s=60)
    two = run_ranks(2, rank_agreement_among_one, 2, timeout_s=60)
    assert alone[0][:2] == (True, 0) and alone[0][3] == ["rank 0's", [0], [None]]
    # two all-reduces, the failure's reports gathered, a broadcast, two all-gathers
    assert [r[:2] for r in two] == [(False, 6), (False, 6)]
    assert [r[3] for r in two] == [["rank 0's", [0, 10], [None, None]]] * 2
    for _, _, message, _ in alone + two:
        assert "async save of /ckpt/step_1" in message and "rank 0" in message and "No space left" in message, \
            message
