"""Background saves on 2 real gloo ranks: ``cpuckpt.async_save`` and the ``dcp.async_save`` door.

What is proven, with real files and no mocks (every comparison is on byte views):

- snapshot mode: once ``handle.staged.wait()`` (door: ``staging_completion``) returned, every rank
  may overwrite every saved tensor (and a non-tensor value); the committed checkpoint still holds
  the values from before, through stock ``FileSystemReader`` and ``cpuckpt.load``;
- streaming mode (``staging.pool_bytes`` smaller than the shard: a pool of 4 x 64 KiB chunks for a
  shard of several MiB) is bit-exact, and the door refuses such a pool with a ``ConfigError``;
- a write failure on rank 1 only fails ``handle.wait()`` on *both* ranks promptly, naming rank 1
  and its file, commits nothing, and the next save succeeds;
- the in-flight bound: with ``max_in_flight: 1`` a second call returns only once the first is
  committed, and an error of a save nobody waited for is raised by that next call; with
  ``max_in_flight: 2`` two saves overlap, stay isolated and commit in call order;
- a rank that dies (or freezes) after ``async_save`` makes the survivor's ``wait()`` raise within
  about ``timeout_s``, and the survivor's committer thread ends too;
- DCP's PROCESS async mode is refused with an error that says so, and the refused attempt leaves
  the process's host pool usable (later saves are bit-exact through stock DCP).

A rank that exits on purpose makes the harness raise its ``RankError`` (an ``AssertionError``)
naming that rank; those tests catch it and check the surviving rank's result in ``.results``.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import _helpers as H
import pytest
import torch

from cpuckpt.testing import faults

faults.install()  # io.backend "fault:...", in this process and in every rank (they load this module)

CHUNK_BYTES = 64 * 1024

# (name, full shape, dtype, shard dim or None for Replicate)
DTENSORS = [
    ("dt_big_f32", (600, 257), torch.float32, 0),  # 617 KB: ~5 chunks per rank
    ("dt_s1_bf16", (64, 1030), torch.bfloat16, 1),  # 132 KB, strided shards
    ("dt_small_i32", (9, 5), torch.int32, 0),  # uneven: 5 + 4 rows
    ("dt_rep_f16", (10, 11), torch.float16, None),
]
# 8 MiB, 4 MiB per rank: 64 chunks, vs a streaming pool of 4 chunks.
HUGE = ("dt_huge_f32", (2048, 1024), torch.float32, 0)
PLAIN = [
    ("plain_big_f32", (300, 301), torch.float32),  # 361 KB: several chunks
    ("plain_bf16", (5, 7), torch.bfloat16),
    ("plain_i64", (3,), torch.int64),
    ("plain_bool", (4, 3), torch.bool),
    ("plain_f8", (17, 3), torch.float8_e4m3fn),
    ("zerodim_f64", (), torch.float64),
]
OBJECTS = {"step": 5, "meta": {"name": "run-\u03b1", "lr": 0.25}}


def _cfg(*, pool: str | int = 0, in_flight: int = 1, backend: str = "buffered", timeout_s: float = 20) -> dict:
    """``pool`` is ``staging.pool_bytes``: 0 snapshots, a size smaller than the shard streams."""
    return {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": backend}, "staging": {"pool_bytes": pool},
            "async": {"max_in_flight": in_flight}, "timeout_s": timeout_s}


def _placements(dim):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate()] if dim is None else [Shard(dim)]


def _specs(huge: bool) -> list:
    return [*DTENSORS, HUGE] if huge else list(DTENSORS)


def _full(name: str, shape, dtype, seed: int, mutated: bool) -> torch.Tensor:
    full = H.make_full(name, shape, dtype, seed)
    return H.poison(full) if mutated else full


def _state_dict(mesh, seed: int, *, huge: bool = False, poisoned: bool = False) -> dict:
    """The saved state dict (values from ``seed``), or a poisoned destination to load into."""
    sd: dict = {}
    for name, shape, dtype, dim in _specs(huge):
        sd[name] = H.make_dtensor(H.make_full(name, shape, dtype, seed), mesh, _placements(dim), poisoned=poisoned)
    for name, shape, dtype in PLAIN:
        full = H.make_full(name, shape, dtype, seed)
        sd[name] = H.poison(full) if poisoned else full.clone()
    if poisoned:
        sd["step"] = -99
        sd["meta"] = {"name": "destination", "lr": -1.0}
    else:
        sd["step"] = OBJECTS["step"]
        sd["meta"] = dict(OBJECTS["meta"])
    return sd


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _mutate(sd: dict) -> None:
    """Overwrite every byte of every saved tensor in place, and the non-tensor values."""
    with torch.no_grad():
        for v in sd.values():
            if isinstance(v, torch.Tensor):
                loc = _local(v)
                loc.copy_(H.poison(loc))
    sd["step"] = -1
    sd["meta"]["name"] = "mutated"  # in place, in the nested dict


def _check(sd: dict, mesh, seed: int, what: str, *, huge: bool = False, mutated: bool = False) -> None:
    """``sd`` holds the values of ``seed`` (every byte flipped if ``mutated``), bit-exact."""
    for name, shape, dtype, dim in _specs(huge):
        H.assert_dtensor(sd[name], _full(name, shape, dtype, seed, mutated), mesh, _placements(dim),
                         f"{what}: {name}")
    for name, shape, dtype in PLAIN:
        H.assert_bitexact(sd[name], _full(name, shape, dtype, seed, mutated), f"{what}: {name}")
    if mutated:
        assert sd["step"] == -1 and sd["meta"] == {"name": "mutated", "lr": 0.25}, (what, sd["step"], sd["meta"])
    else:
        assert sd["step"] == OBJECTS["step"] and sd["meta"] == OBJECTS["meta"], (what, sd["step"], sd["meta"])


def _assert_all_changed(sd: dict, mesh, seed: int, *, huge: bool = False) -> None:
    """Sanity check of the test itself: the in-place mutation really reached every tensor."""
    _check(sd, mesh, seed, "mutated source", huge=huge, mutated=True)


def _load_both(path: Path, mesh, seed: int, what: str, *, huge: bool = False, mutated: bool = False) -> None:
    """Load ``path`` with stock DCP and with cpuckpt into poisoned destinations; compare bit-exact."""
    import torch.distributed.checkpoint as dcp

    import cpuckpt

    dest = _state_dict(mesh, seed, huge=huge, poisoned=True)
    dcp.load(dest, storage_reader=dcp.FileSystemReader(str(path)))
    _check(dest, mesh, seed, f"{what}, stock FileSystemReader", huge=huge, mutated=mutated)
    dest = _state_dict(mesh, seed, huge=huge, poisoned=True)
    cpuckpt.load(dest, path)
    _check(dest, mesh, seed, f"{what}, cpuckpt.load", huge=huge, mutated=mutated)


def _mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _error_info(e: BaseException, t0: float) -> dict:
    return {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
            "seconds": time.monotonic() - t0}


def _manifest(path: Path) -> dict:
    return json.loads((path / ".cpuckpt.json").read_text())


# ---------------------------------------------------------------------------------- 1. snapshot


def rank_snapshot_mutation(root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    import cpuckpt
    from cpuckpt.backend.committed import is_complete

    mesh = _mesh()
    root_p = Path(root)
    cfg = _cfg()  # pool_bytes 0: snapshot
    out: dict = {}

    # cpuckpt.async_save
    path = root_p / "api"
    sd = _state_dict(mesh, seed=1)
    h = cpuckpt.async_save(sd, path, cfg, step=7)
    assert isinstance(h, cpuckpt.AsyncSaveHandle)
    h.staged.wait()
    assert h.staged.done()
    _mutate(sd)
    _assert_all_changed(sd, mesh, seed=1)
    h.wait()
    assert h.done() and is_complete(path)
    out["api_mode"] = h.stats.mode
    out["api_nbytes"] = h.stats.nbytes
    dist.barrier()
    _load_both(path, mesh, 1, "async_save snapshot")

    # the dcp.async_save door
    path = root_p / "door"
    sd = _state_dict(mesh, seed=2)
    resp = dcp.async_save(sd, storage_writer=cpuckpt.StorageWriter(path, cfg))
    assert isinstance(resp, AsyncSaveResponse), type(resp)
    resp.staging_completion.result(timeout=20)
    _mutate(sd)
    _assert_all_changed(sd, mesh, seed=2)
    resp.upload_completion.result(timeout=30)
    assert is_complete(path)
    dist.barrier()
    _load_both(path, mesh, 2, "dcp.async_save door")
    dist.barrier()
    return out


@pytest.mark.timeout(90)
def test_snapshot_mutation_after_staged_is_not_saved(run_ranks, tmp_path):
    root = tmp_path / "ckpts"
    results = run_ranks(2, rank_snapshot_mutation, str(root), timeout_s=60)
    for rank, out in enumerate(results):
        assert out["api_mode"] == "snapshot", (rank, out)
        assert out["api_nbytes"] > 4 * CHUNK_BYTES, (rank, out)
    for name in ("api", "door"):
        H.assert_committed_layout(root / name, world=2)
    assert _manifest(root / "api")["step"] == 7


# --------------------------------------------------------------------------------- 2. streaming


def rank_streaming(root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import cpuckpt
    import cpuckpt.transfer.staging

    mesh = _mesh()
    root_p = Path(root)
    cfg = _cfg(pool="256KiB")  # 4 chunks of 64 KiB, smaller than the shard: streaming
    out: dict = {}

    path = root_p / "streamed"
    sd = _state_dict(mesh, seed=3, huge=True)
    h = cpuckpt.async_save(sd, path, cfg)
    out["mode"] = h.stats.mode
    out["nbytes"] = h.stats.nbytes
    h.staged.wait()
    _mutate(sd)  # staged means copied, in streaming mode too
    _assert_all_changed(sd, mesh, seed=3, huge=True)
    h.wait()
    from cpuckpt.transfer.staging import pool_state

    out["pool_nbytes"] = pool_state()[0] or None
    dist.barrier()
    _load_both(path, mesh, 3, "async_save streaming", huge=True)

    # The door stages before planning: it cannot stream, and says so.
    try:
        resp = dcp.async_save(_state_dict(mesh, seed=3), storage_writer=cpuckpt.StorageWriter(root_p / "door", cfg))
    except cpuckpt.ConfigError as e:
        out["door_error"] = str(e)
    else:
        try:
            resp.staging_completion.result(timeout=20)
            resp.upload_completion.result(timeout=20)
        except cpuckpt.ConfigError as e:
            out["door_error"] = str(e)
        else:
            raise AssertionError("dcp.async_save with a staging.pool_bytes smaller than the shard succeeded")
    dist.barrier()
    return out


@pytest.mark.timeout(90)
def test_streaming_through_small_pool(run_ranks, tmp_path):
    root = tmp_path / "ckpts"
    results = run_ranks(2, rank_streaming, str(root), timeout_s=60)
    for rank, out in enumerate(results):
        assert out["mode"] == "streaming", (rank, out)
        assert out["nbytes"] >= 4 * 1024 * 1024, (rank, out)
        assert out["pool_nbytes"] is not None and out["pool_nbytes"] <= 4 * CHUNK_BYTES, (rank, out)
        msg = out["door_error"]
        assert "streaming" in msg and "dcp.async_save" in msg, (rank, msg)
    H.assert_committed_layout(root / "streamed", world=2)
    assert not (root / "door" / ".metadata").exists()


# ------------------------------------------------------------------------------ 3. write failure


def rank_write_failure(root: str) -> dict:
    import torch.distributed as dist

    import cpuckpt
    from cpuckpt.backend.committed import is_complete

    rank = dist.get_rank()
    mesh = _mesh()
    root_p = Path(root)
    good = _cfg(timeout_s=20)
    bad = _cfg(backend="fault:ENOSPC@100000", timeout_s=20)
    out: dict = {}
    sd = _state_dict(mesh, seed=4)

    failed = root_p / "failed"
    t0 = time.monotonic()
    h = cpuckpt.async_save(sd, failed, bad if rank == 1 else good)
    try:
        h.wait()
    except cpuckpt.CpuckptError as e:
        out["error"] = _error_info(e, t0)
        out["is_timeout"] = isinstance(e, cpuckpt.CheckpointTimeoutError)
    else:
        raise AssertionError(f"rank {rank}: async save to {failed} succeeded although rank 1's writes fail")
    assert h.done()
    dist.barrier()
    out["complete"] = is_complete(failed)
    out["listing"] = H.checkpoint_listing(failed)

    # The failure is over: the next save, to another directory, commits on both ranks.
    after = root_p / "after"
    h2 = cpuckpt.async_save(sd, after, good)
    h2.wait()
    dist.barrier()
    _load_both(after, mesh, 4, "save after a failed one")
    dist.barrier()
    return out


def _names_rank1_enospc(msg: str) -> bool:
    return ("rank 1" in msg and "__1_0.distcp" in msg
            and ("errno 28" in msg or os.strerror(errno.ENOSPC) in msg or "ENOSPC" in msg))


@pytest.mark.timeout(90)
def test_write_failure_on_one_rank_fails_wait_everywhere(run_ranks, tmp_path):
    root = tmp_path / "ckpts"
    results = run_ranks(2, rank_write_failure, str(root), timeout_s=60)
    for rank, out in enumerate(results):
        info = out["error"]
        assert not out["is_timeout"], (rank, info)
        assert _names_rank1_enospc(info["message"]), (rank, info)
        assert info["seconds"] < 8, (rank, info)  # timeout_s is 20: the failure is reported, not waited out
        assert not out["complete"] and ".metadata" not in out["listing"], (rank, out["listing"])
        assert ".cpuckpt.json" not in out["listing"], (rank, out["listing"])
    assert not (root / "failed" / ".metadata").exists()
    H.assert_committed_layout(root / "after", world=2)


# ------------------------------------------------------------------------------ 4. in flight


def rank_in_flight_one(root: str) -> dict:
    import torch.distributed as dist

    import cpuckpt
    from cpuckpt.backend.committed import is_complete

    rank = dist.get_rank()
    mesh = _mesh()
    root_p = Path(root)
    cfg = _cfg(in_flight=1)
    out: dict = {}
    sd = _state_dict(mesh, seed=5)

    # The bound: the second call waits for the first save's commit.
    p1, p2 = root_p / "one_1", root_p / "one_2"
    h1 = cpuckpt.async_save(sd, p1, cfg)
    out["h1_done_before_second_call"] = h1.done()
    h2 = cpuckpt.async_save(sd, p2, cfg)
    out["p1_metadata_when_second_returned"] = (p1 / ".metadata").exists()
    out["h1_done_when_second_returned"] = h1.done()
    h2.wait()
    h1.wait()  # already committed: returns at once
    dist.barrier()
    _load_both(p1, mesh, 5, "first of two saves (max_in_flight 1)")
    _load_both(p2, mesh, 5, "second of two saves (max_in_flight 1)")

    # A failed save that nobody waited for is raised by the next call that has to wait for it.
    pa, pb, pc = root_p / "unwaited_fail", root_p / "blocked", root_p / "recovered"
    bad = _cfg(in_flight=1, backend="fault:ENOSPC@100000")
    cpuckpt.async_save(sd, pa, bad if rank == 1 else cfg)  # handle dropped on purpose
    t0 = time.monotonic()
    try:
        cpuckpt.async_save(sd, pb, cfg)
    except cpuckpt.CpuckptError as e:
        out["next_call_error"] = _error_info(e, t0)
    else:
        raise AssertionError(f"rank {rank}: async_save after an unwaited failed save did not raise its error")
    dist.barrier()
    out["pa_complete"] = is_complete(pa)
    out["pb_complete"] = is_complete(pb)
    hc = cpuckpt.async_save(sd, pc, cfg)
    hc.wait()
    dist.barrier()
    _load_both(pc, mesh, 5, "save after the raised unwaited failure")
    dist.barrier()
    return out


@pytest.mark.timeout(90)
def test_in_flight_one_blocks_and_raises_unwaited_error(run_ranks, tmp_path):
    root = tmp_path / "ckpts"
    results = run_ranks(2, rank_in_flight_one, str(root), timeout_s=60)
    for rank, out in enumerate(results):
        assert out["p1_metadata_when_second_returned"], (rank, out)
        assert out["h1_done_when_second_returned"], (rank, out)
        info = out["next_call_error"]
        assert str(root / "unwaited_fail") in info["message"], (rank, info)
        assert _names_rank1_enospc(info["message"]), (rank, info)
        assert info["seconds"] < 8, (rank, info)
        assert not out["pa_complete"] and not out["pb_complete"], (rank, out)
    for name in ("one_1", "one_2", "recovered"):
        H.assert_committed_layout(root / name, world=2)


def rank_in_flight_two(root: str) -> dict:
    import torch.distributed as dist

    import cpuckpt

    mesh = _mesh()
    root_p = Path(root)
    cfg = _cfg(in_flight=2)
    out: dict = {}
    sd = _state_dict(mesh, seed=6)

    p3, p4 = root_p / "two_a", root_p / "two_b"
    h3 = cpuckpt.async_save(sd, p3, cfg, step=3)
    h3.staged.wait()
    _mutate(sd)  # the second save holds the mutated values
    h4 = cpuckpt.async_save(sd, p4, cfg, step=4)
    out["both_pending_after_second_call"] = not h3.done() and not h4.done()  # timing-dependent: info only
    h4.staged.wait()
    _mutate(sd)  # flips every byte back: neither checkpoint may see this
    h4.wait()  # waited in the reverse order
    h3.wait()
    assert h3.done() and h4.done()
    out["modes"] = [h3.stats.mode, h4.stats.mode]
    dist.barrier()
    _load_both(p3, mesh, 6, "first of two in-flight saves")
    _load_both(p4, mesh, 6, "second of two in-flight saves", mutated=True)
    dist.barrier()
    return out


@pytest.mark.timeout(90)
def test_in_flight_two_overlap_and_commit_in_order(run_ranks, tmp_path):
    root = tmp_path / "ckpts"
    results = run_ranks(2, rank_in_flight_two, str(root), timeout_s=60)
    for rank, out in enumerate(results):
        assert out["modes"] == ["snapshot", "snapshot"], (rank, out)
    a, b = root / "two_a", root / "two_b"
    for p in (a, b):
        H.assert_committed_layout(p, world=2)
    ma, mb = _manifest(a), _manifest(b)
    assert (ma["step"], mb["step"]) == (3, 4)
    assert ma["created_unix"] < mb["created_unix"], (ma["created_unix"], mb["created_unix"])
    assert (a / ".metadata").stat().st_mtime_ns <= (b / ".metadata").stat().st_mtime_ns


# ------------------------------------------------------------------------------ 5. dead rank

DEAD_TIMEOUT_S = 5


def _survivor_wait(h, path: Path) -> dict:
    """Rank 0's side: ``wait()`` must raise, and the committer thread must end too."""
    import cpuckpt

    out: dict = {}
    t0 = time.monotonic()
    try:
        h.wait()
    except cpuckpt.CpuckptError as e:  # CheckpointTimeoutError included
        out["error"] = _error_info(e, t0)
    else:
        raise AssertionError("rank 0: wait() succeeded although rank 1 never committed")
    # The committer thread itself must end (bounded gloo collectives), not only the waiter.
    deadline = time.monotonic() + 2 * DEAD_TIMEOUT_S + 5
    while not h.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    out["handle_done_s"] = time.monotonic() - t0 if h.done() else None
    out["metadata"] = (path / ".metadata").exists()
    return out


def _survivor_result(excinfo) -> dict:
    results = getattr(excinfo.value, "results", None)
    assert results is not None, f"not the harness's RankError: {excinfo.value}"
    assert results[1]["type"] == "RankDied", results[1]
    assert results[0]["ok"], f"rank 0 failed: {results[0]['type']}: {results[0]['message']}\n" \
        f"{results[0].get('traceback', '')}"
    return results[0]["value"]


def _assert_survivor_bounded(out: dict, path: Path) -> None:
    info = out["error"]
    # wait() gives up after timeout_s (CheckpointTimeoutError), or the commit collective fails the
    # handle (at once for a dead peer, after the gloo timeout, timeout_s too, for a frozen one).
    assert info["seconds"] < DEAD_TIMEOUT_S + 5, info
    assert out["handle_done_s"] is not None and out["handle_done_s"] < 2 * DEAD_TIMEOUT_S + 5, out
    assert not out["metadata"]
    assert not (path / ".metadata").exists()


def _hold_part_of_rank1(root: str) -> None:
    """In rank 1 (which dies or freezes with its save in flight): its manifest part waits for a file never made (a
    fault point, cpuckpt.testing.faults; it would give up after faults.WAIT_LIMIT_S), so no commit has it."""
    faults.install(f"before-rename:__1_.cpuckpt-part.json=wait:{Path(root) / 'never-made'}")


def rank_dead_peer(root: str) -> dict:
    import torch.distributed as dist

    import cpuckpt

    rank = dist.get_rank()
    mesh = _mesh()
    path = Path(root) / "orphan"
    if rank == 1:
        _hold_part_of_rank1(root)  # its save cannot commit before it exits, however slow this rank is
    sd = _state_dict(mesh, seed=7, huge=True)  # 4 MiB a rank
    h = cpuckpt.async_save(sd, path, _cfg(timeout_s=DEAD_TIMEOUT_S))
    if rank == 1:
        os._exit(0)  # dies with its save in flight: no wait, no commit collectives, no result
    return _survivor_wait(h, path)


@pytest.mark.timeout(90)
def test_dead_rank_fails_survivors_wait(run_ranks, tmp_path):
    root = tmp_path / "ckpts"
    # The harness raises its RankError (an AssertionError) for rank 1, which exited without a
    # result; rank 0's own result, kept in the error's ``results``, is checked here.
    with pytest.raises(AssertionError) as excinfo:
        run_ranks(2, rank_dead_peer, str(root), timeout_s=60)
    out = _survivor_result(excinfo)
    assert "exit code 0" in excinfo.value.results[1]["message"], excinfo.value.results[1]
    _assert_survivor_bounded(out, root / "orphan")


def rank_hung_peer(root: str) -> dict:
    """Rank 1 is frozen (SIGSTOP) with its save in flight: alive, but it never joins a collective."""
    import signal

    import torch.distributed as dist

    import cpuckpt

    rank = dist.get_rank()
    pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    mesh = _mesh()
    path = Path(root) / "frozen"
    if rank == 1:
        _hold_part_of_rank1(root)  # its save cannot commit before it stops, however slow this rank is
    sd = _state_dict(mesh, seed=9, huge=True)  # 4 MiB a rank
    h = cpuckpt.async_save(sd, path, _cfg(timeout_s=DEAD_TIMEOUT_S))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops, the committer included
        time.sleep(3600)
    try:
        return _survivor_wait(h, path)
    finally:
        os.kill(pids[1], signal.SIGKILL)


@pytest.mark.timeout(90)
def test_hung_rank_fails_survivors_wait_within_timeout(run_ranks, tmp_path):
    root = tmp_path / "ckpts"
    with pytest.raises(AssertionError) as excinfo:  # rank 1 is SIGKILLed by rank 0 at the end
        run_ranks(2, rank_hung_peer, str(root), timeout_s=60)
    _assert_survivor_bounded(_survivor_result(excinfo), root / "frozen")


# ------------------------------------------------------------------------------ 6. PROCESS mode


def _process_mode_attempt(sd: dict, path: Path) -> dict:
    """``dcp.async_save`` in PROCESS mode with our writer must fail; describe how."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import cpuckpt

    writer = cpuckpt.StorageWriter(path, _cfg())
    err: BaseException | None = None
    t0 = time.monotonic()
    try:
        resp = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    except BaseException as e:
        err = e
        where = "call"
    else:
        where = "upload_completion"
        fut = getattr(resp, "upload_completion", resp)
        try:
            fut.result(timeout=60)
        except BaseException as e:
            err = e
    if err is None:
        raise AssertionError("dcp.async_save in PROCESS mode with cpuckpt.StorageWriter succeeded")
    writer.close()
    out = _error_info(err, t0)
    out["where"] = where
    out["is_cpuckpt_error"] = isinstance(err, cpuckpt.CpuckptError)
    out["metadata"] = (path / ".metadata").exists()
    return out


def rank_process_mode(root: str) -> dict:
    """The realistic state dict: DTensors, several tensors, non-tensor values."""
    import torch.distributed as dist

    out = _process_mode_attempt(_state_dict(_mesh(), seed=8), Path(root) / "process_mode")
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_dcp_process_mode_is_refused(run_ranks, tmp_path):
    results = run_ranks(2, rank_process_mode, str(tmp_path / "ckpts"), timeout_s=90)
    for rank, out in enumerate(results):
        assert "PROCESS" in out["message"], (rank, out)
        assert out["is_cpuckpt_error"], (rank, out)
        assert not out["metadata"], (rank, out)


def rank_process_mode_then_save(root: str) -> dict:
    """One plain tensor (the refusal is reached), then ordinary saves in the same process."""
    import torch.distributed as dist

    import cpuckpt

    mesh = _mesh()
    root_p = Path(root)
    out = _process_mode_attempt({"w": H.make_full("w", (1000,), torch.float32), "step": 1},
                                root_p / "process_mode")
    dist.barrier()
    # The refused attempt must leave this process's host pool intact: the next saves are bit-exact
    # through stock DCP (cpuckpt.load reads through the same pool, so it alone could not tell).
    path = root_p / "after_sync"
    cpuckpt.save(_state_dict(mesh, seed=10), path, _cfg())
    _load_both(path, mesh, 10, "cpuckpt.save after a refused PROCESS-mode attempt")
    path = root_p / "after_async"
    h = cpuckpt.async_save(_state_dict(mesh, seed=11), path, _cfg(pool="256KiB"))
    h.wait()
    dist.barrier()
    _load_both(path, mesh, 11, "streaming async_save after a refused PROCESS-mode attempt")
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_dcp_process_mode_refusal_leaves_pool_intact(run_ranks, tmp_path):
    results = run_ranks(2, rank_process_mode_then_save, str(tmp_path / "ckpts"), timeout_s=90)
    for rank, out in enumerate(results):
        assert "PROCESS" in out["message"] and out["is_cpuckpt_error"], (rank, out)


def test_ended_within_returns_when_the_save_ends_not_before(tmp_path):
    """``AsyncSaveHandle.ended_within``: a bounded wait for the end of a save (a blocking finalize's pause between
    two looks); False while its commit is held, True once it ends, and it raises nothing."""
    import cpuckpt
    from cpuckpt import faultpoint
    from cpuckpt.testing.faults import StageActions

    go = tmp_path / "go"
    previous = faultpoint.set_handler(StageActions(f"before-rename:.metadata=wait:{go}"))
    try:
        h = cpuckpt.async_save({"w": torch.arange(64.0)}, tmp_path / "step_1", {"io": {"backend": "buffered"}})
        assert not h.ended_within(0.3) and not h.done()  # its commit waits for the file
        go.touch()
        assert h.ended_within(60) and h.done()
        h.wait()
    finally:
        faultpoint.set_handler(previous)
    assert cpuckpt.find_latest(tmp_path) == tmp_path / "step_1"
