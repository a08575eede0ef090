"""The memory tier's copy process (``memory.copy_process``): a save's checksums (and, on a GPU with a device
snapshot, its copies: tests/gpu/test_copy_process_gpu.py) computed by a process of ours, not the trainer's.

Single trainer process, real RAM-root files, a real copy process (``python -m cpuckpt.tier.copier``).
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import crc32c
import pytest
import torch

import cpuckpt
from cpuckpt.backend.committed import read_manifest
from cpuckpt.errors import CheckpointCorrupt, CpuckptError
from cpuckpt.format.checksums import blocksum32
from cpuckpt.testing.faults import flip_byte
from cpuckpt.tier import copier, pinning
from cpuckpt.tier import memory as memory_module
from cpuckpt.tier.images import ImageFile
from cpuckpt.tier.memory import MemoryTier


def _cfg(tmp_path: Path, **memory: object) -> dict:
    return {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 60,
            "memory": {"root": str(tmp_path / "ram"), "persist_every": 0, "slots": 2, "headroom_bytes": 0,
                       "copy_process": True, **memory}}


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 257, generator=g), "b": torch.randn(77, generator=g).to(torch.bfloat16),
            "step": step}


def _check(path: Path, step: int) -> None:
    """The checkpoint at ``path`` holds ``step``'s values, and every chunk's recorded crc32c is its bytes'."""
    out = {"w": torch.empty(300, 257), "b": torch.empty(77, dtype=torch.bfloat16), "step": -1}
    cpuckpt.load(out, path)
    want = _state(step)
    assert out["step"] == step and torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])
    manifest = read_manifest(path)
    checked = 0
    for entry in manifest.files.values():
        data = (path / entry.name).read_bytes()
        assert entry.checksum == "crc32c" and len(entry.chunk_checksums) == -(-len(data) // entry.chunk_bytes)
        for k, crc in enumerate(entry.chunk_checksums):
            assert crc == crc32c.crc32c(data[k * entry.chunk_bytes : (k + 1) * entry.chunk_bytes]), (entry.name, k)
            checked += 1
    assert checked > 1


@pytest.mark.parametrize("kind", ["crc32c", "auto"])
def test_memory_saves_are_checksummed_by_the_copy_process_and_load_bit_exact(tmp_path, kind):
    """``checksum_kind: auto`` (the default) without a GPU (no device snapshot to sum) records crc32c."""
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, checksum_kind=kind))
    try:
        assert tier.copier is not None
        for step in (1, 2, 3):
            tier.save(_state(step), step).wait()
            pid = tier.copier.pid
            assert pid is not None and pid != os.getpid()
            _check(tier.find_latest(), step)
        assert tier.copier.pid == pid, "one copy process serves every save"
    finally:
        tier.close(persist_newest=False)
    assert tier.copier.pid is None, "close() ends the copy process"


@pytest.mark.parametrize("copy_process", [True, False])
def test_blocksum32_memory_checkpoints_record_each_chunks_sum_and_a_changed_byte_fails_the_load(tmp_path,
                                                                                                  copy_process):
    """``memory.checksum_kind: blocksum32`` on the CPU: the whole chunks summed by the copy process (or the trainer's
    threads without one); a byte changed in RAM after the commit fails the load, naming the chunk."""
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, checksum_kind="blocksum32", copy_process=copy_process))
    try:
        for step in (1, 2):
            tier.save(_state(step), step).wait()
        latest = tier.find_latest()
        out = {"w": torch.empty(300, 257), "b": torch.empty(77, dtype=torch.bfloat16), "step": -1}
        cpuckpt.load(out, latest)
        assert out["step"] == 2 and torch.equal(out["w"], _state(2)["w"])
        (entry,) = read_manifest(latest).files.values()
        data = (latest / entry.name).read_bytes()
        assert entry.checksum == "blocksum32" and len(entry.chunk_checksums) == -(-len(data) // entry.chunk_bytes) > 1
        assert entry.chunk_checksums == [blocksum32(data[k : k + entry.chunk_bytes])
                                         for k in range(0, len(data), entry.chunk_bytes)]
        flip_byte(latest / entry.name, entry.chunk_bytes + 999, 0x01)
        with pytest.raises(CheckpointCorrupt, match="chunk 1"):
            cpuckpt.load(out, latest)
    finally:
        tier.close(persist_newest=False)


def test_without_checksums_the_copy_process_records_none(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, checksum=False))
    try:
        tier.save(_state(1), 1).wait()
        (entry,) = read_manifest(tier.find_latest()).files.values()
        assert entry.checksum == "none" and entry.chunk_checksums == []
    finally:
        tier.close(persist_newest=False)


def test_a_copy_process_killed_during_a_save_fails_it_naming_the_process_and_the_next_save_starts_another(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path))
    try:
        tier.save(_state(1), 1).wait()
        pid = tier.copier.pid
        os.kill(pid, signal.SIGSTOP)  # it holds the next save without answering
        handle = tier.save(_state(2), 2)
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(CpuckptError, match=rf"copy process \(pid {pid}\) exited with status -9"):
            handle.wait()
        assert tier.find_latest() is not None and _check(tier.find_latest(), 1) is None, "the failed save is listed"
        tier.save(_state(3), 3).wait()
        assert tier.copier.pid not in (None, pid)
        _check(tier.find_latest(), 3)
    finally:
        tier.close(persist_newest=False)


def test_an_image_describes_the_smallest_size_it_had_since_its_last_description(tmp_path):
    img = ImageFile(tmp_path / "f", pin=False)
    try:
        img.ensure(100_000)
        path, owner, nbytes, intact = img.describe()
        assert (path, nbytes, intact) == (str(tmp_path / "f"), 100_000, 0), "made from nothing: no page was there"
        img.ensure(100_000)
        assert img.describe() == (path, owner, 100_000, 100_000), "a save of the same size keeps every registration"
        img.ensure(50_000)
        img.ensure(120_000)  # both between two descriptions: the pages past 50,000 are new
        assert img.describe() == (path, owner, 120_000, 50_000)
        assert img.describe()[3] == 120_000
        img.ensure(10 << 20)  # past the mapping: mapped anew, the pages below the old size stay
        assert img.describe() == (path, owner, 10 << 20, 120_000)
        other = ImageFile(tmp_path / "f", pin=False)
        assert other.describe()[1] != owner, "another object: the copy process maps the file anew"
        other.close()
    finally:
        img.close()


def _smaps_of_mapping(address: int) -> dict[str, int]:
    """The ``/proc/self/smaps`` sizes (bytes) of the mapping starting at ``address``: ``Rss`` (pages this process's
    page tables map), ``Private_Dirty`` (of those, written through this mapping), ..."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            sizes = {}
            for entry in lines[i + 1:]:
                name, _, rest = entry.partition(":")
                if not rest.strip().endswith("kB"):
                    break
                sizes[name] = int(rest.split()[0]) * 1024
            return sizes
    raise AssertionError(f"no mapping starts at {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_populate_maps_a_ranges_pages_for_writing_without_changing_its_bytes(tmp_path):
    """What the copy process does before each registration: the segment's pages are in its page tables afterwards,
    faulted for writing (so ``cudaHostRegister``, which pins them writable, faults none), split over the pool's
    threads, the file's bytes as they were. A range it refuses (past the file's end) or a pool that takes no work
    skips it without turning it off."""
    import ctypes
    import mmap

    nbytes = 3 * pinning.POPULATE_PIECE_MIN_BYTES + 2 * pinning.PAGE  # the range: three pieces
    data = os.urandom(nbytes)
    path = tmp_path / "image"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    os.fsync(fd)  # the pages clean: only a write fault makes them dirty again
    mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    anchor = ctypes.c_char.from_buffer(mapped)
    try:
        address = ctypes.addressof(anchor)
        assert _smaps_of_mapping(address)["Rss"] == 0, "a fresh mapping has no pages mapped yet"
        pieces = []

        class Pool(concurrent.futures.ThreadPoolExecutor):
            def map(self, fn, *iterables, **kwargs):
                offsets = list(iterables[0])
                pieces.extend(offsets)
                return super().map(fn, offsets, **kwargs)

        with Pool(3) as pool:
            done = pinning.populate(address + pinning.PAGE, nbytes - 2 * pinning.PAGE, pool, parts=3)
        if not done and pinning._populate_works is False:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE")
        assert done and len(pieces) == 3, f"split over the pool's threads: {pieces}"
        # (the kernel may map a few neighbours of what it faults in too)
        sizes = _smaps_of_mapping(address)
        assert sizes["Rss"] >= nbytes - 2 * pinning.PAGE, f"the range's pages are mapped: {sizes}"
        assert sizes["Private_Dirty"] >= nbytes - 2 * pinning.PAGE, f"faulted for writing, not reading: {sizes}"
        assert not pinning.populate(address, 0, None, parts=1), "nothing to do"
        assert pinning.populate(address + 100, pinning.PAGE, None, parts=1), "from the page an unaligned start is in"

        kept = nbytes - 2 * pinning.PAGE
        os.ftruncate(fd, kept)  # the mapping's last two pages now lie past the file's end
        assert not pinning.populate(address + kept - pinning.PAGE, 3 * pinning.PAGE, None, parts=1), \
            "pages past the file's end are refused (the registration reports them)"
        refusing = concurrent.futures.ThreadPoolExecutor(2)
        refusing.shutdown()
        assert not pinning.populate(address, kept, refusing, parts=2), "a pool that takes no work: skipped"
        assert pinning._populate_works is True, "neither turned it off"
        assert pinning.populate(address, kept, None, parts=1)
        assert mapped[:kept] == data[:kept]
    finally:
        del anchor
        mapped.close()
        os.close(fd)


def test_registrations_are_kept_only_while_their_pages_stayed_in_the_file():
    seg = pinning.segment_bytes(4 << 20)
    assert seg == 64 << 20 and pinning.segment_bytes(48 << 20) == 96 << 20, "whole chunks, at least 64 MiB"
    reserved = dict(pinning.segments(200 << 20, seg))
    assert reserved == {0: 64 << 20, 64 << 20: 64 << 20, 128 << 20: 64 << 20, 192 << 20: 8 << 20}
    first_save = pinning.segments(150 << 20, seg)
    # a first save smaller than the reservation: only the segments reaching past it go
    assert pinning.stale(reserved, first_save, 150 << 20) == [128 << 20, 192 << 20]
    # the same size again: nothing
    kept = {o: n for o, n in reserved.items() if o + n <= 128 << 20} | {128 << 20: 22 << 20}
    assert pinning.stale(kept, first_save, 150 << 20) == []
    # shrunk to 50 MiB and grown back to 150 between two messages: everything past 50 MiB's pages goes
    assert pinning.stale(kept, first_save, 50 << 20) == [0, 64 << 20, 128 << 20]
    # a size that is not a page multiple keeps the page it ends in
    assert pinning.stale({0: pinning.PAGE}, [(0, pinning.PAGE)], 1) == []
    assert pinning.segments(0, seg) == [] and pinning.segments(1, seg) == [(0, pinning.PAGE)]
    assert pinning.segments(200 << 20, seg, mapped=100 << 20) == [(0, 64 << 20), (64 << 20, 36 << 20)]


_CHECKSUM_ONLY = """
import sys, crc32c
from cpuckpt.tier import copier
path = sys.argv[1]
img = copier._Mapped(path, "owner", 3 << 20)
assert img.fit(3 << 20, 64 << 20, pin=False) == (0, 0, 1)
with img.view()[: 1 << 20] as v:
    print(crc32c.crc32c(v))
img.close()
print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
"""


def test_a_checksum_only_copy_process_never_imports_torch(tmp_path):
    """Without a device snapshot and nothing to pin (every CPU job), the copy process maps and checksums only: it
    imports no torch (~1 CPU-s and ~250 MB at every start of one)."""
    path = tmp_path / "image"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    out = subprocess.run([sys.executable, "-c", _CHECKSUM_ONLY, str(path)], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == [str(crc32c.crc32c(data[: 1 << 20])), "[]"], out.stdout + out.stderr


def _prepare(worker: copier._Worker, files: list, chunk_bytes: int, device: int | None) -> None:
    """A prepare message, then the idle time in which the process pins what it asks for."""
    worker.prepare(files, chunk_bytes, device)
    while worker.to_prepare:
        worker.prepare_next()


def test_a_stale_description_still_drops_what_it_reports(tmp_path, monkeypatch):
    """The copy process applies a message's ``intact`` first (a prepare describing a size the file no longer has),
    so a later message, which reports only what happened after, is enough; a prepare maps the file as it is."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # registrations made up below, none real
    img = ImageFile(tmp_path / "f", pin=False)
    worker = copier._Worker(None, 1)
    try:
        img.ensure(3 << 20)
        _prepare(worker, [img.describe()], 1 << 20, None)
        held = worker.images[str(img.path)]
        held._regs = {0: 2 << 20, 2 << 20: 1 << 20}  # as if pinned in two segments
        img.ensure(1 << 20)
        stale_desc = img.describe()
        img.ensure(3 << 20)  # resized again before the process read the description above
        _prepare(worker, [stale_desc], 1 << 20, None)
        assert held._regs == {}, "both segments reach past 1 MiB, the smallest the file was"
        assert worker.images[str(img.path)] is held and held.nbytes == 3 << 20, "prepared at its size now"
        held._regs = {0: 3 << 20}  # pinned at the prepare: the one segment of 3 MiB (64 MiB segments)
        _prepare(worker, [img.describe()], 1 << 20, None)
        assert held._regs == {}, "it grew past 1 MiB since the description the process last read: pinned again"
        held._regs = {0: 3 << 20}
        _prepare(worker, [img.describe()], 1 << 20, None)
        assert held._regs == {0: 3 << 20}, "nothing changed since: the registration stays"
    finally:
        worker.close()
        img.close()


def test_an_image_removed_from_the_ram_root_is_let_go_of_at_the_next_message(tmp_path):
    reserved, used = ImageFile(tmp_path / "unused", pin=False), ImageFile(tmp_path / "used", pin=False)
    worker = copier._Worker(None, 1)
    try:
        reserved.ensure(1 << 20)
        used.ensure(1 << 20)
        _prepare(worker, [reserved.describe(), used.describe()], 1 << 20, None)
        assert set(worker.images) == {str(reserved.path), str(used.path)}
        reserved.path.unlink()  # what ImageSet.drop_unclaimed does to a reserved image no save claimed
        _prepare(worker, [used.describe()], 1 << 20, None)
        assert set(worker.images) == {str(used.path)}, "its pages stay allocated while the process maps the file"
    finally:
        worker.close()
        reserved.close()
        used.close()


@pytest.mark.parametrize("copy_process, snapshot, sent", [(True, True, 2), (True, False, 0), (False, True, 0)])
def test_reserved_images_go_to_the_copy_process_only_when_it_copies_into_them(tmp_path, monkeypatch,
                                                                             copy_process, snapshot, sent):
    cfg = _cfg(tmp_path, copy_process=copy_process)
    cfg["staging"] = {"device_snapshot": snapshot}
    tier = MemoryTier(tmp_path / "durable", cfg)
    try:
        prepared: list = []
        if tier.copier is not None:
            monkeypatch.setattr(tier.copier, "prepare", lambda files, chunk, device: prepared.extend(files()))
        assert tier.reserve(1 << 20) == 2
        assert len(prepared) == sent
        assert all(d[2] == 1 << 20 for d in prepared), prepared
    finally:
        tier.close(persist_newest=False)


def test_a_message_naming_a_class_is_refused():
    msg = ("save", 1, [("p", "o", 3, 3)], [(0, 0, 3)], 64, "crc32c", None, False)
    assert copier._loads(copier._dumps(msg))[0] == "save"
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        copier._loads(pickle.dumps(("save", torch.device("cpu"))))


class _SlowCudart:
    """Stands in for CUDA's registration in the process's main loop (no GPU here): each segment takes a while."""

    def __init__(self) -> None:
        self.registered = 0

    def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:
        time.sleep(0.1)
        self.registered += 1
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        return 0


class _GatedCudart:
    """Stands in for CUDA's registration in the process's main loop (no GPU here): the first segment's registration
    (``pinning`` once it began) ends once the save is in the process's inbox, every later one once the close is:
    the main loop looks at its inbox only between segments, so the save comes while a segment is being pinned and
    is there to be answered at the next chance, and nothing is registered while the test looks at what the save
    waited for."""

    def __init__(self) -> None:
        self.registered = 0
        self.pinning = threading.Event()
        self.save_queued = threading.Event()
        self.close_queued = threading.Event()

    def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:
        self.pinning.set()
        gate = self.save_queued if self.registered == 0 else self.close_queued
        gate.wait(10)  # not forever: a loop that never answers fails on the test's own bounds
        self.registered += 1
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        return 0


def test_a_save_is_answered_between_segments_of_the_images_pinned_ahead_and_close_ends_the_process(tmp_path,
                                                                                                    monkeypatch):
    """The process's main loop (``main``, over a socket pair, in a thread here): images asked for ahead are pinned a
    segment at a time while no message waits, a save that comes meanwhile is answered first, and ``close`` ends it
    with prepares still pending."""
    import socket

    cudart = _GatedCudart()

    class Inbox(queue.SimpleQueue):  # the main loop's inbox: tells the cudart above what arrived
        def put(self, item, block=True, timeout=None):
            super().put(item, block, timeout)
            kind = copier._loads(item)[0] if item is not None else None
            {"save": cudart.save_queued, "close": cudart.close_queued}.get(kind, threading.Event()).set()

    monkeypatch.setattr(copier, "queue", types.SimpleNamespace(SimpleQueue=Inbox))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(pinning, "populate", lambda *a, **k: False)  # the files stay sparse
    ahead = []
    for i in range(2):  # 4 segments of 64 MiB each, sparse (nothing is really pinned)
        path = tmp_path / f"ahead{i}"
        path.touch()
        os.truncate(path, 256 << 20)
        ahead.append((str(path), f"owner{i}", 256 << 20, 256 << 20))
    small = tmp_path / "small"
    small.write_bytes(b"x" * 1000)
    ours, theirs = socket.socketpair()
    loop = threading.Thread(target=copier.main, args=(["--fd", str(theirs.detach())],), daemon=True)
    loop.start()
    conn = copier.Connection(ours.detach())
    try:
        conn.send_bytes(copier._dumps(("prepare", ahead, 1 << 20, None)))
        assert cudart.pinning.wait(10), "the images asked for ahead were never pinned"
        conn.send_bytes(copier._dumps(("save", 7, [(str(small), "o", 1000, 1000)], [(0, 0, 1000)], 1 << 20,
                                       "crc32c", None, False)))
        assert conn.poll(5), "no reply to the save"
        kind, save_id, crcs = copier._loads(conn.recv_bytes())
        assert (kind, save_id, crcs) == ("done", 7, [[crc32c.crc32c(b"x" * 1000)]])
        assert cudart.registered < 8, f"the save waited for every segment ahead ({cudart.registered})"
        conn.send_bytes(copier._dumps(("close",)))
        loop.join(10)
        assert not loop.is_alive(), "close with prepares pending did not end the process"
        assert cudart.registered < 8
    finally:
        cudart.save_queued.set()  # nothing waits on after the test
        cudart.close_queued.set()
        conn.close()


def test_a_wait_for_the_images_pinned_ahead_is_answered_once_every_segment_is_registered(tmp_path, monkeypatch):
    """The process's main loop answers ``ready`` only after the last segment of the images asked for ahead (what the
    memory tier's reservation waits for before the job trains), and at once when nothing is asked for."""
    import socket
    import threading

    cudart = _SlowCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(pinning, "populate", lambda *a, **k: False)  # the files stay sparse
    ahead = []
    for i in range(2):  # 2 x 2 segments of 64 MiB, sparse
        path = tmp_path / f"ahead{i}"
        path.touch()
        os.truncate(path, 128 << 20)
        ahead.append((str(path), f"owner{i}", 128 << 20, 128 << 20))
    ours, theirs = socket.socketpair()
    loop = threading.Thread(target=copier.main, args=(["--fd", str(theirs.detach())],), daemon=True)
    loop.start()
    conn = copier.Connection(ours.detach())
    try:
        conn.send_bytes(copier._dumps(("ready", 3)))
        assert conn.poll(5) and copier._loads(conn.recv_bytes()) == ("ready", 3)
        assert cudart.registered == 0
        conn.send_bytes(copier._dumps(("prepare", ahead, 1 << 20, None)))
        conn.send_bytes(copier._dumps(("ready", 4)))
        assert conn.poll(10), "no answer to the wait"
        assert copier._loads(conn.recv_bytes()) == ("ready", 4)
        assert cudart.registered == 4, f"answered with {cudart.registered} of 4 segments registered"
        conn.send_bytes(copier._dumps(("close",)))
        loop.join(10)
        assert not loop.is_alive()
    finally:
        conn.close()


def test_the_reservation_waits_for_the_copy_process_to_pin_the_images(tmp_path, monkeypatch):
    """``reserve`` returns once the copy process answered the wait (a real process; no GPU here, so it pins
    nothing and answers at once); a process that died meanwhile is a warning, not a failure of the job."""
    cfg = _cfg(tmp_path, copy_process=True)
    cfg["staging"] = {"device_snapshot": True}
    tier = MemoryTier(tmp_path / "durable", cfg)
    try:
        assert tier.copier is not None
        waits: list = []
        real = tier.copier.wait_prepared

        def spy(timeout_s: float) -> bool:
            waits.append(real(timeout_s))
            return waits[-1]

        monkeypatch.setattr(tier.copier, "wait_prepared", spy)
        assert tier.reserve(1 << 20) == 2
        assert waits == [True], "the reservation did not wait for the copy process"
        assert tier.copier.pid is not None
    finally:
        tier.close(persist_newest=False)


@pytest.mark.parametrize("outcome", ["late", "dead"])
def test_a_reservation_whose_pins_do_not_end_warns_and_lets_the_job_train(tmp_path, monkeypatch, caplog, outcome):
    """Pins that do not end within the bound (sized from the images: 30 s + 2 s per GB), or a copy process that died,
    are a warning: the reservation returns its images and the first saves pin what is missing."""
    cfg = _cfg(tmp_path, copy_process=True)
    cfg["staging"] = {"device_snapshot": True}
    tier = MemoryTier(tmp_path / "durable", cfg)
    try:
        assert tier.copier is not None
        bounds: list[float] = []

        def wait(timeout_s: float) -> bool:
            bounds.append(timeout_s)
            if outcome == "dead":
                raise CpuckptError("the copy process (pid 1) exited")
            return False

        monkeypatch.setattr(tier.copier, "wait_prepared", wait)
        with caplog.at_level("WARNING", logger="cpuckpt.tier.memory"):
            assert tier.reserve(1 << 30) == 2
        assert bounds and bounds[0] == pytest.approx(30.0 + 2.0 * 2 * (1 << 30) / 1e9)
        assert ("had not pinned the 2 reserved image(s)" if outcome == "late" else "exited") in caplog.text
    finally:
        tier.close(persist_newest=False)


def test_a_wait_for_pinning_fails_when_the_copy_process_dies(tmp_path):
    proc = copier.CopyProcess(0, tmp_path / "copier.log", threads=1, timeout_s=30)
    try:
        assert proc.wait_prepared(1.0), "with no process running there is nothing to wait for"
        proc.start()
        os.kill(proc.pid, signal.SIGSTOP)  # it cannot answer
        assert proc.wait_prepared(0.5) is False
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(CpuckptError, match="exited"):
            proc.wait_prepared(30)
    finally:
        proc.close()


def test_a_message_not_sent_after_its_images_were_described_ends_the_process_and_the_next_starts_anew(tmp_path,
                                                                                                     monkeypatch):
    proc = copier.CopyProcess(0, tmp_path / "copier.log", threads=1, timeout_s=30)
    img = ImageFile(tmp_path / "img", pin=False)
    try:
        img.ensure(4096)
        img.view()[:] = b"y" * 4096
        proc.start()
        first = proc.pid
        real = copier._dumps

        def fail_saves(msg: tuple) -> bytes:
            if msg[0] == "save":
                raise OSError("interrupted")
            return real(msg)

        monkeypatch.setattr(copier, "_dumps", fail_saves)
        with pytest.raises(CpuckptError, match="interrupted"):
            proc.submit(lambda: [img.describe()], [(0, 0, 4096)], chunk_bytes=4096, checksum="crc32c")
        monkeypatch.setattr(copier, "_dumps", real)
        remote = proc.submit(lambda: [img.describe()], [(0, 0, 4096)], chunk_bytes=4096, checksum="crc32c")
        assert remote.done.result(timeout=30) == [[crc32c.crc32c(b"y" * 4096)]], "the new process's save is its own"
        assert proc.pid not in (None, first), "the process that missed a description was ended"
    finally:
        proc.close()
        img.close()


def _torch_loaded(pid: int) -> bool:
    """Whether process ``pid`` has torch's C library mapped (it imported torch)."""
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_a_copy_process_that_will_copy_snapshots_imports_torch_before_any_message(tmp_path, monkeypatch):
    """On a CUDA machine a tier that copies device snapshots starts its copy process warm: torch imported (and, with
    CUDA in use, the trainer's device made ready) as it starts, not at the first image it pins, inside the job's wait
    before training. Without CUDA, or without a device snapshot, it only ever checksums: no torch (the import costs it
    seconds and hundreds of MB). Here CUDA is said to be available but not in use: torch only."""
    snap = {"staging": {"device_snapshot": True}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (on a GPU machine too)
    no_cuda = MemoryTier(tmp_path / "durable-nocuda", _cfg(tmp_path / "nocuda") | snap)
    try:
        assert no_cuda.copier is not None and no_cuda.copier.warm_device is None
    finally:
        no_cuda.close(persist_newest=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    warm = MemoryTier(tmp_path / "durable-warm", _cfg(tmp_path / "warm") | snap)
    try:
        cold = MemoryTier(tmp_path / "durable-cold", _cfg(tmp_path / "cold"))
    except BaseException:
        warm.close(persist_newest=False)
        raise
    try:
        in_use = memory_module.caller_device()  # None on the CPU box; a GPU machine's earlier tests may have used it
        assert warm.copier is not None and warm.copier.warm_device == (-1 if in_use is None else in_use)
        assert cold.copier is not None and cold.copier.warm_device is None
        deadline = time.monotonic() + 60
        while not _torch_loaded(warm.copier.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        log_path = warm.copier.log_path
        assert _torch_loaded(warm.copier.pid), log_path.read_text()
        deadline = time.monotonic() + 30
        while "warm: torch imported" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = log_path.read_text()
        assert "warm: torch imported" in log and (in_use is not None or "device none ready" in log), log
        assert not _torch_loaded(cold.copier.pid)
    finally:
        warm.close(persist_newest=False)
        cold.close(persist_newest=False)
