"""Memory images: reservation, reuse of the mapping, byte equality with the normal pipeline, persisting."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import _helpers as H
import crc32c
import pytest
import torch

from cpuckpt.config import Config
from cpuckpt.errors import CheckpointCorrupt, CpuckptError, IntegrityError, StagingError, StorageIOError
from cpuckpt.format.manifest import FileEntry
from cpuckpt.tier import images as images_mod
from cpuckpt.tier.imagecopy import persist_image
from cpuckpt.tier.images import CAPACITY_ROUND_BYTES, ImageFile, ImageSet
from cpuckpt.transfer import save_job as engine
from cpuckpt.transfer.save_job import SaveJob

CHUNK = 64 * 1024


def _cfg(**io) -> Config:
    return Config.from_dict({"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": "buffered", **io},
                             "layout": {"align_data_min_bytes": 16384}}, env=False)


def _state(scale: float = 1.0) -> list[object]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(300, 170, generator=g) * scale,  # ~200 KB: spans chunks, data aligned
        (torch.randn(999, generator=g) * scale).to(torch.bfloat16),
        torch.arange(17, dtype=torch.int64) * int(scale),
        torch.empty(0, 3),
        b"payload bytes \x00\x01" * 7,
        (torch.randn(64, 64, generator=g) * scale).t(),  # not contiguous
        torch.tensor(scale, dtype=torch.float64),
        torch.ones(5000, dtype=torch.uint8),
    ]


def _save_job(directory: Path, values, cfg, num_files=2):
    directory.mkdir(parents=True, exist_ok=True)
    names, files, sources = H.plan_layout(values, cfg, num_files)
    job = SaveJob(directory, names, files, sources, cfg, rank=0, mode="snapshot")
    job.start()
    return job.wait_done(30), names


def _image_job(directory: Path, values, cfg, images: ImageSet, *, rank=0, num_files=2):
    names, files, sources = H.plan_layout(values, cfg, num_files)
    job = H.memory_job(directory, names, files, sources, cfg, rank=rank, images=images)
    job.start()
    return job, names


# ---------------------------------------------------------------------------------------- ImageFile
def test_ensure_allocates_exact_size_and_reuses_the_mapping(tmp_path):
    img = ImageFile(tmp_path / "a.distcp", pin=False)
    try:
        assert (img.nbytes, img.capacity, img.remaps) == (0, 0, 0)
        n = 3 * 1024 * 1024 + 123
        img.ensure(n)
        st = os.stat(img.path)
        assert st.st_size == n and img.nbytes == n
        assert st.st_blocks * 512 >= n
        assert img.capacity >= n and img.capacity % CAPACITY_ROUND_BYTES == 0
        assert img.remaps == 1 and not img.pinned
        assert img.tensor().numel() == n and len(img.view()) == n

        img.tensor()[:1000] = torch.arange(1000) % 251
        img.view()[n - 3 :] = b"xyz"
        data = img.path.read_bytes()
        assert data[:1000] == bytes(i % 251 for i in range(1000)) and data[-3:] == b"xyz"

        img.ensure(n - 5000)  # smaller: same mapping, exact size
        assert os.stat(img.path).st_size == n - 5000 and img.remaps == 1
        img.ensure(n - 5000)  # same
        assert img.remaps == 1
        img.ensure(img.capacity)  # larger, up to the capacity: still the same mapping, allocated
        st = os.stat(img.path)
        assert st.st_size == img.capacity and st.st_blocks * 512 >= img.capacity and img.remaps == 1
        assert img.path.read_bytes()[:1000] == data[:1000]  # pages below the old end were kept

        img.ensure(img.capacity + 1)  # past the mapping: remapped
        assert img.remaps == 2 and os.stat(img.path).st_size == img.nbytes
        img.tensor()[-1] = 7
        assert img.path.read_bytes()[-1] == 7

        img.ensure(0)
        assert os.stat(img.path).st_size == 0 and img.tensor().numel() == 0 and img.remaps == 2
    finally:
        img.close()
    assert img.path.exists()  # close keeps the file
    img.close()  # idempotent


@pytest.mark.skipif(not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)), reason="no /dev/shm")
def test_on_tmpfs_shrink_and_regrow_allocate_every_page():
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="cpuckpt-test-") as d:
        img = ImageFile(Path(d) / "img", pin=False)
        try:
            n = 4 * CAPACITY_ROUND_BYTES - 1
            img.ensure(n)
            img.tensor().fill_(1)
            img.ensure(n // 3)  # pages past the end leave tmpfs
            assert os.stat(img.path).st_blocks * 512 < n // 2
            img.ensure(n)  # back: allocated again, zeros where pages were dropped, same mapping
            st = os.stat(img.path)
            assert st.st_size == n and st.st_blocks * 512 >= n and img.remaps == 1
            data = img.path.read_bytes()
            assert data[: n // 3] == b"\x01" * (n // 3) and data[-4096:] == bytes(4096)
            img.tensor()[-1] = 9
            assert img.path.read_bytes()[-1] == 9
        finally:
            img.close()


def test_reopen_existing_file_keeps_nothing_stale(tmp_path):
    path = tmp_path / "b"
    path.write_bytes(b"\xff" * (5 * 1024 * 1024))
    img = ImageFile(path, pin=False)
    try:
        assert img.nbytes == 5 * 1024 * 1024
        img.ensure(4096)
        assert os.stat(path).st_size == 4096 and img.remaps == 1
    finally:
        img.close()


def test_symlink_refused(tmp_path):
    (tmp_path / "target").write_bytes(b"")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(StorageIOError, match="link") as ei:
        ImageFile(tmp_path / "link", pin=False)
    assert ei.value.errno == errno.ELOOP


def test_enospc_at_reservation_names_path_and_bytes(tmp_path, monkeypatch):
    img = ImageFile(tmp_path / "full.distcp", pin=False)
    try:
        img.ensure(8192)
        img.tensor()[:] = 3

        def no_space(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(images_mod.os, "posix_fallocate", no_space)
        want = 3 * CAPACITY_ROUND_BYTES
        with pytest.raises(StorageIOError) as ei:
            img.ensure(want)
        err = ei.value
        assert str(img.path) in str(err) and str(want) in str(err) and "free" in str(err)
        assert err.errno == errno.ENOSPC and err.path == str(img.path) and err.nbytes == want
        # the image is left as it was: same size, same mapping, same bytes
        assert img.nbytes == 8192 and os.stat(img.path).st_size == 8192 and img.remaps == 1
        assert bool((img.tensor() == 3).all())
    finally:
        img.close()


def test_imageset_reuses_files(tmp_path):
    images = ImageSet(tmp_path / "ram" / "step_1", pin=False)
    try:
        a = images.image("a", 1000)
        b = images.image("b", 3 * CAPACITY_ROUND_BYTES)
        assert images.image("a", 900) is a and a.remaps == 1
        assert images.reserved_nbytes() == a.capacity + b.capacity == 4 * CAPACITY_ROUND_BYTES
        assert sorted(images.names) == ["a", "b"] and images.get("b") is b and images.get("c") is None
        assert os.stat(images.directory / "a").st_size == 900
    finally:
        images.close()
    assert images.reserved_nbytes() == 0


# ---------------------------------------------------------------------------------------- ImageJob
def test_image_job_bytes_equal_save_job(tmp_path):
    cfg = _cfg()
    entries, names = _save_job(tmp_path / "disk", _state(), cfg)
    images = ImageSet(tmp_path / "ram", pin=False)
    try:
        job, inames = _image_job(tmp_path / "ram", _state(), cfg, images)
        job.wait_staged(30)
        ientries = job.wait_done(30)
        assert inames == names and job.names == names
        assert job.staged.done() and job.stats.mode == "memory" and job.stats.backend == "image"
        assert job.stats.nbytes == sum(e.nbytes for e in entries) and job.started_at > 0
        assert job.stats.extra["image_remaps"] == len(names)  # first save: every file mapped once
        for e, ie in zip(entries, ientries):  # the same checksums as the disk path records (memory.checksum)
            assert (ie.name, ie.nbytes, ie.chunk_bytes, ie.checksum, ie.chunk_checksums) == (
                e.name, e.nbytes, CHUNK, "crc32c", e.chunk_checksums)
            assert (tmp_path / "ram" / e.name).read_bytes() == (tmp_path / "disk" / e.name).read_bytes()
        assert sum(len(e.chunk_checksums) for e in entries) > len(entries)  # several chunks
        remaps = [images.image(n, e.nbytes).remaps for n, e in zip(names, entries)]

        # the same structure with other values: the same mappings, the new bytes
        _save_job(tmp_path / "disk2", _state(3.0), cfg)
        job2, _ = _image_job(tmp_path / "ram", _state(3.0), cfg, images)
        job2.wait_done(30)
        assert [images.image(n, e.nbytes).remaps for n, e in zip(names, entries)] == remaps
        assert job2.stats.extra["image_remaps"] == 0
        for n, e2 in zip(names, job2.done.result()):
            new = (tmp_path / "ram" / n).read_bytes()
            assert new == (tmp_path / "disk2" / n).read_bytes()
            assert new != (tmp_path / "disk" / n).read_bytes()
            assert e2.chunk_checksums == [crc32c.crc32c(new[o : o + CHUNK]) for o in range(0, len(new), CHUNK)]
    finally:
        images.close()


def test_image_job_single_file_and_empty(tmp_path):
    cfg = _cfg()
    _save_job(tmp_path / "disk", _state(), cfg, num_files=1)
    images = ImageSet(tmp_path / "ram", pin=False)
    try:
        job, names = _image_job(tmp_path / "ram", _state(), cfg, images, num_files=1)
        job.wait_done(30)
        assert (tmp_path / "ram" / names[0]).read_bytes() == (tmp_path / "disk" / names[0]).read_bytes()
        job = H.memory_job(tmp_path / "ram", [], [], [], cfg, rank=0, images=images)
        job.start()
        assert job.wait_done(5) == [] and job.staged.done()
    finally:
        images.close()


def test_image_job_short_source_fails_naming_the_rank(tmp_path):
    cfg = _cfg()
    names, files, sources = H.plan_layout(_state(), cfg)
    sources[0] = sources[0][:-100]  # fewer bytes than its layout says
    images = ImageSet(tmp_path / "ram", pin=False)
    try:
        job = H.memory_job(tmp_path / "ram", names, files, sources, cfg, rank=3, images=images)
        job.start()
        with pytest.raises(StagingError, match="rank 3") as ei:
            job.wait_staged(30)
        assert str(tmp_path / "ram") in str(ei.value) and isinstance(ei.value.__cause__, StagingError)
        with pytest.raises(StagingError, match="rank 3"):
            job.wait_done(30)
        assert job.staged.exception() is job.done.exception()
    finally:
        images.close()


def test_image_job_fill_error_and_sync_error(tmp_path, monkeypatch):
    cfg = _cfg()
    images = ImageSet(tmp_path / "ram", pin=False)
    try:
        def boom(*a, **k):
            raise ValueError("boom")

        monkeypatch.setattr(engine, "fill_chunk", boom)
        job, _ = _image_job(tmp_path / "ram", _state(), cfg, images, rank=5)
        with pytest.raises(StagingError, match=r"rank 5.*boom") as ei:
            job.wait_done(30)
        assert isinstance(ei.value.__cause__, ValueError)
        monkeypatch.undo()

        # a synchronous failure (no space to reserve) is raised by start() and by both futures
        monkeypatch.setattr(images_mod.os, "posix_fallocate",
                            lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        grown = _state(2.0) + [torch.zeros(4 * CAPACITY_ROUND_BYTES, dtype=torch.uint8)]
        names, files, sources = H.plan_layout(grown, cfg)
        job = H.memory_job(tmp_path / "ram", names, files, sources, cfg, rank=6, images=images)
        with pytest.raises(StorageIOError, match="rank 6") as ei:
            job.start()
        assert ei.value.errno == errno.ENOSPC
        assert job.staged.exception() is ei.value and job.done.exception() is ei.value
    finally:
        images.close()


def test_image_job_cancel(tmp_path):
    cfg = _cfg()
    images = ImageSet(tmp_path / "ram", pin=False)
    try:
        names, files, sources = H.plan_layout(_state(), cfg)
        job = H.memory_job(tmp_path / "ram", names, files, sources, cfg, rank=0, images=images)
        job.cancel(CpuckptError("stop"))
        with pytest.raises(CpuckptError, match="stop"):
            job.wait_done(5)
        with pytest.raises(CpuckptError, match="stop"):
            job.start()
        job2, _ = _image_job(tmp_path / "ram", _state(), cfg, images)
        entries = job2.wait_done(30)
        job2.cancel(CpuckptError("too late"))  # after success: nothing changes
        assert job2.done.result() == entries
    finally:
        images.close()


# ---------------------------------------------------------------------------------------- persist_image
@pytest.mark.parametrize("backend", ["buffered", "auto"])
@pytest.mark.parametrize("size", [0, 1, CHUNK, 5 * CHUNK + 777])
def test_persist_image(tmp_path, backend, size):
    cfg = _cfg(backend=backend)
    src = tmp_path / "src.distcp"
    data = os.urandom(size)
    src.write_bytes(data)
    (tmp_path / "out").mkdir()
    entry = persist_image(src, tmp_path / "out" / "dst.distcp", cfg, threads=3)
    assert (tmp_path / "out" / "dst.distcp").read_bytes() == data
    assert (entry.name, entry.nbytes, entry.chunk_bytes, entry.checksum) == ("dst.distcp", size, CHUNK, "crc32c")
    assert entry.chunk_checksums == [crc32c.crc32c(data[o : o + CHUNK]) for o in range(0, size, CHUNK)]


def test_persist_image_matches_save_job_checksums(tmp_path):
    cfg = _cfg()
    entries, _ = _save_job(tmp_path / "disk", _state(), cfg)
    images = ImageSet(tmp_path / "ram", pin=False)
    try:
        job, _ = _image_job(tmp_path / "ram", _state(), cfg, images)
        job.wait_done(30)
        (tmp_path / "durable").mkdir()
        for e in entries:
            out = persist_image(tmp_path / "ram" / e.name, tmp_path / "durable" / e.name, cfg)
            assert out == e
            assert (tmp_path / "durable" / e.name).read_bytes() == (tmp_path / "disk" / e.name).read_bytes()
    finally:
        images.close()


def test_persist_image_no_checksum_and_missing_source(tmp_path):
    cfg = Config.from_dict({"io": {"chunk_bytes": CHUNK, "backend": "buffered"}, "integrity": {"checksum": "none"}},
                           env=False)
    src = tmp_path / "s"
    src.write_bytes(b"a" * (2 * CHUNK + 1))
    entry = persist_image(src, tmp_path / "d", cfg)
    assert entry.checksum == "none" and entry.chunk_checksums == [0, 0, 0]
    with pytest.raises(StorageIOError, match="missing"):
        persist_image(tmp_path / "missing", tmp_path / "d2", cfg)


def test_images_left_by_an_earlier_process_are_not_counted_again_by_the_space_check(tmp_path):
    grown: list[int] = []
    first = ImageSet(tmp_path, pin=False, before_grow=grown.append)
    first.image("__0_0.distcp", 3 << 20)
    first.close()
    assert grown == [3 << 20]
    again = ImageSet(tmp_path, pin=False, before_grow=grown.append)  # a restarted trainer
    again.image("__0_0.distcp", 3 << 20)
    again.image("__0_0.distcp", 5 << 20)
    again.close()
    assert grown[1:] == [(5 << 20) - (3 << 20)], grown  # only the growth is new


# ---------------------------------------------------------------------------------------- checksums of memory saves
def test_image_job_staged_before_its_checksums_are_done(tmp_path, monkeypatch):
    """``staged`` waits for the copies only; ``done`` (the memory commit) for every chunk's checksum too."""
    import threading

    gate, seen = threading.Event(), []

    real = engine.chunk_checksum

    def slow_checksum(kind, view):
        seen.append(threading.current_thread().name)
        assert gate.wait(30), "test gate never opened"
        return real(kind, view)

    monkeypatch.setattr(engine, "chunk_checksum", slow_checksum)
    cfg = _cfg()
    images = ImageSet(tmp_path / "ram", pin=False)
    try:
        job, _ = _image_job(tmp_path / "ram", _state(), cfg, images, rank=4)
        job.wait_staged(30)  # every copy ended although no checksum can finish
        assert not job.done.done()
        gate.set()
        entries = job.wait_done(30)
        assert seen and all(n.startswith("cpuckpt-io-4") for n in seen), seen
        for e in entries:
            data = (tmp_path / "ram" / e.name).read_bytes()
            assert e.checksum == "crc32c"
            assert e.chunk_checksums == [crc32c.crc32c(data[o : o + CHUNK]) for o in range(0, len(data), CHUNK)]
        assert job.stats.write_s >= job.stats.stage_s > 0
    finally:
        gate.set()
        images.close()


@pytest.mark.parametrize("settings", [{"memory": {"checksum": False}}, {"integrity": {"checksum": "none"}}])
def test_image_job_without_checksums(tmp_path, settings):
    cfg = Config.from_dict({"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": "buffered"}, **settings}, env=False)
    images = ImageSet(tmp_path / "ram", pin=False)
    try:
        job, _ = _image_job(tmp_path / "ram", _state(), cfg, images)
        for e in job.wait_done(30):
            assert (e.checksum, e.chunk_checksums) == ("none", [])
    finally:
        images.close()


def _memory_entry(src: Path) -> FileEntry:
    data = src.read_bytes()
    return FileEntry(name=src.name, nbytes=len(data), chunk_bytes=CHUNK, checksum="crc32c",
                     chunk_checksums=[crc32c.crc32c(data[o : o + CHUNK]) for o in range(0, len(data), CHUNK)])


def test_persist_image_verifies_the_memory_checksums(tmp_path):
    cfg = _cfg()
    src = tmp_path / "src.distcp"
    src.write_bytes(os.urandom(5 * CHUNK + 777))
    expect = _memory_entry(src)
    (tmp_path / "out").mkdir()
    out = persist_image(src, tmp_path / "out" / "ok.distcp", cfg, expect=expect)
    assert out.chunk_checksums == expect.chunk_checksums and (tmp_path / "out" / "ok.distcp").read_bytes() == \
        src.read_bytes()

    with open(src, "r+b") as f:  # one RAM page damaged after the memory commit
        f.seek(3 * CHUNK + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CheckpointCorrupt, match=r"chunk 3\).*not persisted") as ei:
        persist_image(src, tmp_path / "out" / "bad.distcp", cfg, expect=expect)
    assert isinstance(ei.value, IntegrityError) and str(src) in str(ei.value)

    short = FileEntry(name=src.name, nbytes=expect.nbytes - 1, chunk_bytes=CHUNK, checksum="crc32c",
                      chunk_checksums=expect.chunk_checksums)
    with pytest.raises(CheckpointCorrupt, match="memory manifest says"):
        persist_image(src, tmp_path / "out" / "short.distcp", cfg, expect=short)
    assert not (tmp_path / "out" / "short.distcp").exists()  # refused before the destination is opened
    few = FileEntry(name=src.name, nbytes=expect.nbytes, chunk_bytes=CHUNK, checksum="crc32c",
                    chunk_checksums=expect.chunk_checksums[:-1])
    with pytest.raises(CheckpointCorrupt, match="5 chunk checksums for 6 chunks"):
        persist_image(src, tmp_path / "out" / "few.distcp", cfg, expect=few)
    # a memory checkpoint saved without checksums: nothing to compare, the copy goes through
    none = FileEntry(name=src.name, nbytes=expect.nbytes, chunk_bytes=CHUNK, checksum="none", chunk_checksums=[])
    out = persist_image(src, tmp_path / "out" / "unchecked.distcp", cfg, expect=none)
    assert out.checksum == "crc32c" and (tmp_path / "out" / "unchecked.distcp").read_bytes() == src.read_bytes()


def test_persist_image_passes_a_fault_point_per_chunk(tmp_path):
    from cpuckpt import faultpoint
    from cpuckpt.testing import faults

    cfg = _cfg()
    src = tmp_path / "src.distcp"
    src.write_bytes(os.urandom(4 * CHUNK))
    (tmp_path / "out").mkdir()
    stages: list[str] = []
    previous = faultpoint.set_handler(stages.append)
    try:
        persist_image(src, tmp_path / "out" / "a.distcp", cfg)
        assert sorted(stages) == [f"persist-chunk:a.distcp:{k}" for k in range(4)]
        # the stage actions alone: install()/uninstall() would also drop the fault: backends that other
        # test modules installed at import
        faultpoint.set_handler(faults.StageActions("persist-chunk:b.distcp:2=raise"))
        with pytest.raises(RuntimeError, match=r"persist-chunk:b\.distcp:2"):
            persist_image(src, tmp_path / "out" / "b.distcp", cfg)
    finally:
        faultpoint.set_handler(previous)


def test_child_env_installs_the_stage_actions_in_a_fresh_interpreter(tmp_path):
    import subprocess
    import sys

    from cpuckpt.testing import faults

    env = {**os.environ, **faults.child_env(tmp_path / "site", "x:1=raise")}
    code = "from cpuckpt import faultpoint; print(faultpoint.get_handler())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "StageActions('x:1=raise')", out.stderr
