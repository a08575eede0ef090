"""Regressions found in review; each docstring is the bug report."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cpuckpt
from cpuckpt.testing import faults

faults.install()  # io.backend "fault:EIO@fsync"

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
    from cpuckpt.tools.verification import verify_checkpoint

    report = verify_checkpoint(path)  # as a stock checkpoint: the stale manifest is not checked against it
    assert report.ok and report.kind == "dcp", (report.kind, report.damage)


def test_storage_io_error_keeps_its_fields_across_ranks():
    """DCP pickles a rank's exception to the others; StorageIOError lost errno, path and offset."""
    import pickle

    e = cpuckpt.StorageIOError("pwrite failed on /ck/__1_0.distcp", path="/ck/__1_0.distcp", offset=4096,
                               nbytes=65536, errno_=28)
    back = pickle.loads(pickle.dumps(e))
    assert isinstance(back, cpuckpt.StorageIOError) and isinstance(back, OSError)
    assert (back.errno, back.path, back.offset, back.nbytes, str(back)) == (28, e.path, 4096, 65536, str(e))


def test_garbage_metadata_is_corrupt_missing_metadata_is_incomplete(tmp_path):
    """Issue: garbage metadata must raise CheckpointCorrupt; a missing one means 'not committed'."""
    cpuckpt.save({"a": torch.arange(4)}, tmp_path / "ck")
    (tmp_path / "ck" / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(cpuckpt.CheckpointCorrupt, match=r"\.metadata"):
        cpuckpt.load({"a": torch.zeros(4, dtype=torch.int64)}, tmp_path / "ck")
    (tmp_path / "ck" / ".metadata").unlink()
    with pytest.raises(cpuckpt.IntegrityError, match="did not complete") as info:
        cpuckpt.load({"a": torch.zeros(4, dtype=torch.int64)}, tmp_path / "ck")
    assert not isinstance(info.value, cpuckpt.CheckpointCorrupt)


def test_sampled_verification_checks_a_share_of_chunks(tmp_path):
    """integrity.verify: sample — a flipped chunk is caught by some loads and all of 'always' loads."""
    path = tmp_path / "ck"
    cfg = {"io": {"chunk_bytes": "4KiB"}}
    cpuckpt.save({"a": torch.arange(64 * 1024, dtype=torch.int32)}, path, cfg)  # 256 KiB: 64+ chunks
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100_000] ^= 0xFF
    data.write_bytes(bytes(raw))
    target = {"a": torch.zeros(64 * 1024, dtype=torch.int32)}
    with pytest.raises(cpuckpt.CheckpointCorrupt):
        cpuckpt.load(target, path, {**cfg, "integrity": {"verify": "always"}})
    caught = 0
    for _ in range(40):
        try:
            cpuckpt.load(target, path, {**cfg, "integrity": {"verify": "sample", "sample_fraction": 0.5}})
        except cpuckpt.CheckpointCorrupt:
            caught += 1
    assert 5 <= caught <= 35, caught  # ~20 expected; p(outside) < 1e-5
    cpuckpt.load(target, path, {**cfg, "integrity": {"verify": "off"}})  # off: loads the damaged bytes


def test_async_saves_into_one_directory_never_commit_a_mix_of_two(tmp_path):
    """With ``async.max_in_flight: 2``, a second save into the directory of one still in flight cleared its commit
    and rewrote its files; the first save's commit then named the second's bytes. When the second died before its
    own commit, the directory was listed complete and loaded the wrong values (verify: checksum mismatches)."""
    import threading

    from cpuckpt import faultpoint
    from cpuckpt.backend.committed import check_complete

    cfg = {"io": {"chunk_bytes": "1MiB", "threads": 2, "backend": "buffered"}, "timeout_s": 60,
           "async": {"max_in_flight": 2}}
    d = tmp_path / "last"
    commits: list[int] = []
    lock = threading.Lock()

    def second_dies(stage: str) -> None:
        if stage == "before-rename:.cpuckpt.json":
            with lock:
                commits.append(len(commits) + 1)
                if len(commits) == 2:
                    raise RuntimeError("the second save dies before its commit")

    faultpoint.set_handler(second_dies)
    try:
        h1 = cpuckpt.async_save({"w": torch.full((1 << 20,), 1.0)}, d, cfg, step=1)
        h2 = cpuckpt.async_save({"w": torch.full((1 << 20,), 2.0)}, d, cfg, step=2)
        h1.wait()
        with pytest.raises(cpuckpt.CpuckptError, match="dies before its commit"):
            h2.wait()
    finally:
        faultpoint.set_handler(None)
    assert not check_complete(d).complete  # the second save had cleared the first's commit: nothing is named
    assert cpuckpt.find_latest(tmp_path) is None
    h3 = cpuckpt.async_save({"w": torch.full((1 << 20,), 3.0)}, d, cfg, step=3)
    h4 = cpuckpt.async_save({"w": torch.full((1 << 20,), 4.0)}, d, cfg, step=4)
    h3.wait()
    h4.wait()
    out = {"w": torch.zeros(1 << 20)}
    cpuckpt.load(out, d, cfg)
    assert check_complete(d).step == 4 and bool((out["w"] == 4.0).all())


def test_a_commit_whose_directory_fsync_fails_is_withdrawn_not_listed(tmp_path):
    """``.metadata`` was renamed into place, then the fsync of its directory failed: the save raised
    StorageIOError, yet its checkpoint stood committed, and ``find_latest`` returned a save reported failed."""
    root = tmp_path / "root"
    cpuckpt.save({"w": torch.arange(100)}, root / "step_1", step=1)
    faults.install("fsync-dir:.metadata=eio")
    try:
        with pytest.raises(cpuckpt.StorageIOError, match=r"step_2.*\.metadata|\.metadata.*step_2"):
            cpuckpt.save({"w": torch.arange(100) + 2}, root / "step_2", step=2)
    finally:
        faults.install("")
    assert cpuckpt.find_latest(root) == root / "step_1"
    assert not (root / "step_2" / ".metadata").exists()
    assert [c.path.name for c in cpuckpt.list_checkpoints(root) if c.complete] == ["step_1"]
    cpuckpt.save({"w": torch.arange(100) + 2}, root / "step_2", step=2)  # the path works again
    assert cpuckpt.find_latest(root) == root / "step_2"


def test_a_read_still_running_after_a_timed_out_load_never_writes_into_the_callers_tensors(tmp_path):
    """After a load timed out, a read still in its ``pread`` went on: the load had already closed the descriptor,
    so the read went to whatever file the caller opened next under that number, and its bytes were scattered into
    the caller's tensors seconds after ``load`` had raised."""
    import os
    import threading

    from cpuckpt.transfer import files

    release = threading.Event()

    stalled = threading.Event()

    class StalledDisk(files.BufferedFileBackend):  # the first read stalls until the test lets it go
        name = "stalled"

        def pread_into(self, fd, buf, offset, path):
            if not stalled.is_set():
                stalled.set()
                release.wait(30)
            return super().pread_into(fd, buf, offset, path)

    files.register_backend("stalled", StalledDisk)
    try:
        cfg = {"io": {"backend": "stalled", "read_threads": 1, "chunk_bytes": "64KiB"},
               "integrity": {"verify": "sample", "sample_fraction": 0.0}, "timeout_s": 1}  # chunks read, unchecked
        cpuckpt.save({"w": torch.full((1000,), 3.0)}, tmp_path / "ck", {"io": {"backend": "buffered"}})
        fds_before = len(os.listdir("/proc/self/fd"))
        target = {"w": torch.zeros(1000)}
        with pytest.raises(cpuckpt.CheckpointTimeoutError):
            cpuckpt.load(target, tmp_path / "ck", cfg)
        decoy = tmp_path / "decoy"
        decoy.write_bytes(torch.full((20000,), 7.0).numpy().tobytes())
        with open(decoy, "rb"):  # takes the lowest free descriptor number: the read's, had the load closed it
            release.set()
            deadline = time.monotonic() + 30
            while any(t.name.startswith("cpuckpt-read") for t in threading.enumerate()):
                assert time.monotonic() < deadline, "the stalled read never ended"
                time.sleep(0.05)
        assert torch.equal(target["w"], torch.zeros(1000)), target["w"].unique()
        assert len(os.listdir("/proc/self/fd")) == fds_before  # closed once the last read ended
    finally:
        release.set()
        files.unregister_backend("stalled")


def test_a_planner_destination_of_another_shape_is_refused_not_reshaped(tmp_path):
    """A custom planner's ``resolve_tensor`` returning a destination of the same element count but another shape
    was filled silently (reshaped; a stock record was broadcast): ``FileSystemReader`` refuses it (mismatch sizes)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    cpuckpt.save({"w": torch.arange(8.0).reshape(2, 4)}, tmp_path / "ck")
    dest = torch.zeros(8)

    class Transposing(DefaultLoadPlanner):
        def resolve_tensor(self, read_item):
            return dest.view(4, 2)

    with pytest.raises(cpuckpt.CpuckptError, match=r"'w' at \(0, 0\) has shape \(4, 2\).*\(2, 4\) \(mismatch sizes\)"):
        cpuckpt.load({"w": torch.zeros(2, 4)}, tmp_path / "ck", planner=Transposing())
    assert torch.equal(dest, torch.zeros(8))


def test_a_cpuckpt_checkpoint_whose_manifest_is_gone_is_damaged_not_a_stock_one(tmp_path):
    """With ``.cpuckpt.json`` deleted, a cpuckpt checkpoint loaded as stock DCP: no checksums, no warning, under
    ``verify: always``; a flipped byte loaded as a value, and ``load_latest`` picked it over the sound older one."""
    from click.testing import CliRunner

    from cpuckpt.tools.cli import cli

    root = tmp_path / "root"
    for step in (1, 2):
        cpuckpt.save({"w": torch.full((1000,), float(step))}, root / f"step_{step}", step=step)
    (data,) = (root / "step_2").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[raw.index(torch.full((4,), 2.0).numpy().tobytes()) + 1] ^= 0x10
    data.write_bytes(bytes(raw))
    (root / "step_2" / ".cpuckpt.json").unlink()

    with pytest.raises(cpuckpt.CheckpointCorrupt, match=r"manifest \.cpuckpt\.json is missing"):
        cpuckpt.load({"w": torch.zeros(1000)}, root / "step_2")
    assert cpuckpt.find_latest(root) == root / "step_1"
    out = {"w": torch.zeros(1000)}
    assert cpuckpt.load_latest(out, root) == root / "step_1"
    assert torch.equal(out["w"], torch.full((1000,), 1.0))
    res = CliRunner().invoke(cli, ["verify", str(root / "step_2")])
    assert res.exit_code == 1 and "manifest .cpuckpt.json is missing" in res.output, res.output
    loose = {"w": torch.zeros(1000)}  # the way to read it anyway, knowingly
    cpuckpt.load(loose, root / "step_2", {"integrity": {"verify": "off"}})
    assert not torch.equal(loose["w"], torch.full((1000,), 2.0))  # the flipped byte: what a checksum would have caught
